//! `dflash microbench`: the CPU matmul kernels alone, per weight format, shape (K x N) and
//! number of activation rows M, int8-activation kernels (one-term `int8` and two-term `int8x2`,
//! which multiplies twice the int8 rows) against the f32 reference path, with the machine's
//! measured peaks (streaming read bandwidth, FMA and int8 dot throughput; GFLOP/s counts the
//! product's own 2·M·K·N for every path). Vocabulary-shaped products (N ≥ 16·K) also time
//! the f32 path's greedy screen (`screen`: the int8 screen, the bound and the f32 recompute of
//! the candidates, `dflash_runtime::cpu::argmax_screen`); on synthetic weights and
//! activations its candidates are fewer than on a model's.
//!
//! Weights are synthetic (fixed seeds) in the default model's shapes unless `--shapes` says
//! otherwise; every int8 call includes quantizing its activations, as in the model. Arms
//! alternate within each repetition; the median of the repetitions is reported.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use dflash_runtime::cpu::argmax_screen::ArgmaxScreen;
use dflash_runtime::cpu::int8::pack::PackedWeight;
use dflash_runtime::cpu::int8::quantize::Terms;
use dflash_runtime::cpu::int8::{self, synthetic, Int8Kernel};
use dflash_runtime::cpu::matmul;
use dflash_runtime::cpu::peaks;
use dflash_runtime::cpu::pool::CpuPool;
use dflash_runtime::cpu::{self, policy, Isa};
use dflash_runtime::{DType, HostWeight};
use serde_json::{json, Value};

use crate::bench::{cpu_name, median};

/// The default model's (SmolLM2-135M) projection shapes, K x N: q/o, k/v, gate/up, down, head.
const MODEL_SHAPES: [(usize, usize); 5] = [
    (576, 576),
    (576, 192),
    (576, 1536),
    (1536, 576),
    (576, 49152),
];

#[derive(Args, Debug)]
pub struct MicrobenchArgs {
    /// Weight formats (q4_0, q4_1, q8_0, q4_k, q6_k; the K-quants have only the f32 path and,
    /// vocabulary-shaped, its greedy screen).
    #[arg(long, value_delimiter = ',', default_value = "q4_1,q8_0,q4_0")]
    pub formats: Vec<String>,
    /// Shapes as KxN (inner x output rows); default: the default model's projections and head.
    #[arg(long, value_delimiter = ',')]
    pub shapes: Vec<String>,
    /// Activation rows per call.
    #[arg(short = 'm', long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub rows: Vec<usize>,
    /// Timed repetitions per variant (the median is reported).
    #[arg(short = 'r', long, default_value_t = 5)]
    pub repetitions: usize,
    /// Least time per repetition, in milliseconds (calls are repeated to reach it).
    #[arg(long, default_value_t = 100)]
    pub min_ms: u64,
    /// Worker threads (0 = one per core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Profile one variant, `FORMAT:KxN:M:PATH` (PATH `int8`, `int8x2`, `screen` or `f32`): it
    /// runs alone for `--seconds` and one line is printed.
    #[arg(long)]
    pub only: Option<String>,
    /// Duration of `--only`, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Leave out the peak measurements.
    #[arg(long)]
    pub no_peaks: bool,
}

fn parse_format(s: &str) -> Result<DType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "q4_0" => DType::Q4_0,
        "q4_1" => DType::Q4_1,
        "q8_0" => DType::Q8_0,
        "q4_k" => DType::Q4K,
        "q6_k" => DType::Q6K,
        other => bail!("unknown format `{other}` (expected q4_0, q4_1, q8_0, q4_k or q6_k)"),
    })
}

fn parse_shape(s: &str) -> Result<(usize, usize)> {
    let (k, n) = s
        .split_once('x')
        .with_context(|| format!("shape `{s}`: expected KxN, e.g. 576x1536"))?;
    let k: usize = k
        .trim()
        .parse()
        .with_context(|| format!("shape `{s}`: bad K"))?;
    let n: usize = n
        .trim()
        .parse()
        .with_context(|| format!("shape `{s}`: bad N"))?;
    if k == 0 || n == 0 || !k.is_multiple_of(32) {
        bail!("shape `{s}`: K and N must be positive and K a multiple of 32");
    }
    Ok((k, n))
}

/// One kernel path over one weight.
enum Arm {
    Int8(Int8Kernel, Terms, PackedWeight),
    /// The f32 path's greedy screen.
    Screen(Isa, HostWeight, ArgmaxScreen),
    F32(Isa, HostWeight),
}

impl Arm {
    fn name(&self) -> String {
        match self {
            Arm::Int8(k, Terms::One, _) => format!("int8 {k}"),
            Arm::Int8(k, Terms::Two, _) => format!("int8x2 {k}"),
            Arm::Screen(_, _, s) => format!("screen {} {}", s.format(), s.kernel()),
            Arm::F32(i, _) => format!("f32 {i}"),
        }
    }

    fn weight_bytes(&self) -> usize {
        match self {
            Arm::Int8(_, _, p) => p.bytes_len(),
            Arm::Screen(_, _, s) => s.bytes_len(),
            Arm::F32(_, w) => w.bytes.len(),
        }
    }

    fn call(&self, pool: &CpuPool, x: &[f32], m: usize, out: &mut [f32]) {
        match self {
            Arm::Int8(k, t, p) => int8::matmul_many(pool, *k, *t, x, m, &mut [(p, out)]),
            Arm::Screen(i, w, s) => {
                s.matmul(pool, *i, w, x, m, out);
            }
            Arm::F32(i, w) => matmul::matmul_many(pool, *i, x, m, &mut [(w, out)]),
        }
    }

    /// Seconds per call over at least `min_s` of calls.
    fn time(&self, pool: &CpuPool, x: &[f32], m: usize, out: &mut [f32], min_s: f64) -> f64 {
        let mut calls = 0usize;
        let t = Instant::now();
        loop {
            pool.install(|| self.call(pool, x, m, out));
            calls += 1;
            let e = t.elapsed().as_secs_f64();
            if e >= min_s {
                return e / calls as f64;
            }
        }
    }
}

fn arms(pool: &CpuPool, dtype: DType, k: usize, n: usize, path: Option<&str>) -> Result<Vec<Arm>> {
    if dtype.row_bytes(k).is_none() {
        bail!("K = {k} is not a whole number of {dtype} blocks");
    }
    let w = synthetic::weight(dtype, n, k, 0.02, (k * 31 + n) as u64);
    let mut v = Vec::new();
    let int8 = Int8Kernel::best();
    for (name, terms) in [("int8", Terms::One), ("int8x2", Terms::Two)] {
        if path.is_some_and(|p| p != name) {
            continue;
        }
        match (int8, PackedWeight::pack(&w)) {
            (Some(kernel), Some(p)) => v.push(Arm::Int8(kernel, terms, p)),
            _ if path.is_some() => {
                bail!("no int8 kernel for {dtype} on this CPU (the f32 path is the fallback)")
            }
            _ => {}
        }
    }
    // On huge pages, as the backend stores the matrices the f32 kernels stream.
    let hw = cpu::on_huge_pages(&w);
    let vocab_shaped = n >= 16 * k;
    if path.is_some_and(|p| p == "screen") || (path.is_none() && vocab_shaped) {
        let screen = int8
            .and_then(|kernel| ArgmaxScreen::new(pool, &w, policy::screen_format(dtype), kernel));
        match screen {
            Some(s) => v.push(Arm::Screen(Isa::detect(), hw.clone(), s)),
            None if path.is_some() => bail!("no int8 kernel on this CPU to screen with"),
            None => {}
        }
    }
    if path.is_none_or(|p| p == "f32") {
        v.push(Arm::F32(Isa::detect(), hw));
    }
    Ok(v)
}

pub fn run(args: MicrobenchArgs) -> Result<()> {
    if args.repetitions == 0 || args.rows.contains(&0) || args.seconds <= 0.0 {
        bail!("--repetitions, every -m and --seconds must be positive");
    }
    let pool = CpuPool::new(args.threads);
    let threads = pool.threads();
    if let Some(only) = &args.only {
        return run_only(&pool, only, args.seconds);
    }
    let formats: Vec<DType> = args
        .formats
        .iter()
        .map(|f| parse_format(f))
        .collect::<Result<_>>()?;
    let shapes: Vec<(usize, usize)> = if args.shapes.is_empty() {
        MODEL_SHAPES.to_vec()
    } else {
        args.shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<Result<_>>()?
    };
    let int8 = Int8Kernel::best();
    let peaks = (!args.no_peaks).then(|| peaks::measure(&pool, Isa::detect(), int8, 512));
    let min_s = args.min_ms as f64 / 1000.0;
    let mut rows_out = Vec::new();
    let mut table = vec![
        "| format | K x N | M | path | µs/call | rows/s | GB/s | GFLOP/s | % read BW | % compute peak | vs f32 | cost vs M=1 |".to_string(),
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|".to_string(),
    ];
    for &dtype in &formats {
        for &(k, n) in &shapes {
            let arms = arms(&pool, dtype, k, n, None)?;
            let m_max = *args.rows.iter().max().unwrap_or(&1);
            let x = synthetic::activations(m_max, k, 99);
            let mut out = vec![0f32; m_max * n];
            let mut per_m: Vec<(usize, Vec<f64>)> = Vec::new();
            for &m in &args.rows {
                // Warm-up, then alternating repetitions.
                for a in &arms {
                    a.time(&pool, &x[..m * k], m, &mut out, min_s / 4.0);
                }
                let mut runs = vec![Vec::new(); arms.len()];
                for _ in 0..args.repetitions {
                    for (a, r) in arms.iter().zip(runs.iter_mut()) {
                        r.push(a.time(&pool, &x[..m * k], m, &mut out, min_s));
                    }
                }
                let med: Vec<f64> = runs.iter().map(|r| median(r.clone())).collect();
                per_m.push((m, med.clone()));
                let f32_s = med[arms.len() - 1];
                for (ai, a) in arms.iter().enumerate() {
                    let s = med[ai];
                    let m1 = per_m.iter().find(|(mm, _)| *mm == 1).map(|(_, v)| v[ai]);
                    let gb = a.weight_bytes() as f64 / s / 1e9;
                    let gflop = 2.0 * (m * k * n) as f64 / s / 1e9;
                    let compute_peak = peaks.map(|p| match a {
                        Arm::Int8(..) | Arm::Screen(..) => p.int8_gop_s.unwrap_or(f64::NAN),
                        Arm::F32(..) => p.fma_gflop_s,
                    });
                    let row = json!({
                        "format": dtype.to_string(),
                        "k": k,
                        "n": n,
                        "m": m,
                        "path": a.name(),
                        "us_per_call": s * 1e6,
                        "runs_us": runs[ai].iter().map(|v| v * 1e6).collect::<Vec<_>>(),
                        "rows_per_s": m as f64 / s,
                        "weight_bytes": a.weight_bytes(),
                        "gb_per_s": gb,
                        "gflop_per_s": gflop,
                        "read_bw_fraction": peaks.map(|p| gb / p.read_gb_s),
                        "compute_peak_fraction": compute_peak.map(|p| gflop / p),
                        "speedup_vs_f32": f32_s / s,
                        "cost_vs_m1": m1.map(|t1| s / t1),
                    });
                    table.push(format!(
                        "| {dtype} | {k}x{n} | {m} | {} | {:.1} | {:.0} | {:.1} | {:.1} | {} | {} | {:.2}x | {} |",
                        a.name(),
                        s * 1e6,
                        m as f64 / s,
                        gb,
                        gflop,
                        pct(peaks.map(|p| gb / p.read_gb_s)),
                        pct(compute_peak.map(|p| gflop / p)),
                        f32_s / s,
                        m1.map_or("-".into(), |t1| format!("{:.2}x", s / t1)),
                    ));
                    rows_out.push(row);
                }
            }
        }
    }
    let report: Value = json!({
        "cpu": cpu_name(),
        "threads": threads,
        "f32_isa": Isa::detect().to_string(),
        "int8_kernel": int8.map(|k| k.to_string()),
        "peaks": peaks.map(|p| json!({
            "read_gb_per_s": p.read_gb_s,
            "fma_gflop_per_s": p.fma_gflop_s,
            "int8_gop_per_s": p.int8_gop_s,
        })),
        "repetitions": args.repetitions,
        "min_ms": args.min_ms,
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "results": rows_out,
    });
    println!("{report}");
    if let Some(p) = peaks {
        eprintln!(
            "peaks ({threads} threads): read {:.1} GB/s, f32 FMA {:.0} GFLOP/s, int8 dot {}",
            p.read_gb_s,
            p.fma_gflop_s,
            p.int8_gop_s
                .map_or("n/a".into(), |g| format!("{g:.0} GOP/s"))
        );
    }
    for line in table {
        eprintln!("{line}");
    }
    Ok(())
}

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |f| format!("{:.0}%", 100.0 * f))
}

/// `--only FORMAT:KxN:M:PATH`: one variant, for a profiler.
fn run_only(pool: &CpuPool, spec: &str, seconds: f64) -> Result<()> {
    let parts: Vec<&str> = spec.split(':').collect();
    let [format, shape, m, path] = parts[..] else {
        bail!("--only `{spec}`: expected FORMAT:KxN:M:PATH, e.g. q4_1:576x1536:8:int8");
    };
    let dtype = parse_format(format)?;
    let (k, n) = parse_shape(shape)?;
    let m: usize = m
        .parse()
        .ok()
        .filter(|&m| m > 0)
        .with_context(|| format!("--only `{spec}`: M must be a positive integer"))?;
    if !["int8", "int8x2", "screen", "f32"].contains(&path) {
        bail!("--only `{spec}`: PATH must be int8, int8x2, screen or f32");
    }
    let arm = arms(pool, dtype, k, n, Some(path))?.remove(0);
    let x = synthetic::activations(m, k, 99);
    let mut out = vec![0f32; m * n];
    let s = arm.time(pool, &x, m, &mut out, seconds);
    println!(
        "{dtype} {k}x{n} M={m} {}: {:.2} µs/call, {:.0} rows/s",
        arm.name(),
        s * 1e6,
        m as f64 / s
    );
    Ok(())
}
