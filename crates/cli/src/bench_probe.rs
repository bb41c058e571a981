//! `dflash bench --requests R --join-probe P`: the time to first token of a P-token prompt
//! that joins a busy batch. `--max-live` background rows decode (one that finishes is
//! replaced at once, so the batch stays full); once every background row has its first token
//! and the batch has run a few more steps, a P-token prompt arrives and the time from its
//! arrival to its first token is taken, with the steps it took. This repeats [`PROBES`] times,
//! [`SETTLE_STEPS`] steps apart. The prompt is fed in pieces inside the live rows' steps
//! (chunked prefill under `--max-batch-tokens`), as `dflash serve` would feed it.

use std::time::Instant;

use anyhow::{bail, Result};
use dflash_engine::{Batch, Decoder, Event, Request};
use dflash_models::tokenizer::TextTokenizer;
use serde_json::{json, Value};

use crate::bench::median;

/// Joining prompts measured per run.
pub const PROBES: usize = 5;
/// Steps the full batch runs before the first probe and between probes.
const SETTLE_STEPS: usize = 4;

/// A request's place in the probe run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Key {
    /// Background row: index into the background requests (cycled).
    Background(usize),
    Probe,
}

/// What the probes of one run saw.
#[derive(Clone, Debug, Default)]
pub struct ProbeRun {
    ttft_s: Vec<f64>,
    steps: Vec<usize>,
    /// Fewest background rows live when a probe arrived.
    min_live: usize,
}

/// The P-token prompt of the probes: the background prompts' ids back to back, cut to `len`.
pub fn probe_request(background: &[Request], len: usize) -> Result<Request> {
    let ids: Vec<u32> = background
        .iter()
        .flat_map(|r| r.prompt.iter().copied())
        .cycle()
        .take(len)
        .collect();
    if ids.len() < len {
        bail!("--join-probe: the prompts hold no tokens to build a {len}-token prompt from");
    }
    Ok(Request {
        prompt: ids,
        max_tokens: 1,
        params: background[0].params.clone(),
        stop_strings: Vec::new(),
    })
}

/// Runs `live` background rows (requests cycled, each replaced when it finishes; give them
/// long token limits so the batch stays busy) and [`PROBES`] joining prompts; frees every row
/// at the end.
pub fn probe_run(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    background: &[Request],
    probe: &Request,
    live: usize,
) -> Result<ProbeRun> {
    let mut batch: Batch<Key> = Batch::new();
    let result = probe_loop(&mut batch, decoder, tok, background, probe, live);
    batch.abort(decoder);
    result
}

fn probe_loop(
    batch: &mut Batch<Key>,
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    background: &[Request],
    probe: &Request,
    live: usize,
) -> Result<ProbeRun> {
    let mut events = Vec::new();
    let mut next = 0usize;
    // Whether each background slot has had its first token (the batch is full and busy once
    // all have; slots refilled later are not waited for).
    let mut started = vec![false; live];
    let mut run = ProbeRun {
        min_live: usize::MAX,
        ..ProbeRun::default()
    };
    for slot in 0..live {
        batch.enqueue(
            decoder,
            Key::Background(slot),
            &background[next % background.len()],
        )?;
        next += 1;
    }
    // Steps until every background row has its first token, then a few more.
    let mut settle = SETTLE_STEPS;
    let mut waiting: Option<(Instant, usize)> = None;
    loop {
        batch.step(decoder, tok, &mut events)?;
        if let Some((_, steps)) = waiting.as_mut() {
            *steps += 1;
        }
        for e in events.drain(..) {
            match e {
                Event::Progress {
                    key: Key::Probe,
                    ids,
                    ..
                } if !ids.is_empty() => {
                    if let Some((t0, steps)) = waiting.take() {
                        run.ttft_s.push(t0.elapsed().as_secs_f64());
                        run.steps.push(steps);
                    }
                }
                Event::Progress {
                    key: Key::Background(slot),
                    ids,
                    ..
                } if !ids.is_empty() => started[slot] = true,
                Event::Done {
                    key: Key::Background(slot),
                    ..
                } => {
                    // Keep the batch full: the slot's next request joins at once.
                    batch.enqueue(
                        decoder,
                        Key::Background(slot),
                        &background[next % background.len()],
                    )?;
                    next += 1;
                }
                _ => {}
            }
        }
        if waiting.is_some() {
            continue;
        }
        if run.ttft_s.len() == PROBES {
            return Ok(run);
        }
        if started.iter().all(|&s| s) {
            if settle > 0 {
                settle -= 1;
                continue;
            }
            run.min_live = run.min_live.min(batch.len());
            batch.enqueue(decoder, Key::Probe, probe)?;
            waiting = Some((Instant::now(), 0));
            settle = SETTLE_STEPS;
        }
    }
}

/// The report of one arm's probes over its timed runs.
pub fn probe_report(name: &str, prompt_tokens: usize, runs: &[ProbeRun]) -> Value {
    let ttft: Vec<f64> = runs.iter().flat_map(|r| r.ttft_s.iter().copied()).collect();
    let steps: Vec<f64> = runs
        .iter()
        .flat_map(|r| r.steps.iter().map(|&s| s as f64))
        .collect();
    json!({
        "arm": name,
        "prompt_tokens": prompt_tokens,
        "probes": ttft.len(),
        "ttft_ms_median": 1e3 * median(ttft.clone()),
        "ttft_ms_max": 1e3 * ttft.iter().copied().fold(0.0, f64::max),
        "steps_median": median(steps),
        "background_live_min": runs.iter().map(|r| r.min_live).min().unwrap_or(0),
    })
}

/// A table line for stderr.
pub fn probe_line(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    format!(
        "| {} | {}-token prompt joining {} live rows | TTFT median {:.1} ms, max {:.1} ms over {} probes | {:.0} steps |",
        r["arm"].as_str().unwrap_or("?"),
        r["prompt_tokens"],
        r["background_live_min"],
        f(&r["ttft_ms_median"]),
        f(&r["ttft_ms_max"]),
        r["probes"],
        f(&r["steps_median"]),
    )
}
