//! `dflash bench`: what verifying a block costs against a decode step, on the target alone.
//!
//! On a row holding the benchmark's prompt, alternately: one forward over `block` tokens with
//! every position's logits and the greedy choice of each (as a verify round runs it, drafter
//! aside), then the row cut back; and one single-token decode step with its greedy choice. The
//! choice (`argmax_rows`) brings only token ids to the host, so each timing ends when the
//! device has finished. One warm-up pair, then `reps` timed pairs; medians with the raw runs.
//! The ratio is the median of the pairs' own ratios: a machine whose speed drifts between
//! pairs (a shared CPU) moves both runs of a pair together, not the ratio.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use dflash_models::{LogitRows, RowStep, Target};
use dflash_runtime::Backend;
use serde_json::{json, Value};

use crate::bench::median;
use crate::load::DeviceTarget;

/// Verify of `block` tokens against a decode step after `prompt`, `reps` alternating pairs.
pub fn verify_cost(
    target: DeviceTarget,
    prompt: &[u32],
    block: usize,
    reps: usize,
) -> Result<Value> {
    match target {
        DeviceTarget::Cpu(_, mut t) => measure(t.as_mut(), prompt, block, reps),
        #[cfg(feature = "cuda")]
        DeviceTarget::Cuda(b, mut t) => {
            let mut v = measure(t.as_mut(), prompt, block, reps)?;
            v["kernels"] = launch_split(&b, t.as_mut(), prompt, block)?;
            Ok(v)
        }
    }
}

/// The report's table line.
pub fn verify_line(v: &Value) -> String {
    format!(
        "| verify of {} (forward + greedy choice) {:.3} ms vs decode step {:.3} ms: {:.2}x |",
        v["block"],
        v["verify_ms"].as_f64().unwrap_or(0.0),
        v["decode_step_ms"].as_f64().unwrap_or(0.0),
        v["verify_over_decode"].as_f64().unwrap_or(0.0)
    )
}

/// The report's lines of the verify's and the decode step's kernel time by launch (CUDA only).
pub fn split_lines(v: &Value) -> Vec<String> {
    let Some(split) = v.get("kernels") else {
        return Vec::new();
    };
    ["verify", "decode"]
        .iter()
        .map(|key| {
            let s = &split[key];
            let launches = s["launches"].as_array().cloned().unwrap_or_default();
            format!(
                "| kernel time of one {key} forward {:.1} us | {} |",
                s["kernel_us"].as_f64().unwrap_or(0.0),
                launches
                    .iter()
                    .map(|l| format!(
                        "{} {:.1} us ({})",
                        l["name"].as_str().unwrap_or("?"),
                        l["us"].as_f64().unwrap_or(0.0),
                        l["count"]
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
        .collect()
}

fn measure<T: Target>(t: &mut T, prompt: &[u32], block: usize, reps: usize) -> Result<Value> {
    if block == 0 || prompt.is_empty() || prompt.len() + block > t.context_length() {
        bail!(
            "a verify block of {block} after {} prompt tokens does not fit the context of {}",
            prompt.len(),
            t.context_length()
        );
    }
    let b = Block::start(t, prompt, block)?;
    let (mut verify, mut decode) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let v = b.step(t, block)?;
        let d = b.step(t, 1)?;
        if rep > 0 {
            verify.push(1e3 * v.as_secs_f64());
            decode.push(1e3 * d.as_secs_f64());
        }
    }
    t.release_row(b.row);
    let ratio = pair_ratio(&verify, &decode);
    let (v, d) = (median(verify.clone()), median(decode.clone()));
    Ok(json!({
        "block": block,
        "context": b.start,
        "verify_ms": v,
        "decode_step_ms": d,
        "verify_over_decode": ratio,
        "verify_runs_ms": verify,
        "decode_step_runs_ms": decode,
    }))
}

/// The median over timed pairs of `num[i] / den[i]`.
fn pair_ratio(num: &[f64], den: &[f64]) -> f64 {
    median(num.iter().zip(den).map(|(n, d)| n / d).collect())
}

/// A row holding the prompt, on which blocks of tokens are run and cut back.
struct Block {
    row: usize,
    start: usize,
    tokens: Vec<u32>,
}

impl Block {
    /// A new row of `t` holding `prompt`, with room for `block` more tokens.
    fn start<T: Target>(t: &mut T, prompt: &[u32], block: usize) -> Result<Self> {
        let row = t.new_row(prompt.len() + block)?;
        t.forward(&[RowStep {
            row,
            tokens: prompt,
            logits: LogitRows::Last,
            prompt: true,
            argmax_only: false,
        }])?;
        Ok(Self {
            row,
            start: t.row_len(row),
            tokens: prompt.iter().copied().cycle().take(block).collect(),
        })
    }

    /// One forward over `n` tokens with the greedy choice of every position (of the last
    /// for one token; logits for the choice only, as greedy decoding asks them), then the
    /// row cut back; the wall time until the ids are on the host.
    fn step<T: Target>(&self, t: &mut T, n: usize) -> Result<Duration> {
        let t0 = Instant::now();
        t.forward(&[RowStep {
            row: self.row,
            tokens: &self.tokens[..n],
            logits: if n == 1 {
                LogitRows::Last
            } else {
                LogitRows::All
            },
            prompt: false,
            argmax_only: true,
        }])?;
        t.backend().argmax_rows(t.logits());
        let took = t0.elapsed();
        t.truncate_row(self.row, self.start)?;
        Ok(took)
    }
}

/// Kernel time of the verify block and of the decode step by launch (CUDA events around
/// every launch, graphs off, so each launch pays its own gap): µs and launches per forward,
/// over three forwards of each after one of each unprofiled.
#[cfg(feature = "cuda")]
fn launch_split<T: Target>(
    backend: &dflash_runtime::cuda::CudaBackend,
    t: &mut T,
    prompt: &[u32],
    block: usize,
) -> Result<Value> {
    use dflash_runtime::cuda::ProfileKeys;
    const RUNS: usize = 3;
    let b = Block::start(t, prompt, block)?;
    let mut split = json!({});
    for (key, n) in [("verify", block), ("decode", 1)] {
        b.step(t, n)?;
        backend.profile_by(Some(ProfileKeys::Name));
        for _ in 0..RUNS {
            b.step(t, n)?;
        }
        let prof = backend.take_profile();
        backend.profile_by(None);
        let total: f64 = prof.iter().map(|c| c.ms).sum();
        split[key] = json!({
            "kernel_us": 1000.0 * total / RUNS as f64,
            "launches": prof.iter().map(|c| json!({
                "name": c.class,
                "us": 1000.0 * c.ms / RUNS as f64,
                "count": c.launches / RUNS,
            })).collect::<Vec<_>>(),
        });
    }
    t.release_row(b.row);
    Ok(split)
}
