//! The gated delta rule of one Gated DeltaNet layer over a prefill on the GPU, token by token
//! against the chunked form (the same op, spans marked [`RowSpan::chunked`] or not), on
//! Qwen3.5-0.8B's GDN shape (16 k / 16 v heads of 128) and 4B's (16 k / 32 v heads).
//!
//! ```text
//! cargo build --release -p dflash-runtime --features cuda --example cuda_gdn_prefill
//! cuda_gdn_prefill [--prompts 512,2048] [--rows 1,4] [--reps 5]
//! ```
//!
//! Method: per (shape, prompt length, rows) one warm-up call of each arm, then `reps` rounds
//! with the arms alternating, each call timed alone (synchronised before and after); medians
//! reported with the raw runs, and the largest difference between the arms' outputs (the two
//! forms are equal up to rounding).

use std::time::Instant;

use dflash_runtime::cuda::CudaBackend;
use dflash_runtime::{Backend, GdnShape, RowSpan};
use rand::{Rng, SeedableRng};

struct Args {
    prompts: Vec<usize>,
    rows: Vec<usize>,
    reps: usize,
}

fn list(v: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|x| match x.trim().parse::<usize>() {
            Ok(0) => Err(format!("{x}: must be >= 1")),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("{x}: {e}")),
        })
        .collect()
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        prompts: vec![512, 2048],
        rows: vec![1, 4],
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let val = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--prompts" => a.prompts = list(&val)?,
            "--rows" => a.rows = list(&val)?,
            "--reps" => a.reps = val.parse().map_err(|e| format!("--reps {val}: {e}"))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.prompts.is_empty() || a.rows.is_empty() || a.reps == 0 {
        return Err("--prompts, --rows and --reps need values >= 1".into());
    }
    Ok(a)
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

/// One arm's call: a fresh state for every row, the step over all rows; returns (ms, output).
fn call(
    b: &CudaBackend,
    shape: GdnShape,
    spans: &[RowSpan],
    inputs: &[<CudaBackend as Backend>::Tensor; 3],
) -> (f64, Vec<f32>) {
    let mut st = b.gdn_new(1, shape, 0);
    for s in spans {
        b.gdn_open_row(&mut st, s.row as usize);
    }
    let mut out = b.tensor(0, shape.value_dim());
    b.synchronize();
    let t = Instant::now();
    b.run(|| {
        b.gdn_begin(&mut st, spans);
        b.gated_delta(
            &mut st, 0, &inputs[0], &inputs[1], &inputs[2], spans, &mut out,
        );
    });
    b.synchronize();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    (ms, b.to_host(&out))
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("cuda_gdn_prefill: {e}");
            std::process::exit(2);
        }
    };
    let b = match CudaBackend::new() {
        Ok(b) => b,
        Err(e) => {
            eprintln!("cuda_gdn_prefill: {e}");
            std::process::exit(1);
        }
    };
    let shape = |v_heads| GdnShape {
        k_heads: 16,
        v_heads,
        k_dim: 128,
        v_dim: 128,
        conv_kernel: 4,
        tiled_heads: true,
    };
    println!("device: {}", b.device_name());
    println!("| shape | prompt | rows | token by token ms (runs) | chunked ms (runs) | speed-up | max abs diff |");
    println!("|---|---|---|---|---|---|---|");
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    for (name, shape) in [("0.8b", shape(16)), ("4b", shape(32))] {
        for &prompt in &args.prompts {
            for &rows in &args.rows {
                let t = prompt * rows;
                let mut gen = |n: usize, lo: f32, hi: f32| -> Vec<f32> {
                    (0..n).map(|_| rng.random_range(lo..hi)).collect()
                };
                let (x, g, beta) = (
                    gen(t * shape.conv_dim(), -1.0, 1.0),
                    gen(t * shape.v_heads, -1.5, -0.01),
                    gen(t * shape.v_heads, 0.05, 0.95),
                );
                let inputs = [
                    b.upload(&x, t, shape.conv_dim()),
                    b.upload(&g, t, shape.v_heads),
                    b.upload(&beta, t, shape.v_heads),
                ];
                let spans = |chunked| -> Vec<RowSpan> {
                    (0..rows)
                        .map(|r| RowSpan {
                            row: r as u32,
                            first: (r * prompt) as u32,
                            count: prompt as u32,
                            chunked,
                            prompt: true,
                        })
                        .collect()
                };
                let (steps, chunks) = (spans(false), spans(true));
                let (_, a) = call(&b, shape, &steps, &inputs);
                let (_, c) = call(&b, shape, &chunks, &inputs);
                let diff = a
                    .iter()
                    .zip(&c)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                let (mut ta, mut tc) = (Vec::new(), Vec::new());
                for _ in 0..args.reps {
                    ta.push(call(&b, shape, &steps, &inputs).0);
                    tc.push(call(&b, shape, &chunks, &inputs).0);
                }
                let runs = |v: &[f64]| {
                    v.iter()
                        .map(|x| format!("{x:.3}"))
                        .collect::<Vec<_>>()
                        .join(" / ")
                };
                let (ma, mc) = (median(ta.clone()), median(tc.clone()));
                println!(
                    "| {name} | {prompt} | {rows} | {ma:.3} ({}) | {mc:.3} ({}) | {:.2}x | {diff:.2e} |",
                    runs(&ta),
                    runs(&tc),
                    ma / mc
                );
            }
        }
    }
}
