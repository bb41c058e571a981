//! `dflash generate`: one prompt (argument or stdin) in, streamed answer out.

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::session::run_batch;
use dflash_engine::{Completion, Request, RowStats};
use serde_json::json;

use crate::args::{ModelArgs, OutputFormat, SamplingArgs};
use crate::load::load;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt (read from stdin when omitted).
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
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
    /// `text`: the answer on stdout and a stats line on stderr; `json`: one object.
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
    line
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

pub fn run(args: GenerateArgs) -> Result<()> {
    let params = args.sampling.params()?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.output_format == OutputFormat::Jsonl {
        bail!("--output-format jsonl needs --batch");
    }
    let prompt = read_prompt(&args.prompt)?;
    if prompt.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let mut loaded = load(&args.model)?;
    let ids = loaded.prompt_ids(&prompt, args.system.as_deref(), args.raw)?;
    let request = Request {
        prompt: ids,
        max_tokens: args.max_tokens,
        params,
        stop_strings: args.stop.clone(),
    };
    let text_mode = args.output_format == OutputFormat::Text;
    let stdout = std::io::stdout();
    let mut on_text = |_: usize, piece: &str| {
        if text_mode {
            let mut out = stdout.lock();
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
    };
    let mut results = run_batch(
        loaded.decoder.as_mut(),
        &loaded.tokenizer,
        &[request],
        &mut on_text,
    )?;
    let c: Completion = results.remove(0);
    if text_mode {
        println!();
        eprintln!("{}", stats_line(&c.stats));
    } else {
        let v = json!({
            "text": c.text,
            "tokens": c.tokens,
            "finish_reason": c.finish_reason,
            "stats": stats_json(&c.stats),
        });
        println!("{v}");
    }
    Ok(())
}
