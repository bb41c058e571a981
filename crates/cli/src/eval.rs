//! `dflash eval`: how well a drafter guesses the target.
//!
//! Runs a prompt set (the MT-Bench first turns, the held-out ShareGPT prompts, or a JSONL file)
//! through DFlash decoding, each prompt as a user message through the model's chat template,
//! and reports τ — the mean number of tokens committed per speculative round (the accepted
//! drafts plus the target's own bonus token) — and the acceptance rate at every block slot:
//! the fraction of rounds in which the draft at slot i (i = 1..B-1) was accepted.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{ArgGroup, Args, ValueEnum};
use dflash_engine::session::{run_observed, Observer};
use dflash_engine::{Completion, Event, FinishReason, Request, RowStats, SamplingParams};
use dflash_models::dflash::DrafterConfig;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::args::{DraftArgs, ModelArgs, SamplingArgs, Speculation};
use crate::load::{decoder, drafter_dir, load_target};

/// Prompt sets that ship with the source tree.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataset {
    /// The first turns of the 80 MT-Bench questions (data/mt_bench_first_turns.jsonl).
    MtBench,
    /// 500 ShareGPT prompts held out of drafter training (training/data/sharegpt_heldout.jsonl).
    SharegptHeldout,
}

impl Dataset {
    fn name(self) -> &'static str {
        match self {
            Dataset::MtBench => "mt-bench",
            Dataset::SharegptHeldout => "sharegpt-heldout",
        }
    }

    /// The file, relative to the repository root.
    fn relative_path(self) -> &'static str {
        match self {
            Dataset::MtBench => "data/mt_bench_first_turns.jsonl",
            Dataset::SharegptHeldout => "training/data/sharegpt_heldout.jsonl",
        }
    }

    /// Where the file comes from, for the error when it is missing.
    fn origin(self) -> &'static str {
        match self {
            Dataset::MtBench => "it is written by tools/make_mtbench_prompts.py",
            Dataset::SharegptHeldout => "it is part of the drafter training data in the repository",
        }
    }
}

/// Output formats of `eval`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalFormat {
    /// A readable summary.
    Text,
    /// One JSON object.
    Json,
}

#[derive(Args, Debug)]
#[command(group(ArgGroup::new("source").required(true).args(["prompts", "dataset"])))]
pub struct EvalArgs {
    /// A JSONL prompt file: each line a JSON string or an object with a `prompt` field
    /// (`question_id` and `category`, when present, are carried into the JSON output).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// A prompt set shipped with the source tree.
    #[arg(long, value_enum)]
    pub dataset: Option<Dataset>,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Most tokens to generate per prompt.
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_tokens: usize,
    /// Rows decoding together (others join as rows finish); 1 runs the prompts one by one.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// A system message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// `text`: a readable summary; `json`: one object with τ, acceptance by position and
    /// per-prompt results.
    #[arg(long, value_enum, default_value_t = EvalFormat::Text)]
    pub output_format: EvalFormat,
}

/// One prompt of the set.
#[derive(Clone, Debug, PartialEq)]
struct EvalPrompt {
    text: String,
    question_id: Option<Value>,
    category: Option<String>,
}

/// Reads a JSONL prompt file; blank lines are skipped.
fn read_prompts(path: &Path) -> Result<Vec<EvalPrompt>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the prompt file {}", path.display()))?;
    parse_prompts(&text, &path.display().to_string())
}

fn parse_prompts(text: &str, what: &str) -> Result<Vec<EvalPrompt>> {
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{what} line {}", n + 1);
        let v: Value =
            serde_json::from_str(line).with_context(|| format!("{}: not valid JSON", at()))?;
        let p = match v {
            Value::String(s) => EvalPrompt {
                text: s,
                question_id: None,
                category: None,
            },
            Value::Object(m) => match m.get("prompt") {
                Some(Value::String(s)) => EvalPrompt {
                    text: s.clone(),
                    question_id: m.get("question_id").cloned(),
                    category: m
                        .get("category")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                },
                _ => bail!("{}: the object has no string `prompt` field", at()),
            },
            _ => bail!(
                "{}: expected a JSON string or an object with a `prompt` field",
                at()
            ),
        };
        if p.text.trim().is_empty() {
            bail!("{}: the prompt is empty", at());
        }
        prompts.push(p);
    }
    if prompts.is_empty() {
        bail!("{what} has no prompts");
    }
    Ok(prompts)
}

/// Finds a file of the source tree the way the shipped drafter is found: next to the build
/// (`target/<profile>/dflash` three levels below the root), then from the crate's sources.
fn repo_file(relative: &str) -> (Option<PathBuf>, Vec<PathBuf>) {
    let candidates: Vec<PathBuf> = [
        std::env::current_exe().ok().and_then(|e| {
            e.parent()?
                .parent()?
                .parent()
                .map(|root| root.join(relative))
        }),
        Some(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(relative),
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    let found = candidates.iter().find(|p| p.is_file()).cloned();
    (found, candidates)
}

fn dataset_path(d: Dataset) -> Result<PathBuf> {
    let (found, looked) = repo_file(d.relative_path());
    found.ok_or_else(|| {
        let looked: Vec<String> = looked.iter().map(|p| p.display().to_string()).collect();
        anyhow::anyhow!(
            "dataset `{}`: {} not found (looked at {}); {}",
            d.name(),
            d.relative_path(),
            looked.join(", "),
            d.origin()
        )
    })
}

/// Reports every finished request (for the progress bar).
struct Tally<'a>(&'a mut dyn FnMut(&RowStats));

impl Observer for Tally<'_> {
    fn event(&mut self, e: &Event<usize>) {
        if let Event::Done { completion, .. } = e {
            (self.0)(&completion.stats);
        }
    }
}

fn progress_bar(n: usize) -> ProgressBar {
    let bar = ProgressBar::new(n as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} prompts ({elapsed}, eta {eta})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message("eval");
    bar
}

/// Pooled counts over many rows (times summed, unlike [`RowStats::merge`]).
#[derive(Default)]
struct Totals {
    rows: usize,
    rounds: usize,
    drafted: usize,
    accepted: usize,
    accepted_at: Vec<usize>,
    prompt_tokens: usize,
    tokens: usize,
    prefill_s: f64,
    decode_s: f64,
    draft_s: f64,
    verify_s: f64,
    commit_s: f64,
}

impl Totals {
    fn add(&mut self, s: &RowStats) {
        self.rows += 1;
        self.rounds += s.rounds;
        self.drafted += s.drafted;
        self.accepted += s.accepted;
        if self.accepted_at.len() < s.accepted_at.len() {
            self.accepted_at.resize(s.accepted_at.len(), 0);
        }
        for (a, b) in self.accepted_at.iter_mut().zip(&s.accepted_at) {
            *a += b;
        }
        self.prompt_tokens += s.prompt_tokens;
        self.tokens += s.generated_tokens;
        self.prefill_s += s.prefill_s;
        self.decode_s += s.decode_s;
        self.draft_s += s.draft_s;
        self.verify_s += s.verify_s;
        self.commit_s += s.commit_s;
    }

    /// Mean tokens committed per round over every round of every row.
    fn tau(&self) -> f64 {
        ratio(self.accepted + self.rounds, self.rounds)
    }

    fn accept_by_position(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .map(|&a| ratio(a, self.rounds))
            .collect()
    }
}

fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

pub fn run(args: EvalArgs) -> Result<()> {
    let params = args.sampling.params()?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    if args.limit == Some(0) {
        bail!("--limit must be at least 1");
    }
    if args.draft.no_draft {
        bail!(
            "eval measures a drafter, and --no-draft turns it off; drop --no-draft (or pass \
             --draft DIR)"
        );
    }
    if args.draft.speculation == Some(Speculation::Auto) {
        bail!(
            "eval measures the drafter on every round; --speculation auto would skip rounds \
             (drop it)"
        );
    }
    let (source, path) = match (&args.prompts, args.dataset) {
        (Some(p), _) => (p.display().to_string(), p.clone()),
        (None, Some(d)) => (d.name().to_string(), dataset_path(d)?),
        (None, None) => bail!("give a prompt set: --prompts FILE or --dataset NAME"),
    };
    let mut prompts = read_prompts(&path)?;
    let available = prompts.len();
    if let Some(n) = args.limit {
        prompts.truncate(n);
    }

    let bundle = load_target(&args.model)?;
    let Some(draft_dir) = drafter_dir(&args.draft, &bundle)? else {
        if bundle.is_default {
            bail!(
                "eval needs a drafter, and the shipped drafter of the default model was not \
                 found next to this build; pass --draft DIR"
            );
        }
        bail!(
            "eval needs a drafter and {} has no default one; pass --draft DIR (a DFlash \
             drafter directory)",
            bundle.name
        );
    };
    let mut loaded = decoder(bundle, Some(&draft_dir), &args.draft)?;
    let trained = DrafterConfig::read(&draft_dir)
        .with_context(|| format!("cannot read the drafter at {}", draft_dir.display()))?
        .block_size;

    let ctx = loaded.decoder.context_length();
    let mut requests = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let ids = loaded
            .prompt_ids(&p.text, args.system.as_deref(), false)
            .with_context(|| format!("prompt {} of {source}", i + 1))?;
        if ids.len() + 1 > ctx {
            bail!(
                "prompt {} of {source} has {} tokens with the chat template, but the model's \
                 context holds {ctx}",
                i + 1,
                ids.len()
            );
        }
        let mut rp = params.clone();
        rp.seed = params.seed.wrapping_add(i as u64);
        requests.push(Request {
            prompt: ids,
            max_tokens: args.max_tokens,
            params: rp,
            stop_strings: Vec::new(),
        });
    }

    let bar = progress_bar(requests.len());
    let mut live = Totals::default();
    let mut on_finish = |s: &RowStats| {
        live.add(s);
        bar.set_message(format!("eval tau {:.2}", live.tau()));
        bar.inc(1);
    };
    let t0 = Instant::now();
    let results = run_observed(
        loaded.decoder.as_mut(),
        &loaded.tokenizer,
        &requests,
        args.batch,
        &mut Tally(&mut on_finish),
    );
    let wall_s = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let results = results.context("decoding failed")?;

    let mut totals = Totals::default();
    for c in &results {
        totals.add(&c.stats);
    }
    let block = totals.accepted_at.len() + 1;
    let report = Report {
        source,
        dataset: args.dataset.map(Dataset::name),
        path,
        available,
        model: loaded.name.clone(),
        drafter: draft_dir,
        device: loaded.device.clone(),
        block,
        trained,
        params: &params,
        max_tokens: args.max_tokens,
        batch: args.batch,
        wall_s,
        totals,
        prompts: &prompts,
        results: &results,
    };
    match args.output_format {
        EvalFormat::Json => crate::output::line(&report.json().to_string())?,
        EvalFormat::Text => crate::output::write(&report.text())?,
    }
    Ok(())
}

/// Everything the outputs show.
struct Report<'a> {
    source: String,
    dataset: Option<&'static str>,
    path: PathBuf,
    available: usize,
    model: String,
    drafter: PathBuf,
    device: String,
    block: usize,
    trained: usize,
    params: &'a SamplingParams,
    max_tokens: usize,
    batch: usize,
    wall_s: f64,
    totals: Totals,
    prompts: &'a [EvalPrompt],
    results: &'a [Completion],
}

impl Report<'_> {
    /// Decode rate from the rows' own decode times; only meaningful when rows ran one by one.
    fn decode_tok_per_s(&self) -> Option<f64> {
        let t = &self.totals;
        (self.batch == 1).then(|| rate(t.tokens.saturating_sub(t.rows), t.decode_s))
    }

    fn finish_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for c in self.results {
            let k = match c.finish_reason {
                FinishReason::Stop => "stop",
                FinishReason::StopString => "stop_string",
                FinishReason::Length => "length",
                FinishReason::Cancelled => "cancelled",
            };
            *m.entry(k).or_insert(0) += 1;
        }
        m
    }

    /// τ per category, when the prompts have categories.
    fn by_category(&self) -> BTreeMap<String, Totals> {
        let mut m: BTreeMap<String, Totals> = BTreeMap::new();
        for (p, c) in self.prompts.iter().zip(self.results) {
            if let Some(cat) = &p.category {
                m.entry(cat.clone()).or_default().add(&c.stats);
            }
        }
        m
    }

    fn mean_prompt_tau(&self) -> f64 {
        let taus: Vec<f64> = self
            .results
            .iter()
            .filter(|c| c.stats.rounds > 0)
            .map(|c| c.stats.tau())
            .collect();
        if taus.is_empty() {
            0.0
        } else {
            taus.iter().sum::<f64>() / taus.len() as f64
        }
    }

    fn json(&self) -> Value {
        let t = &self.totals;
        let per_prompt: Vec<Value> = self
            .prompts
            .iter()
            .zip(self.results)
            .enumerate()
            .map(|(i, (p, c))| {
                let mut v = json!({
                    "index": i,
                    "tau": c.stats.tau(),
                    "rounds": c.stats.rounds,
                    "accepted": c.stats.accepted,
                    "prompt_tokens": c.stats.prompt_tokens,
                    "tokens": c.stats.generated_tokens,
                    "finish_reason": c.finish_reason,
                });
                if let Some(q) = &p.question_id {
                    v["question_id"] = q.clone();
                }
                if let Some(cat) = &p.category {
                    v["category"] = json!(cat);
                }
                v
            })
            .collect();
        let by_category: serde_json::Map<String, Value> = self
            .by_category()
            .into_iter()
            .map(|(k, c)| {
                (
                    k,
                    json!({
                        "prompts": c.rows,
                        "tau": c.tau(),
                        "rounds": c.rounds,
                        "tokens": c.tokens,
                    }),
                )
            })
            .collect();
        let total_s = (t.draft_s + t.verify_s + t.commit_s).max(f64::MIN_POSITIVE);
        json!({
            "tau": t.tau(),
            "tau_mean_per_prompt": self.mean_prompt_tau(),
            "tokens": t.tokens,
            "rounds": t.rounds,
            "drafted": t.drafted,
            "accepted": t.accepted,
            "acceptance_rate": ratio(t.accepted, t.drafted),
            "accept_by_position": t.accept_by_position(),
            "prompts": self.results.len(),
            "prompts_available": self.available,
            "prompt_tokens": t.prompt_tokens,
            "block_size": self.block,
            "trained_block_size": self.trained,
            "temperature": self.params.temperature,
            "top_k": self.params.top_k,
            "top_p": self.params.top_p,
            "min_p": self.params.min_p,
            "repetition_penalty": self.params.repetition_penalty,
            "seed": self.params.seed,
            "max_tokens": self.max_tokens,
            "batch": self.batch,
            "dataset": self.dataset,
            "source": self.source,
            "path": self.path.display().to_string(),
            "model": self.model,
            "drafter": self.drafter.display().to_string(),
            "device": self.device,
            "finish_reasons": self.finish_counts(),
            "wall_s": self.wall_s,
            "tok_per_s": rate(t.tokens, self.wall_s),
            "prefill_tok_per_s": rate(t.prompt_tokens, t.prefill_s),
            "decode_tok_per_s": self.decode_tok_per_s(),
            "time_split": {
                "draft": t.draft_s / total_s,
                "verify": t.verify_s / total_s,
                "commit": t.commit_s / total_s,
            },
            "by_category": by_category,
            "per_prompt": per_prompt,
        })
    }

    fn text(&self) -> String {
        use std::fmt::Write;
        let t = &self.totals;
        let p = self.params;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "eval on {}: {} of {} prompts, up to {} tokens each",
            self.source,
            self.results.len(),
            self.available,
            self.max_tokens
        );
        let _ = writeln!(
            s,
            "model {} with drafter {} on {}",
            self.model,
            self.drafter.display(),
            self.device
        );
        let _ = writeln!(
            s,
            "block {} (trained {}), temperature {}, batch {}",
            self.block, self.trained, p.temperature, self.batch
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "tau {:.3} tokens/round (mean per prompt {:.3}) over {} rounds",
            t.tau(),
            self.mean_prompt_tau(),
            t.rounds
        );
        let _ = writeln!(
            s,
            "drafts accepted {} of {} ({:.1}%)",
            t.accepted,
            t.drafted,
            100.0 * ratio(t.accepted, t.drafted)
        );
        let _ = writeln!(
            s,
            "acceptance by block slot (rounds whose draft there was kept):"
        );
        for (i, a) in t.accept_by_position().iter().enumerate() {
            let bar = "#".repeat((a * 40.0).round() as usize);
            let _ = writeln!(s, "  slot {:>2}  {:>5.1}%  {bar}", i + 1, 100.0 * a);
        }
        let cats = self.by_category();
        if !cats.is_empty() {
            let _ = writeln!(s, "tau by category:");
            for (k, c) in &cats {
                let _ = writeln!(s, "  {k:<12} {:.3}  ({} prompts)", c.tau(), c.rows);
            }
        }
        let _ = writeln!(s);
        let finish: Vec<String> = self
            .finish_counts()
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        let _ = writeln!(
            s,
            "tokens {} in {:.1} s: {:.1} tok/s overall, prefill {:.1} tok/s{} | finish: {}",
            t.tokens,
            self.wall_s,
            rate(t.tokens, self.wall_s),
            rate(t.prompt_tokens, t.prefill_s),
            self.decode_tok_per_s()
                .map(|r| format!(", decode {r:.1} tok/s"))
                .unwrap_or_default(),
            finish.join(", ")
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lines_parse() {
        let text =
            "\"plain\"\n\n{\"prompt\": \"obj\", \"question_id\": 7, \"category\": \"math\"}\n";
        let p = parse_prompts(text, "f").unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].text, "plain");
        assert_eq!(p[1].question_id, Some(json!(7)));
        assert_eq!(p[1].category.as_deref(), Some("math"));
    }

    #[test]
    fn bad_prompt_lines_are_named() {
        let e = parse_prompts("\"ok\"\n{not json\n", "f").unwrap_err();
        assert!(format!("{e:#}").contains("f line 2"), "{e:#}");
        let e = parse_prompts("{\"text\": \"x\"}\n", "f").unwrap_err();
        assert!(format!("{e:#}").contains("`prompt`"), "{e:#}");
        let e = parse_prompts("42\n", "f").unwrap_err();
        assert!(format!("{e:#}").contains("expected a JSON string"), "{e:#}");
        let e = parse_prompts("\"  \"\n", "f").unwrap_err();
        assert!(format!("{e:#}").contains("empty"), "{e:#}");
        let e = parse_prompts("\n\n", "f").unwrap_err();
        assert!(format!("{e:#}").contains("no prompts"), "{e:#}");
    }

    #[test]
    fn totals_pool_rounds() {
        let mut t = Totals::default();
        t.add(&RowStats {
            rounds: 2,
            accepted: 3,
            drafted: 6,
            accepted_at: vec![2, 1, 0],
            ..Default::default()
        });
        t.add(&RowStats {
            rounds: 2,
            accepted: 1,
            drafted: 6,
            accepted_at: vec![1, 0, 0],
            ..Default::default()
        });
        assert!((t.tau() - 2.0).abs() < 1e-12);
        assert_eq!(t.accept_by_position(), vec![0.75, 0.25, 0.0]);
    }

    #[test]
    fn datasets_live_in_the_tree() {
        for d in [Dataset::MtBench, Dataset::SharegptHeldout] {
            let p = dataset_path(d).unwrap();
            assert!(read_prompts(&p).unwrap().len() >= 80, "{}", p.display());
        }
    }
}
