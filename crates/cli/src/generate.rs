//! `dflash generate`: one prompt (argument or stdin) in, streamed answer out.

use std::io::Read;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::prefill::DEFAULT_BATCH_TOKENS;
use dflash_engine::session::run_scheduled;
use dflash_engine::{Batch, Completion, Event, Request, RowStats};
use dflash_models::ProjectionPath;
use serde_json::json;

use dflash_server::validate::{batch_line, BatchLine};

use crate::args::{DraftArgs, ModelArgs, OutputFormat, SamplingArgs, Speculation};
use crate::load::{load, Loaded};
use crate::output;
use crate::paths::{paths_json, paths_summary};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt (read from stdin when omitted).
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Generate for every line of a JSONL file (`{"prompt": ..., "max_tokens": N}`), rows
    /// decoded together; with `--output-format jsonl`, one result line per input line.
    #[arg(long, conflicts_with = "prompt")]
    pub batch: Option<std::path::PathBuf>,
    /// Most rows decoding at once with --batch (others join as rows finish).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Token budget of one decoding step with --batch: the live rows' own tokens, then
    /// pieces of joining rows' prompts (chunked prefill) in the rest, but always at least a
    /// quarter of it for those pieces, so rows join even while the live rows' verify blocks
    /// fill it (a step then runs up to their tokens plus that quarter).
    #[arg(long, default_value_t = DEFAULT_BATCH_TOKENS)]
    pub max_batch_tokens: usize,
    /// Most tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Use the prompt as plain text, without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// A system message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Stop when the output contains this text (repeatable; the text is not included).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// `text`: the answer on stdout and a stats line on stderr; `json`: one object; `jsonl`:
    /// one object per --batch line.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output_format: OutputFormat,
}

/// The `stats` object of the JSON output.
pub fn stats_json(s: &RowStats) -> serde_json::Value {
    let mut v = json!({
        "prompt_tokens": s.prompt_tokens,
        "prefill_s": s.prefill_s,
        "prefill_tok_per_s": s.prefill_tok_per_s(),
        "generated_tokens": s.generated_tokens,
        "decode_s": s.decode_s,
        "decode_tok_per_s": s.decode_tok_per_s(),
    });
    if s.rounds > 0 {
        v["rounds"] = json!(s.rounds);
        v["drafted"] = json!(s.drafted);
        v["accepted"] = json!(s.accepted);
        v["tau"] = json!(s.tau());
        v["acceptance_by_position"] = json!(s.acceptance_by_position());
        v["draft_s"] = json!(s.draft_s);
        v["verify_s"] = json!(s.verify_s);
        v["commit_s"] = json!(s.commit_s);
    }
    if s.plain_steps > 0 {
        v["plain_steps"] = json!(s.plain_steps);
    }
    v
}

/// The human stats line.
pub fn stats_line(s: &RowStats) -> String {
    let mut line = format!(
        "prompt {} tok, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s",
        s.prompt_tokens,
        s.prefill_tok_per_s(),
        s.generated_tokens,
        s.decode_tok_per_s()
    );
    if s.rounds > 0 {
        let by_pos: Vec<String> = s
            .acceptance_by_position()
            .iter()
            .map(|a| format!("{:.0}", a * 100.0))
            .collect();
        let total = (s.draft_s + s.verify_s + s.commit_s).max(f64::MIN_POSITIVE);
        line.push_str(&format!(
            " | rounds {}, tau {:.2}, accept% by slot [{}], time draft {:.0}% verify {:.0}% commit {:.0}%",
            s.rounds,
            s.tau(),
            by_pos.join(" "),
            100.0 * s.draft_s / total,
            100.0 * s.verify_s / total,
            100.0 * s.commit_s / total
        ));
    }
    if s.plain_steps > 0 {
        line.push_str(&format!(", plain steps {}", s.plain_steps));
    }
    line
}

/// `generate` drafts only where it pays unless told otherwise.
fn generate_draft_args(draft: &DraftArgs) -> DraftArgs {
    let mut d = draft.clone();
    d.speculation.get_or_insert(Speculation::Auto);
    d
}

fn read_prompt(arg: &Option<String>) -> Result<String> {
    match arg {
        Some(p) => Ok(p.clone()),
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("cannot read the prompt from stdin")?;
            Ok(s)
        }
    }
}

fn read_batch(path: &std::path::Path) -> Result<Vec<BatchLine>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the batch file {}", path.display()))?;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let l = batch_line(line)
            .map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1))?;
        lines.push(l);
    }
    if lines.is_empty() {
        bail!("the batch file {} has no prompts", path.display());
    }
    Ok(lines)
}

fn result_json(c: &Completion, matmul: &[ProjectionPath]) -> serde_json::Value {
    let mut stats = stats_json(&c.stats);
    stats["matmul"] = paths_json(matmul);
    json!({
        "text": c.text,
        "tokens": c.tokens,
        "finish_reason": c.finish_reason,
        "stats": stats,
    })
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.params()?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.max_batch == 0 || args.max_batch_tokens == 0 {
        bail!("--max-batch and --max-batch-tokens must be at least 1");
    }
    if let Some(path) = &args.batch {
        if args.output_format == OutputFormat::Json {
            bail!("--output-format json prints one object; with --batch use --output-format jsonl (one object per line)");
        }
        return run_batch_file(&args, path, params);
    }
    if args.output_format == OutputFormat::Jsonl {
        bail!("--output-format jsonl needs --batch");
    }
    let prompt = read_prompt(&args.prompt)?;
    if prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let mut loaded = load(&args.model, &generate_draft_args(&args.draft))?;
    let ids = loaded.prompt_ids(&prompt, args.system.as_deref(), args.raw)?;
    let request = Request {
        prompt: ids,
        max_tokens: args.max_tokens,
        params,
        stop_strings: args.stop.clone(),
    };
    let text_mode = args.output_format == OutputFormat::Text;
    let c = decode_one(&mut loaded, &request, text_mode)?;
    if text_mode {
        output::line("")?;
        eprintln!("{}", stats_line(&c.stats));
        eprintln!("matmul: {}", paths_summary(&loaded.matmul));
    } else {
        output::line(&result_json(&c, &loaded.matmul).to_string())?;
    }
    Ok(())
}

/// Decodes one request, streaming its text to stdout when `stream` is set; a failed write
/// stops decoding at once.
fn decode_one(loaded: &mut Loaded, request: &Request, stream: bool) -> Result<Completion> {
    let decoder = loaded.decoder.as_mut();
    let tok = &loaded.tokenizer;
    let mut batch = Batch::new();
    let mut events = Vec::new();
    let mut done = None;
    let mut result = batch.admit(decoder, tok, 0, request, &mut events);
    loop {
        if let Err(e) = result {
            batch.abort(decoder);
            return Err(e.into());
        }
        for e in events.drain(..) {
            match e {
                Event::Progress { text, .. } if stream && !text.is_empty() => {
                    if let Err(err) = output::write(&text) {
                        batch.abort(decoder);
                        return Err(err);
                    }
                }
                Event::Progress { .. } => {}
                Event::Done { completion, .. } => done = Some(completion),
            }
        }
        if let Some(c) = done.take() {
            return Ok(c);
        }
        result = batch.step(decoder, tok, &mut events);
    }
}

fn run_batch_file(
    args: &GenerateArgs,
    path: &std::path::Path,
    params: dflash_engine::SamplingParams,
) -> Result<()> {
    let lines = read_batch(path)?;
    let mut loaded = load(&args.model, &generate_draft_args(&args.draft))?;
    loaded.decoder.set_batch_tokens(args.max_batch_tokens);
    let mut requests = Vec::with_capacity(lines.len());
    for (i, l) in lines.iter().enumerate() {
        let mut p = params.clone();
        p.seed = params.seed.wrapping_add(i as u64);
        requests.push(Request {
            prompt: loaded.prompt_ids(&l.prompt, args.system.as_deref(), args.raw)?,
            max_tokens: l.max_tokens.unwrap_or(args.max_tokens),
            params: p,
            stop_strings: args.stop.clone(),
        });
    }
    let t0 = std::time::Instant::now();
    let results = run_scheduled(
        loaded.decoder.as_mut(),
        &loaded.tokenizer,
        &requests,
        args.max_batch,
        &mut |_, _| {},
    )?;
    let wall = t0.elapsed().as_secs_f64();
    match args.output_format {
        // (json was refused with --batch before loading)
        OutputFormat::Jsonl | OutputFormat::Json => {
            for c in &results {
                output::line(&result_json(c, &loaded.matmul).to_string())?;
            }
        }
        OutputFormat::Text => {
            for (i, c) in results.iter().enumerate() {
                output::line(&format!("--- {} ---\n{}", i + 1, c.text))?;
            }
        }
    }
    let mut total = dflash_engine::RowStats::default();
    for c in &results {
        total.merge(&c.stats);
    }
    let tokens: usize = results.iter().map(|c| c.tokens.len()).sum();
    eprintln!(
        "{} rows, {tokens} tokens in {wall:.2} s ({:.1} tok/s overall) | {}",
        results.len(),
        tokens as f64 / wall,
        stats_line(&total)
    );
    eprintln!("matmul: {}", paths_summary(&loaded.matmul));
    Ok(())
}
