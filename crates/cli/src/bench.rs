//! `dflash bench`: prefill and decode throughput, median of repeated runs after a warm-up.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use dflash_engine::{Decoder, SamplingParams};
use serde_json::json;

use crate::args::ModelArgs;
use crate::load::{load, Loaded};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(short = 'p', long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated for the decode measurement (end-of-sequence ignored).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Timed runs after the warm-up (the median is reported).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub repetitions: usize,
}

/// Text the benchmark prompt is cut from (real tokens, not random ids).
const CORPUS: &str = "The history of computing is a story of abstraction. Early machines were \
programmed by rewiring panels; later, stored programs let the same hardware run any algorithm. \
Languages rose from assembly to structured code, then to objects and functions, each layer \
hiding details so that people could think about larger problems. Networks joined machines into \
systems, and systems into the web, where text, images and code now move at the speed of light. ";

/// One timed run.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub prefill_tok_per_s: f64,
    pub decode_tok_per_s: f64,
}

pub fn bench_prompt(loaded: &Loaded, n: usize) -> Result<Vec<u32>> {
    let unit = loaded.tokenizer.encode(CORPUS, false)?;
    if unit.is_empty() {
        bail!("the tokenizer produced no tokens for the benchmark text");
    }
    Ok(unit.iter().copied().cycle().take(n).collect())
}

/// Prefills `prompt`, then decodes until `gen` tokens exist (ignoring end-of-sequence).
pub fn timed_run(decoder: &mut dyn Decoder, prompt: &[u32], gen: usize) -> Result<Run> {
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
    Ok(Run {
        prefill_tok_per_s: prompt.len() as f64 / prefill,
        decode_tok_per_s: (produced - 1) as f64 / decode,
    })
}

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

pub fn run(args: BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens < 2 || args.repetitions == 0 {
        bail!("--prompt-tokens must be >= 1, --gen-tokens >= 2 and --repetitions >= 1");
    }
    let mut loaded = load(&args.model)?;
    let ctx = loaded.decoder.context_length();
    if args.prompt_tokens + args.gen_tokens + 1 > ctx {
        bail!("prompt plus generated tokens exceed the model's context of {ctx}");
    }
    let prompt = bench_prompt(&loaded, args.prompt_tokens)?;
    timed_run(loaded.decoder.as_mut(), &prompt, args.gen_tokens)?;
    let runs: Vec<Run> = (0..args.repetitions)
        .map(|_| timed_run(loaded.decoder.as_mut(), &prompt, args.gen_tokens))
        .collect::<Result<_>>()?;
    let pp = median(runs.iter().map(|r| r.prefill_tok_per_s).collect());
    let tg = median(runs.iter().map(|r| r.decode_tok_per_s).collect());
    let v = json!({
        "model": loaded.name,
        "model_path": loaded.path,
        "device": loaded.device,
        "cpu": cpu_name(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "repetitions": args.repetitions,
        "warmup_runs": 1,
        "prefill_tok_per_s": pp,
        "decode_tok_per_s": tg,
        "runs": runs.iter().map(|r| json!({
            "prefill_tok_per_s": r.prefill_tok_per_s,
            "decode_tok_per_s": r.decode_tok_per_s,
        })).collect::<Vec<_>>(),
        "command": std::env::args().collect::<Vec<_>>().join(" "),
    });
    println!("{v}");
    eprintln!(
        "| model | device | pp{} tok/s | tg{} tok/s |",
        args.prompt_tokens, args.gen_tokens
    );
    eprintln!("|---|---|---|---|");
    eprintln!(
        "| {} | {} | {:.1} | {:.1} |",
        loaded.name, loaded.device, pp, tg
    );
    Ok(())
}
