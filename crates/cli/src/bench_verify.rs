//! `dflash bench`: what verifying a block costs against a decode step, on the target alone.
//!
//! On a row holding the benchmark's prompt, alternately: one forward over `block` tokens with
//! every position's logits and the greedy choice of each (as a verify round runs it, drafter
//! aside), then the row cut back; and one single-token decode step with its greedy choice. The
//! choice (`argmax_rows`) brings only token ids to the host, so each timing ends when the
//! device has finished. One warm-up pair, then `reps` timed pairs; medians with the raw runs.

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
        DeviceTarget::Cuda(_, mut t) => measure(t.as_mut(), prompt, block, reps),
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

fn measure<T: Target>(t: &mut T, prompt: &[u32], block: usize, reps: usize) -> Result<Value> {
    if block == 0 || prompt.is_empty() || prompt.len() + block > t.context_length() {
        bail!(
            "a verify block of {block} after {} prompt tokens does not fit the context of {}",
            prompt.len(),
            t.context_length()
        );
    }
    let row = t.new_row(prompt.len() + block)?;
    t.forward(&[RowStep {
        row,
        tokens: prompt,
        logits: LogitRows::Last,
        prompt: true,
    }])?;
    let start = t.row_len(row);
    let tokens: Vec<u32> = prompt.iter().copied().cycle().take(block).collect();
    let step = |t: &mut T, n: usize, logits: LogitRows| -> Result<Duration> {
        let t0 = Instant::now();
        t.forward(&[RowStep {
            row,
            tokens: &tokens[..n],
            logits,
            prompt: false,
        }])?;
        t.backend().argmax_rows(t.logits());
        let took = t0.elapsed();
        t.truncate_row(row, start)?;
        Ok(took)
    };
    let (mut verify, mut decode) = (Vec::new(), Vec::new());
    for rep in 0..=reps {
        let v = step(t, block, LogitRows::All)?;
        let d = step(t, 1, LogitRows::Last)?;
        if rep > 0 {
            verify.push(1e3 * v.as_secs_f64());
            decode.push(1e3 * d.as_secs_f64());
        }
    }
    t.release_row(row);
    let (v, d) = (median(verify.clone()), median(decode.clone()));
    Ok(json!({
        "block": block,
        "context": start,
        "verify_ms": v,
        "decode_step_ms": d,
        "verify_over_decode": v / d,
        "verify_runs_ms": verify,
        "decode_step_runs_ms": decode,
    }))
}
