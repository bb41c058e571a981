//! `dflash bench --requests R`: a serving-style load on the engine alone. All R requests are
//! queued at once; at most `--max-live` rows decode together and waiting requests join as
//! rows finish, their prompts fed in pieces inside the live rows' steps (continuous batching
//! with chunked prefill, `--max-batch-tokens` per step, as `dflash serve` schedules them).
//! The run is the session scheduler's (`run_observed`), watched for token times and KV memory. Plain decoding and
//! DFlash (per-row accepts) alternate, one warm-up run each, then `--repetitions` timed runs.
//!
//! Per arm: generated tokens per second over the run's wall time (median over runs), requests
//! per second, and percentiles over every request of the timed runs of the time to first token
//! (from the start of the run, so queueing is included, as a client measures it) and of the
//! inter-token latency (a request's time from its first to its last token divided by the
//! tokens after the first; a DFlash round delivers several tokens at once, this spreads its
//! time over them), and the KV cache memory at the step that held the most.

use std::time::Instant;

use anyhow::Result;
use dflash_engine::session::{run_observed, Observer};
use dflash_engine::{Decoder, Event, Request, RowStats};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::KvUsage;
use serde_json::{json, Value};

use crate::bench::median;

/// What one request saw during a run (seconds from the start of the run).
#[derive(Clone, Copy, Debug, Default)]
struct Timing {
    first: Option<f64>,
    last: f64,
    tokens: usize,
}

/// One timed run of the whole request set.
#[derive(Clone, Debug, Default)]
pub struct LoadRun {
    pub wall_s: f64,
    pub tokens: usize,
    ttft_s: Vec<f64>,
    itl_s: Vec<f64>,
    pub stats: RowStats,
    /// The KV cache memory after the step that held the most bytes.
    pub kv_peak: KvUsage,
}

/// Records each request's token times and the KV peak as the run goes.
struct Recorder {
    t0: Instant,
    timing: Vec<Timing>,
    kv_peak: KvUsage,
}

impl Observer for Recorder {
    fn event(&mut self, e: &Event<usize>) {
        if let Event::Progress { key, ids, .. } = e {
            if !ids.is_empty() {
                let t = self.t0.elapsed().as_secs_f64();
                let tm = &mut self.timing[*key];
                tm.first.get_or_insert(t);
                tm.last = t;
                tm.tokens += ids.len();
            }
        }
    }

    fn stepped(&mut self, decoder: &dyn Decoder) {
        let kv = decoder.kv_usage();
        if kv.bytes > self.kv_peak.bytes {
            self.kv_peak = kv;
        }
    }
}

/// Runs every request, at most `max_live` at a time (the session scheduler, chunked
/// prefill within the decoder's token budget), recording each one's token times.
pub fn load_run(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    max_live: usize,
) -> Result<LoadRun> {
    let mut rec = Recorder {
        t0: Instant::now(),
        timing: vec![Timing::default(); requests.len()],
        kv_peak: KvUsage::default(),
    };
    let done = run_observed(decoder, tok, requests, max_live, &mut rec)?;
    let mut run = LoadRun {
        wall_s: rec.t0.elapsed().as_secs_f64(),
        kv_peak: rec.kv_peak,
        ..LoadRun::default()
    };
    for c in &done {
        run.stats.merge(&c.stats);
    }
    for tm in &rec.timing {
        run.tokens += tm.tokens;
        if let Some(first) = tm.first {
            run.ttft_s.push(first);
            if tm.tokens > 1 {
                run.itl_s.push((tm.last - first) / (tm.tokens - 1) as f64);
            }
        }
    }
    Ok(run)
}

/// The `q`-quantile (0..=1) of `v` by the nearest-rank rule (0 when empty).
fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// p50 / p90 / p99 in milliseconds.
fn percentiles_ms(v: &[f64]) -> Value {
    json!({
        "p50": 1e3 * percentile(v, 0.50),
        "p90": 1e3 * percentile(v, 0.90),
        "p99": 1e3 * percentile(v, 0.99),
    })
}

/// The report of one arm over its timed runs.
pub fn arm_report(name: &str, runs: &[LoadRun]) -> Value {
    let tps: Vec<f64> = runs
        .iter()
        .map(|r| r.tokens as f64 / r.wall_s.max(1e-9))
        .collect();
    let ttft: Vec<f64> = runs.iter().flat_map(|r| r.ttft_s.iter().copied()).collect();
    let itl: Vec<f64> = runs.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
    let requests = runs.first().map_or(0, |r| r.ttft_s.len());
    let wall = median(runs.iter().map(|r| r.wall_s).collect());
    let mut stats = RowStats::default();
    for r in runs {
        stats.merge(&r.stats);
    }
    json!({
        "arm": name,
        "tok_per_s": median(tps.clone()),
        "runs_tok_per_s": tps,
        "requests_per_s": if wall > 0.0 { requests as f64 / wall } else { 0.0 },
        "generated_tokens": runs.first().map_or(0, |r| r.tokens),
        "ttft_ms": percentiles_ms(&ttft),
        "itl_ms": percentiles_ms(&itl),
        "tau": stats.tau(),
        "rounds": stats.rounds,
        "plain_steps": stats.plain_steps,
        "kv_peak": runs.iter().map(|r| r.kv_peak).max_by_key(|k| k.bytes).unwrap_or_default(),
    })
}

/// A table line for stderr.
pub fn arm_line(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    format!(
        "| {} | {:.1} tok/s | {:.2} req/s | TTFT p50/p90/p99 {:.0}/{:.0}/{:.0} ms | ITL p50/p90/p99 {:.1}/{:.1}/{:.1} ms | tau {:.2}, {} rounds, {} plain steps | KV peak {:.1} MiB, {} rows, {} positions |",
        r["arm"].as_str().unwrap_or("?"),
        f(&r["tok_per_s"]),
        f(&r["requests_per_s"]),
        f(&r["ttft_ms"]["p50"]),
        f(&r["ttft_ms"]["p90"]),
        f(&r["ttft_ms"]["p99"]),
        f(&r["itl_ms"]["p50"]),
        f(&r["itl_ms"]["p90"]),
        f(&r["itl_ms"]["p99"]),
        f(&r["tau"]),
        r["rounds"],
        r["plain_steps"],
        f(&r["kv_peak"]["bytes"]) / (1 << 20) as f64,
        r["kv_peak"]["rows"],
        r["kv_peak"]["positions"],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.9), 90.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
