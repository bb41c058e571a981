//! `dflash bench`: throughput, median of repeated runs after a warm-up, arms alternating.
//!
//! Without a drafter: prefill and decode tok/s of plain decoding. With a drafter: plain vs
//! DFlash on the same chat prompts (`ar_tok_per_s`, `dflash_tok_per_s`, `tau`). With
//! `--batch N`: B = 1 against B = N rows decoded together, per-row accepts against the clamp,
//! over a queue of `--batch-queue` requests (4 x N) so the batch stays full but at the end.
//! `--requests R`: a serving-style load (see `bench_load`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_engine::dflash::AcceptPolicy;
use dflash_engine::prefill::DEFAULT_BATCH_TOKENS;
use dflash_engine::session::run_scheduled;
use dflash_engine::{Decoder, Request, RowStats, SamplingParams};
use dflash_models::chat::{conversation_ids, Message};
use dflash_models::tokenizer::TextTokenizer;
use serde_json::{json, Value};

use crate::args::{BatchAccept, DraftArgs, ModelArgs};
use crate::bench_load::{arm_line, arm_report, load_run, LoadRun};
use crate::bench_probe::{probe_line, probe_report, probe_request, probe_run};
use crate::bench_verify::{split_lines, verify_cost, verify_line};
#[cfg(feature = "cuda")]
use crate::load::DeviceTarget;
use crate::load::{decoder, drafter_dir, load_target, Loaded};
use crate::paths::paths_json;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Prompt length for the prefill measurement.
    #[arg(short = 'p', long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per row for the decode measurements.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Timed runs per arm after the warm-up (the median is reported).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub repetitions: usize,
    /// Rows decoded together: compares B = 1, B = N per-row and B = N clamp.
    #[arg(long, conflicts_with = "requests")]
    pub batch: Option<usize>,
    /// Requests each arm of --batch decodes (the prompts cycled): the B = N arms keep N rows
    /// live, a waiting request joining as a row finishes, so only the last rows run short of
    /// N; the B = 1 arm decodes the same requests one after another. Default: 4 x N.
    #[arg(long, requires = "batch")]
    pub batch_queue: Option<usize>,
    /// A serving-style load instead: R requests (the prompts cycled) queued at once, at most
    /// --max-live rows decoding together; reports tok/s, requests/s, time-to-first-token and
    /// inter-token-latency percentiles for plain decoding and, with a drafter, DFlash.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Rows decoding at once under --requests (waiting requests join as rows finish).
    #[arg(long, default_value_t = 16, requires = "requests")]
    pub max_live: usize,
    /// Token budget of one decoding step in the batched and --requests runs: the live rows'
    /// own tokens, then pieces of joining rows' prompts (chunked prefill) in the rest, but
    /// always at least a quarter of it for those pieces, so rows join even while the live
    /// rows' verify blocks fill it (a step then runs up to their tokens plus that quarter).
    #[arg(long, default_value_t = DEFAULT_BATCH_TOKENS)]
    pub max_batch_tokens: usize,
    /// With --requests: also the time to first token of a prompt of this many tokens that
    /// joins a batch of --max-live busy rows (5 prompts per run, after a warm-up run; plain
    /// decoding and, with a drafter, DFlash).
    #[arg(long, requires = "requests")]
    pub join_probe: Option<usize>,
    /// Chat prompts for the decode comparisons (JSONL lines: a string or {"prompt": ...});
    /// default: a built-in set of eight.
    #[arg(long)]
    pub prompts: Option<PathBuf>,
}

/// Text the prefill prompt is cut from (real tokens, not random ids).
const CORPUS: &str = "The history of computing is a story of abstraction. Early machines were \
programmed by rewiring panels; later, stored programs let the same hardware run any algorithm. \
Languages rose from assembly to structured code, then to objects and functions, each layer \
hiding details so that people could think about larger problems. Networks joined machines into \
systems, and systems into the web, where text, images and code now move at the speed of light. ";

/// Chat prompts used when none are given.
const PROMPTS: [&str; 8] = [
    "Explain how a refrigerator works.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying productive while working from home?",
    "Describe the water cycle in simple terms.",
    "Write a short poem about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a two-day itinerary for a trip to Rome.",
    "Why do leaves change color in the fall?",
];

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The CPU model name, for the record.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// Prefill of `prompt`, then decoding to `gen` tokens (end-of-sequence ignored): (pp, tg).
fn plain_run(decoder: &mut dyn Decoder, prompt: &[u32], gen: usize) -> Result<(f64, f64)> {
    let capacity = prompt.len() + gen + decoder.lookahead() + 1;
    let t0 = Instant::now();
    let (row, _) = decoder.start_row(prompt, capacity, &SamplingParams::greedy())?;
    let prefill = t0.elapsed().as_secs_f64();
    let mut produced = 1usize;
    let mut out = Vec::new();
    let t1 = Instant::now();
    while produced < gen {
        out.clear();
        decoder.step(&mut out)?;
        produced += out.iter().map(|(_, t)| t.len()).sum::<usize>();
    }
    let decode = t1.elapsed().as_secs_f64();
    decoder.finish_row(row);
    Ok((
        prompt.len() as f64 / prefill,
        (produced - 1) as f64 / decode,
    ))
}

/// GPU time per decode step by kernel class (CUDA events around every launch; graphs are
/// off while profiling, so the sum is kernel time without the launch gaps a graph removes):
/// one prefill of `prompt`, then `gen` profiled steps.
#[cfg(feature = "cuda")]
fn kernel_split(
    decoder: &mut dyn Decoder,
    backend: &dflash_runtime::cuda::CudaBackend,
    prompt: &[u32],
    gen: usize,
) -> Result<Value> {
    let capacity = prompt.len() + gen + decoder.lookahead() + 1;
    let (row, _) = decoder.start_row(prompt, capacity, &SamplingParams::greedy())?;
    backend.set_profiling(true);
    let mut out = Vec::new();
    for _ in 1..gen {
        out.clear();
        decoder.step(&mut out)?;
    }
    let prof = backend.take_profile();
    backend.set_profiling(false);
    decoder.finish_row(row);
    let steps = (gen - 1).max(1) as f64;
    let total: f64 = prof.iter().map(|c| c.ms).sum();
    Ok(json!({
        "steps": gen - 1,
        "kernel_us_per_step": 1000.0 * total / steps,
        "classes": prof.iter().map(|c| json!({
            "class": c.class,
            "us_per_step": 1000.0 * c.ms / steps,
            "launches_per_step": c.launches as f64 / steps,
            "share": c.ms / total.max(f64::MIN_POSITIVE),
        })).collect::<Vec<_>>(),
    }))
}

/// One arm's measurement over a prompt set.
#[derive(Clone, Debug, Default)]
struct ArmRun {
    tok_per_s: f64,
    /// Requests decoded and tokens they wrote.
    requests: usize,
    tokens: usize,
    stats: RowStats,
}

/// Decodes every request with at most `max_live` rows at a time; tok/s over wall time.
fn arm_run(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    max_live: usize,
) -> Result<ArmRun> {
    let t0 = Instant::now();
    let done = run_scheduled(decoder, tok, requests, max_live, &mut |_, _| {})?;
    let wall = t0.elapsed().as_secs_f64();
    let mut stats = RowStats::default();
    for c in &done {
        stats.merge(&c.stats);
    }
    let tokens: usize = done.iter().map(|c| c.tokens.len()).sum();
    Ok(ArmRun {
        tok_per_s: tokens as f64 / wall,
        requests: done.len(),
        tokens,
        stats,
    })
}

fn read_prompts(path: &Option<PathBuf>) -> Result<Vec<String>> {
    let Some(p) = path else {
        return Ok(PROMPTS.iter().map(|s| s.to_string()).collect());
    };
    let text =
        std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
    let mut out = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not JSON", p.display(), n + 1))?;
        let s = v
            .as_str()
            .or_else(|| v.get("prompt").and_then(Value::as_str))
            .with_context(|| {
                format!(
                    "{} line {}: expected a string or {{\"prompt\": ...}}",
                    p.display(),
                    n + 1
                )
            })?;
        out.push(s.to_string());
    }
    if out.is_empty() {
        bail!("{} holds no prompts", p.display());
    }
    Ok(out)
}

/// Greedy chat requests of `max_tokens` tokens, one per prompt.
fn chat_requests(model: &Loaded, texts: &[String], max_tokens: usize) -> Result<Vec<Request>> {
    texts
        .iter()
        .map(|t| {
            Ok(Request {
                prompt: conversation_ids(
                    &model.tokenizer,
                    model.template.as_ref(),
                    &[Message::new("user", t)],
                    false,
                )?,
                max_tokens,
                params: SamplingParams::greedy(),
                stop_strings: Vec::new(),
            })
        })
        .collect()
}

/// `--requests R`: plain decoding and (with a drafter) DFlash under the same queued load,
/// arms alternating after one warm-up run each.
fn run_load(args: &BenchArgs, plain: Loaded, drafter: Option<PathBuf>, n: usize) -> Result<()> {
    let texts = read_prompts(&args.prompts)?;
    let texts: Vec<String> = texts.iter().cycle().take(n).cloned().collect();
    let requests = chat_requests(&plain, &texts, args.gen_tokens)?;
    let mut report = json!({
        "model": plain.name,
        "model_path": plain.path,
        "device": plain.device,
        "cpu": cpu_name(),
        "requests": n,
        "max_live": args.max_live,
        "max_batch_tokens": args.max_batch_tokens,
        "max_tokens": args.gen_tokens,
        "repetitions": args.repetitions,
        "warmup_runs": 1,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "matmul": paths_json(&plain.matmul),
    });
    let mut arms = vec![("ar", plain)];
    if let Some(dir) = drafter {
        let mut per_row = args.draft.clone();
        per_row.batch_accept = BatchAccept::PerRow;
        let mut spec = decoder(load_target(&args.model)?, Some(&dir), &per_row)?;
        spec.decoder.set_batch_tokens(args.max_batch_tokens);
        arms.push(("dflash", spec));
        report["drafter"] = json!(dir);
    }
    let mut runs: Vec<Vec<LoadRun>> = vec![Vec::new(); arms.len()];
    for rep in 0..=args.repetitions {
        for (k, (_, m)) in arms.iter_mut().enumerate() {
            let r = load_run(m.decoder.as_mut(), &m.tokenizer, &requests, args.max_live)?;
            if rep > 0 {
                runs[k].push(r);
            }
        }
    }
    let reports: Vec<Value> = arms
        .iter()
        .zip(&runs)
        .map(|((name, _), r)| arm_report(name, r))
        .collect();
    if reports.len() == 2 {
        let tps = |r: &Value| r["tok_per_s"].as_f64().unwrap_or(0.0);
        report["dflash_vs_ar"] = json!(tps(&reports[1]) / tps(&reports[0]).max(1e-9));
    }
    let mut lines: Vec<String> = reports.iter().map(arm_line).collect();
    report["arms"] = json!(reports);
    if let Some(len) = args.join_probe {
        let probes = join_probes(args, &mut arms, &requests, len)?;
        lines.extend(probes.iter().map(probe_line));
        report["join_probe"] = json!(probes);
    }
    crate::output::line(&report.to_string())?;
    eprintln!(
        "| {} | {} | {n} requests, {} live, {} tokens each |",
        report["model"].as_str().unwrap_or("?"),
        report["device"].as_str().unwrap_or("?"),
        args.max_live,
        args.gen_tokens
    );
    for l in lines {
        eprintln!("{l}");
    }
    Ok(())
}

/// `--join-probe`: per arm, a warm-up run then `--repetitions` timed runs of
/// [`probe_run`] with `--max-live` background rows from `requests` (their token limits raised
/// to the context, so the batch stays busy).
fn join_probes(
    args: &BenchArgs,
    arms: &mut [(&str, Loaded)],
    requests: &[Request],
    len: usize,
) -> Result<Vec<Value>> {
    let probe = probe_request(requests, len)?;
    let mut reports = Vec::new();
    for (name, m) in arms.iter_mut() {
        let ctx = m.decoder.context_length();
        let background: Vec<Request> = requests
            .iter()
            .map(|r| Request {
                max_tokens: ctx,
                ..r.clone()
            })
            .collect();
        let mut runs = Vec::new();
        for rep in 0..=args.repetitions {
            let r = probe_run(
                m.decoder.as_mut(),
                &m.tokenizer,
                &background,
                &probe,
                args.max_live,
            )?;
            if rep > 0 {
                runs.push(r);
            }
        }
        reports.push(probe_report(name, len, &runs));
    }
    Ok(reports)
}

/// Milliseconds per round (0 without rounds).
fn per_round(seconds: f64, rounds: usize) -> f64 {
    if rounds == 0 {
        0.0
    } else {
        1e3 * seconds / rounds as f64
    }
}

fn arm_json(name: &str, runs: &[ArmRun]) -> Value {
    let last = runs.last().cloned().unwrap_or_default();
    json!({
        "arm": name,
        "tok_per_s": median(runs.iter().map(|r| r.tok_per_s).collect()),
        "runs_tok_per_s": runs.iter().map(|r| r.tok_per_s).collect::<Vec<_>>(),
        "requests": last.requests,
        "tokens": last.tokens,
        "tau": last.stats.tau(),
        "rounds": last.stats.rounds,
        "accepted": last.stats.accepted,
        "committed_accepts_per_row_round": if last.stats.rounds > 0 {
            last.stats.accepted as f64 / last.stats.rounds as f64
        } else { 0.0 },
        "acceptance_by_position": last.stats.acceptance_by_position(),
        "draft_ms_per_round": per_round(last.stats.draft_s, last.stats.rounds),
        "verify_ms_per_round": per_round(last.stats.verify_s, last.stats.rounds),
        "commit_ms_per_round": per_round(last.stats.commit_s, last.stats.rounds),
    })
}

pub fn run(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.repetitions == 0 {
        bail!("--prompt-tokens must be >= 1, --gen-tokens >= 2 and --repetitions >= 1");
    }
    if args.batch == Some(0) || args.batch_queue == Some(0) {
        bail!("--batch and --batch-queue must be at least 1");
    }
    if args.requests == Some(0)
        || args.max_live == 0
        || args.max_batch_tokens == 0
        || args.join_probe == Some(0)
    {
        bail!("--requests, --max-live, --max-batch-tokens and --join-probe must be at least 1");
    }
    let probe = load_target(&args.model)?;
    #[cfg(feature = "cuda")]
    let cuda = match &probe.target {
        DeviceTarget::Cuda(b, _) => Some(b.clone()),
        DeviceTarget::Cpu(..) => None,
    };
    let drafter = drafter_dir(&args.draft, &probe)?;
    let mut plain_args = args.draft.clone();
    plain_args.no_draft = true;
    let mut plain = decoder(probe, None, &plain_args)?;
    plain.decoder.set_batch_tokens(args.max_batch_tokens);
    if let Some(n) = args.requests {
        return run_load(&args, plain, drafter, n);
    }
    let ctx = plain.decoder.context_length();
    if args.prompt_tokens + args.gen_tokens + 1 > ctx {
        bail!("prompt plus generated tokens exceed the model's context of {ctx}");
    }

    // Prefill and plain decode on a fixed-length prompt.
    let unit = plain.tokenizer.encode(CORPUS, false)?;
    let prompt: Vec<u32> = unit
        .iter()
        .copied()
        .cycle()
        .take(args.prompt_tokens)
        .collect();
    plain_run(plain.decoder.as_mut(), &prompt, args.gen_tokens)?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for _ in 0..args.repetitions {
        let (p, t) = plain_run(plain.decoder.as_mut(), &prompt, args.gen_tokens)?;
        pp.push(p);
        tg.push(t);
    }
    let mut report = json!({
        "model": plain.name,
        "model_path": plain.path,
        "device": plain.device,
        "cpu": cpu_name(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "repetitions": args.repetitions,
        "warmup_runs": 1,
        "prefill_tok_per_s": median(pp.clone()),
        "decode_tok_per_s": median(tg.clone()),
        "prefill_runs": pp,
        "decode_runs": tg,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "matmul_mode": std::env::var("DFLASH_MATMUL").unwrap_or_else(|_| "auto".into()),
        "matmul": paths_json(&plain.matmul),
    });
    // A verify block (the DFlash block, 16 without a drafter) against a decode step.
    let block = args.draft.block_size.unwrap_or(16);
    report["verify"] = verify_cost(
        load_target(&args.model)?.target,
        &prompt,
        block,
        5 * args.repetitions,
    )?;
    let mut matmul = plain.matmul.clone();
    #[cfg(feature = "cuda")]
    if let Some(b) = &cuda {
        let split = kernel_split(plain.decoder.as_mut(), b, &prompt, args.gen_tokens)?;
        report["graphs"] = json!(b.graphs_enabled());
        report["kernel_split"] = split;
    }
    let mut table = vec![format!(
        "| {} | {} | pp{} {:.1} tok/s | tg{} {:.1} tok/s |",
        plain.name,
        plain.device,
        args.prompt_tokens,
        report["prefill_tok_per_s"].as_f64().unwrap_or(0.0),
        args.gen_tokens,
        report["decode_tok_per_s"].as_f64().unwrap_or(0.0)
    )];

    table.push(verify_line(&report["verify"]));
    table.extend(split_lines(&report["verify"]));
    if let Some(split) = report.get("kernel_split") {
        let classes = split["classes"].as_array().cloned().unwrap_or_default();
        table.push(format!(
            "| kernel time per decode step {:.1} us | {} |",
            split["kernel_us_per_step"].as_f64().unwrap_or(0.0),
            classes
                .iter()
                .map(|c| format!(
                    "{} {:.1} us ({:.1} launches)",
                    c["class"].as_str().unwrap_or("?"),
                    c["us_per_step"].as_f64().unwrap_or(0.0),
                    c["launches_per_step"].as_f64().unwrap_or(0.0)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }

    if let Some(dir) = drafter {
        let texts = read_prompts(&args.prompts)?;
        let requests = chat_requests(&plain, &texts, args.gen_tokens)?;
        let mut per_row_args = args.draft.clone();
        per_row_args.batch_accept = BatchAccept::PerRow;
        let mut clamp_args = args.draft.clone();
        clamp_args.batch_accept = BatchAccept::Clamp;
        let mut spec = decoder(load_target(&args.model)?, Some(&dir), &per_row_args)?;
        spec.decoder.set_batch_tokens(args.max_batch_tokens);
        report["drafter"] = json!(dir);
        report["matmul"] = paths_json(&spec.matmul);
        matmul = spec.matmul.clone();
        report["prompts"] = json!(texts.len());
        match args.batch {
            None => {
                // Plain vs DFlash, one row at a time, alternating.
                arm_run(plain.decoder.as_mut(), &plain.tokenizer, &requests, 1)?;
                arm_run(spec.decoder.as_mut(), &spec.tokenizer, &requests, 1)?;
                let (mut ar, mut df) = (Vec::new(), Vec::new());
                for _ in 0..args.repetitions {
                    ar.push(arm_run(
                        plain.decoder.as_mut(),
                        &plain.tokenizer,
                        &requests,
                        1,
                    )?);
                    df.push(arm_run(
                        spec.decoder.as_mut(),
                        &spec.tokenizer,
                        &requests,
                        1,
                    )?);
                }
                let ar_tps = median(ar.iter().map(|r| r.tok_per_s).collect());
                let df_tps = median(df.iter().map(|r| r.tok_per_s).collect());
                let last = df.last().map(|r| r.stats.clone()).unwrap_or_default();
                let tau = last.tau();
                report["ar_tok_per_s"] = json!(ar_tps);
                report["dflash_tok_per_s"] = json!(df_tps);
                report["speedup"] = json!(df_tps / ar_tps);
                report["tau"] = json!(tau);
                report["arms"] = json!([arm_json("ar", &ar), arm_json("dflash", &df)]);
                table.push(format!(
                    // Host wall time of each phase: on a GPU the forwards return once
                    // launched, so the verify's device time lands in commit, where its
                    // accept counts are read back.
                    "| AR {:.1} tok/s | DFlash {:.1} tok/s | {:.2}x | tau {:.2} | host ms per round: draft {:.3}, verify {:.3}, commit {:.3} |",
                    ar_tps,
                    df_tps,
                    df_tps / ar_tps,
                    tau,
                    per_round(last.draft_s, last.rounds),
                    per_round(last.verify_s, last.rounds),
                    per_round(last.commit_s, last.rounds),
                ));
            }
            Some(n) => {
                let mut clamp = decoder(load_target(&args.model)?, Some(&dir), &clamp_args)?;
                let queue = args.batch_queue.unwrap_or(4 * n);
                let rows: Vec<Request> = requests.iter().cycle().take(queue).cloned().collect();
                let arms: [(&str, usize); 3] = [("b1", 1), ("per_row", n), ("clamp", n)];
                let mut runs: Vec<Vec<ArmRun>> = vec![Vec::new(); 3];
                for rep in 0..=args.repetitions {
                    for (k, (_, live)) in arms.iter().enumerate() {
                        let dec: &mut Loaded = if k == 2 { &mut clamp } else { &mut spec };
                        let r = arm_run(dec.decoder.as_mut(), &dec.tokenizer, &rows, *live)?;
                        if rep > 0 {
                            runs[k].push(r);
                        }
                    }
                }
                let tps: Vec<f64> = runs
                    .iter()
                    .map(|r| median(r.iter().map(|x| x.tok_per_s).collect()))
                    .collect();
                report["batch"] = json!(n);
                report["batch_queue"] = json!(queue);
                report["policy_default"] = json!(format!("{:?}", AcceptPolicy::from_env()));
                report["arms"] = json!(arms
                    .iter()
                    .zip(&runs)
                    .map(|((name, _), r)| arm_json(name, r))
                    .collect::<Vec<_>>());
                report["per_row_vs_clamp"] = json!(tps[1] / tps[2]);
                report["batch_vs_b1"] = json!(tps[1] / tps[0]);
                table.push(format!(
                    "| {queue} requests | B=1 {:.1} tok/s | B={n} per-row {:.1} tok/s | B={n} clamp {:.1} tok/s | per-row/clamp {:.2}x | per-row/B=1 {:.2}x |",
                    tps[0], tps[1], tps[2], tps[1] / tps[2], tps[1] / tps[0]
                ));
            }
        }
    }
    for p in &matmul {
        table.push(format!(
            "| {} {} | K x N {}x{} | {} |",
            p.model, p.name, p.cols, p.rows, p.path
        ));
    }
    crate::output::line(&report.to_string())?;
    for line in table {
        eprintln!("{line}");
    }
    Ok(())
}
