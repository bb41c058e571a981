//! Benchmark of a Qwen 3.5-shaped hybrid target with random weights (no download needed):
//! prefill and decode tok/s; the cost of verifying a block (one forward over `--block` tokens
//! plus the per-row rollback to an accepted prefix) against one decode step; and batched
//! DFlash rounds, B = 1 against B = N per-row accepts against B = N clamp, with a drafter that
//! proposes the target's own greedy continuation and errs at random slots so that each row
//! commits `--tau` tokens per round on average (the seed's walk: 2.9). Each batched arm is
//! reported end to end and for its generation phase alone (the wall time less that of the same
//! requests cut to their first token, i.e. the prompts' prefill).
//!
//! ```text
//! cargo run --release -p dflash-cli --example qwen35_bench -- --shape 0.8b --dtype q4_0
//! cargo run --release -p dflash-cli --features cuda --example qwen35_bench -- \
//!     --shape 4b --dtype bf16 --device cuda --gen 128
//! ```
//!
//! Prints one JSON object (stdout) and a markdown table (stderr). Method: one warm-up run per
//! measurement, then `--reps` runs with the arms alternating; medians reported with the raw
//! runs. The GGUF is written once to `--gguf` (default: a file in the system temp folder named
//! after the shape and format) and reused when it exists.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Request, SamplingParams};
use dflash_models::synthetic::{synthetic_qwen35_gguf, Qwen35Spec};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{load_model, Drafter, LogitRows, RowStep, Target, TargetModel};
use dflash_runtime::{Backend, DType};
use rand::{Rng, SeedableRng};
use serde_json::json;

#[derive(Parser, Debug)]
struct Args {
    /// Shape: 0.8b, 4b or tiny.
    #[arg(long, default_value = "0.8b")]
    shape: String,
    /// Matrix format: q4_0, q8_0, bf16 or f32.
    #[arg(long, default_value = "q4_0")]
    dtype: String,
    /// Where the synthetic GGUF is kept (written when missing).
    #[arg(long)]
    gguf: Option<PathBuf>,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Prompt tokens (prefill measurement and the batched prompts).
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens generated per row.
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Verify block (DFlash block size).
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// Rows of the batched comparison.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Mean tokens committed per row and round by the walk drafter.
    #[arg(long, default_value_t = 2.9)]
    tau: f64,
    /// Timed runs per arm after the warm-up.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the batched DFlash comparison.
    #[arg(long)]
    no_batch: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One timed run of a batched arm.
#[derive(Clone, Copy)]
struct ArmRun {
    /// Generated tokens over the whole run's wall time (prefill included).
    tok_per_s: f64,
    /// Tokens after each row's first over the wall time less the prefill run's.
    gen_tok_per_s: f64,
    /// Wall time of the same requests cut to their first token.
    prefill_s: f64,
    /// Tokens committed per row-round.
    tau: f64,
}

/// Accept probability p per slot such that 1 + Σ_{k=1..n} p^k = tau (accepts stop at the
/// first error).
fn accept_probability(tau: f64, n: usize) -> f64 {
    let walk = |p: f64| 1.0 + (1..=n).map(|k| p.powi(k as i32)).sum::<f64>();
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if walk(mid) < tau {
            lo = mid
        } else {
            hi = mid
        }
    }
    lo
}

/// A drafter that proposes each row's known greedy continuation and errs at random slots
/// (independently with probability 1 - p, the first error ending the accepted run). The draw
/// depends on the request and its position only, so B = 1 and per-row batches see the same
/// accepts.
struct WalkDrafter<B: Backend> {
    backend: Arc<B>,
    block: usize,
    vocab: usize,
    taps: Vec<usize>,
    p: f64,
    /// Continuations of the requests, in the order rows are opened.
    queue: std::collections::VecDeque<(usize, Vec<u32>)>,
    rows: Vec<Option<(usize, Vec<u32>, usize)>>,
    host: Vec<f32>,
    logits: B::Tensor,
}

impl<B: Backend> WalkDrafter<B> {
    fn draw(&self, req: usize, pos: usize, slot: usize) -> f64 {
        let mut r = rand::rngs::StdRng::seed_from_u64(
            ((req as u64) << 40) ^ ((pos as u64) << 8) ^ slot as u64,
        );
        r.random::<f64>()
    }
}

impl<B: Backend> Drafter for WalkDrafter<B> {
    type B = B;
    fn block_size(&self) -> usize {
        self.block
    }
    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }
    fn new_row(&mut self, _capacity: usize) -> dflash_models::Result<usize> {
        let (req, seq) = self
            .queue
            .pop_front()
            .expect("a continuation for every row");
        let slot = self
            .rows
            .iter()
            .position(Option::is_none)
            .unwrap_or_else(|| {
                self.rows.push(None);
                self.rows.len() - 1
            });
        self.rows[slot] = Some((req, seq, 0));
        Ok(slot)
    }
    fn release_row(&mut self, row: usize) {
        self.rows[row] = None;
    }
    /// The walk keeps no KV cache.
    fn kv_usage(&self) -> dflash_models::KvUsage {
        dflash_models::KvUsage::default()
    }
    fn context_len(&self, row: usize) -> usize {
        self.rows[row].as_ref().map_or(0, |r| r.2)
    }
    fn extend(
        &mut self,
        rows: &[(usize, usize)],
        _taps: &B::Tensor,
        _tap_rows: &[u32],
    ) -> dflash_models::Result<()> {
        for &(r, n) in rows {
            if let Some(row) = self.rows[r].as_mut() {
                row.2 += n;
            }
        }
        Ok(())
    }
    fn draft(
        &mut self,
        rows: &[(usize, u32)],
        block: usize,
        _e: &B::Weight,
        _h: &B::Weight,
    ) -> dflash_models::Result<()> {
        let v = self.vocab;
        self.host.clear();
        self.host.resize(rows.len() * (block - 1) * v, 0.0);
        for (i, &(r, _)) in rows.iter().enumerate() {
            let (req, seq, ctx) = self.rows[r].as_ref().expect("open row");
            let mut wrong = false;
            for j in 1..block {
                let pos = ctx + j;
                let truth = seq.get(pos).copied().unwrap_or(0);
                wrong |= self.draw(*req, pos, j) >= self.p;
                let tok = if wrong { (truth + 1) % v as u32 } else { truth };
                self.host[(i * (block - 1) + j - 1) * v + tok as usize] = 30.0;
            }
        }
        self.logits = self.backend.upload(&self.host, rows.len() * (block - 1), v);
        Ok(())
    }
    fn logits(&self) -> &B::Tensor {
        &self.logits
    }
}

fn spec(args: &Args) -> Result<Qwen35Spec> {
    let dtype = match args.dtype.as_str() {
        "q4_0" => DType::Q4_0,
        "q8_0" => DType::Q8_0,
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        d => bail!("--dtype {d}: expected q4_0, q8_0, bf16 or f32"),
    };
    Ok(match args.shape.as_str() {
        "0.8b" => Qwen35Spec::qwen35_0_8b(dtype),
        "4b" => Qwen35Spec::qwen35_4b(dtype),
        "tiny" => Qwen35Spec {
            dtype,
            ..Qwen35Spec::tiny()
        },
        s => bail!("--shape {s}: expected 0.8b, 4b or tiny"),
    })
}

fn forward<T: Target>(t: &mut T, row: usize, tokens: &[u32], which: LogitRows) -> Result<()> {
    t.forward(&[RowStep {
        row,
        tokens,
        logits: which,
        // Here every multi-token step asking for the last logits is a prompt.
        prompt: which == LogitRows::Last && tokens.len() > 1,
        argmax_only: false,
    }])?;
    Ok(())
}

/// Greedy continuation of `prompt` by `gen` tokens (no stop tokens), one step at a time.
fn greedy<T: Target>(t: &mut T, prompt: &[u32], gen: usize) -> Result<Vec<u32>> {
    let row = t.new_row(prompt.len() + gen + 1)?;
    forward(t, row, prompt, LogitRows::Last)?;
    let mut out = Vec::with_capacity(gen);
    let mut host = Vec::new();
    for _ in 0..gen {
        t.backend().copy_to_host(t.logits(), &mut host);
        let next = dflash_runtime::cpu::ops::elementwise::argmax(&host);
        out.push(next);
        forward(t, row, &[next], LogitRows::Last)?;
    }
    t.release_row(row);
    Ok(out)
}

fn bench<B: Backend>(backend: Arc<B>, device: String, args: &Args, path: &PathBuf) -> Result<()> {
    let t0 = Instant::now();
    let loaded =
        load_model(backend.clone(), path).with_context(|| format!("loading {}", path.display()))?;
    let tok: TextTokenizer = loaded.tokenizer;
    let mut target: TargetModel<B> = loaded.model;
    let load_s = t0.elapsed().as_secs_f64();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let prompt_of = |rng: &mut rand::rngs::StdRng| -> Vec<u32> {
        (0..args.prompt)
            .map(|_| rng.random_range(0..250u32))
            .collect()
    };
    let prompt = prompt_of(&mut rng);
    let cap = args.prompt + args.gen + 2 * args.block + 2;

    // Prefill and decode.
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for rep in 0..=args.reps {
        let row = target.new_row(cap)?;
        let t = Instant::now();
        forward(&mut target, row, &prompt, LogitRows::Last)?;
        target.backend().to_host(target.logits());
        let p = args.prompt as f64 / t.elapsed().as_secs_f64();
        let t = Instant::now();
        for i in 0..args.gen {
            forward(&mut target, row, &[(i % 250) as u32], LogitRows::Last)?;
            target.backend().to_host(target.logits());
        }
        let g = args.gen as f64 / t.elapsed().as_secs_f64();
        target.release_row(row);
        if rep > 0 {
            pp.push(p);
            tg.push(g);
        }
    }

    // A verify block + rollback against a decode step, alternating, on rows after the prompt.
    let keep = args.tau.round().max(1.0) as usize;
    let (mut verify_ms, mut rollback_ms, mut decode_ms) = (Vec::new(), Vec::new(), Vec::new());
    let row = target.new_row(cap + 4 * args.reps * args.block)?;
    forward(&mut target, row, &prompt, LogitRows::Last)?;
    let block: Vec<u32> = (0..args.block as u32).map(|i| (i * 7) % 250).collect();
    for rep in 0..=args.reps * 3 {
        let len = target.row_len(row);
        let t = Instant::now();
        forward(&mut target, row, &block, LogitRows::All)?;
        target.backend().to_host(target.logits());
        let tv = t.elapsed().as_secs_f64();
        let t = Instant::now();
        target.truncate_row(row, len + keep)?;
        target.backend().to_host(target.logits());
        let tr = t.elapsed().as_secs_f64();
        let t = Instant::now();
        forward(&mut target, row, &[3], LogitRows::Last)?;
        target.backend().to_host(target.logits());
        let td = t.elapsed().as_secs_f64();
        if rep > 0 {
            verify_ms.push(1e3 * (tv + tr));
            rollback_ms.push(1e3 * tr);
            decode_ms.push(1e3 * td);
        }
    }
    target.release_row(row);
    // The median of the pairs' own ratios (a drifting machine moves both runs of a pair).
    let ratio = median(
        verify_ms
            .iter()
            .zip(&decode_ms)
            .map(|(v, d)| v / d)
            .collect(),
    );

    let mut report = json!({
        "shape": args.shape, "dtype": args.dtype, "device": device, "gguf": path,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "load_s": load_s, "prompt_tokens": args.prompt, "gen_tokens": args.gen, "reps": args.reps,
        "warmup_runs": 1,
        "prefill_tok_per_s": median(pp.clone()), "prefill_runs": pp,
        "decode_tok_per_s": median(tg.clone()), "decode_runs": tg,
        "verify_block": args.block, "verify_keep": keep,
        "verify_plus_rollback_ms": median(verify_ms.clone()), "verify_plus_rollback_runs_ms": verify_ms,
        "rollback_ms": median(rollback_ms.clone()),
        "decode_step_ms": median(decode_ms.clone()), "decode_step_runs_ms": decode_ms,
    });
    report["verify_over_decode"] = json!(ratio);
    let mut table = vec![format!(
        "| {} {} {} | pp{} {:.1} tok/s | tg{} {:.2} tok/s | verify {} + rollback {:.1} ms (rollback {:.2} ms) vs decode step {:.1} ms: {:.2}x |",
        args.shape, args.dtype, device, args.prompt, report["prefill_tok_per_s"].as_f64().unwrap_or(0.0),
        args.gen, report["decode_tok_per_s"].as_f64().unwrap_or(0.0), args.block,
        report["verify_plus_rollback_ms"].as_f64().unwrap_or(0.0), report["rollback_ms"].as_f64().unwrap_or(0.0),
        report["decode_step_ms"].as_f64().unwrap_or(0.0), report["verify_over_decode"].as_f64().unwrap_or(0.0)
    )];

    if !args.no_batch {
        let prompts: Vec<Vec<u32>> = (0..args.batch).map(|_| prompt_of(&mut rng)).collect();
        let mut refs = Vec::new();
        for p in &prompts {
            let mut seq = p.clone();
            seq.extend(greedy(&mut target, p, args.gen + args.block)?);
            refs.push(seq);
        }
        let p = accept_probability(args.tau, args.block - 1);
        let requests: Vec<Request> = prompts
            .iter()
            .map(|p| Request {
                prompt: p.clone(),
                max_tokens: args.gen,
                params: SamplingParams::greedy(),
                stop_strings: Vec::new(),
            })
            .collect();
        let vocab = target.vocab();
        let drafter = WalkDrafter {
            backend: backend.clone(),
            block: args.block,
            vocab,
            taps: vec![1, target.n_layers() / 2, target.n_layers() - 2],
            p,
            queue: Default::default(),
            rows: Vec::new(),
            host: Vec::new(),
            logits: backend.tensor(0, vocab),
        };
        let mut dec = DflashDecoder::new(target, drafter, args.block, AcceptPolicy::PerRow)?;
        let arms: [(&str, usize, AcceptPolicy); 3] = [
            ("b1", 1, AcceptPolicy::PerRow),
            ("per_row", args.batch, AcceptPolicy::PerRow),
            ("clamp", args.batch, AcceptPolicy::Clamp),
        ];
        // Each arm runs twice per repetition: the requests as given, and the same requests cut
        // to their first token (the prompts' prefill, batched the same way). The difference of
        // the two walls is the generation phase, which the accept policy decides.
        let first_only: Vec<Request> = requests
            .iter()
            .map(|r| Request {
                max_tokens: 1,
                ..r.clone()
            })
            .collect();
        let mut runs: Vec<Vec<ArmRun>> = vec![Vec::new(); 3];
        for rep in 0..=args.reps {
            for (k, &(_, live, policy)) in arms.iter().enumerate() {
                let mut walls = [0.0f64; 2];
                let mut done = Vec::new();
                for (w, reqs) in [&requests, &first_only].into_iter().enumerate() {
                    let DflashDecoder {
                        target, drafter, ..
                    } = dec;
                    dec = DflashDecoder::new(target, drafter, args.block, policy)?;
                    dec.drafter.queue = refs.iter().cloned().enumerate().collect();
                    let t = Instant::now();
                    let out = run_scheduled(&mut dec, &tok, reqs, live, &mut |_, _| {})?;
                    walls[w] = t.elapsed().as_secs_f64();
                    if w == 0 {
                        done = out;
                    }
                }
                let tokens: usize = done.iter().map(|c| c.tokens.len()).sum();
                let rounds: usize = done.iter().map(|c| c.stats.rounds).sum();
                let accepted: usize = done.iter().map(|c| c.stats.accepted).sum();
                if rep > 0 {
                    runs[k].push(ArmRun {
                        tok_per_s: tokens as f64 / walls[0],
                        gen_tok_per_s: (tokens - done.len()) as f64 / (walls[0] - walls[1]),
                        prefill_s: walls[1],
                        tau: (accepted + rounds) as f64 / rounds.max(1) as f64,
                    });
                }
            }
        }
        let of = |f: fn(&ArmRun) -> f64| -> Vec<f64> {
            runs.iter()
                .map(|r| median(r.iter().map(f).collect()))
                .collect()
        };
        let (tps, gen) = (of(|r| r.tok_per_s), of(|r| r.gen_tok_per_s));
        report["batch"] = json!(args.batch);
        report["walk_tau"] = json!(args.tau);
        report["walk_accept_probability"] = json!(p);
        report["arms"] = json!(arms
            .iter()
            .zip(&runs)
            .map(|((name, live, _), r)| json!({
                "arm": name, "rows_at_once": live,
                "tok_per_s": median(r.iter().map(|x| x.tok_per_s).collect()),
                "runs_tok_per_s": r.iter().map(|x| x.tok_per_s).collect::<Vec<_>>(),
                "gen_tok_per_s": median(r.iter().map(|x| x.gen_tok_per_s).collect()),
                "runs_gen_tok_per_s": r.iter().map(|x| x.gen_tok_per_s).collect::<Vec<_>>(),
                "runs_prefill_s": r.iter().map(|x| x.prefill_s).collect::<Vec<_>>(),
                "tau": r.last().map_or(0.0, |x| x.tau),
            }))
            .collect::<Vec<_>>());
        report["per_row_vs_clamp"] = json!(tps[1] / tps[2]);
        report["per_row_vs_b1"] = json!(tps[1] / tps[0]);
        report["gen_per_row_vs_clamp"] = json!(gen[1] / gen[2]);
        report["gen_per_row_vs_b1"] = json!(gen[1] / gen[0]);
        table.push(format!(
            "| end to end | B=1 {:.2} tok/s | B={} per-row {:.2} tok/s | clamp {:.2} tok/s | per-row/clamp {:.2}x | per-row/B=1 {:.2}x |",
            tps[0], args.batch, tps[1], tps[2], tps[1] / tps[2], tps[1] / tps[0]
        ));
        table.push(format!(
            "| generation | B=1 {:.2} tok/s | B={} per-row {:.2} tok/s | clamp {:.2} tok/s | per-row/clamp {:.2}x | per-row/B=1 {:.2}x |",
            gen[0], args.batch, gen[1], gen[2], gen[1] / gen[2], gen[1] / gen[0]
        ));
    }
    println!("{report}");
    for l in table {
        eprintln!("{l}");
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let spec = spec(&args)?;
    if args.block < 2 || args.batch == 0 || args.reps == 0 || args.gen == 0 || args.prompt == 0 {
        bail!("--block must be >= 2 and --batch, --reps, --gen, --prompt >= 1");
    }
    let path = args.gguf.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("dflash-qwen35-{}-{}.gguf", args.shape, args.dtype))
    });
    if !path.exists() {
        let t = Instant::now();
        std::fs::write(&path, synthetic_qwen35_gguf(&spec))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "wrote {} in {:.1} s",
            path.display(),
            t.elapsed().as_secs_f64()
        );
    }
    match args.device.as_str() {
        "cpu" => {
            let b = Arc::new(dflash_runtime::cpu::CpuBackend::new(args.threads));
            let device = format!("cpu {} x{}", b.isa(), b.threads());
            bench(b, device, &args, &path)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let b = Arc::new(dflash_runtime::cuda::CudaBackend::new()?);
            let device = format!("cuda {}", b.device_name());
            bench(b, device, &args, &path)
        }
        d => bail!(
            "--device {d}: expected cpu{}",
            if cfg!(feature = "cuda") {
                " or cuda"
            } else {
                " (build with --features cuda for cuda)"
            }
        ),
    }
}
