//! Joining rows move however many tokens the live rows run: queued prompts keep a reserve of
//! each step's token budget (a quarter of it, at least one prefill granule).
//!
//! - DFlash: eight live rows verifying blocks of 4 (32 tokens) under a 16-token budget. Two
//!   requests queued then get their first tokens within `ceil(prompt tokens ahead and own /
//!   reserve)` steps (the pieces fill the reserve in arrival order), while all eight rows
//!   are still live; before the reserve they waited until all but three rows had finished.
//!   Every greedy row still writes exactly its B=1 greedy output (an oracle drafter whose
//!   rows accept different counts), and with a random drafter, greedy and seeded sampled rows
//!   in the crowd write exactly what each writes alone.
//! - AR: twenty live rows under a 16-token budget, the same bound.
//! - The Qwen 3.5 hybrid (prefill granule 64): two live rows under a 40-token budget leave
//!   38 tokens, less than one granule, so a 70-token prompt's body could not run while they
//!   lived; the reserve of one granule feeds it in two steps, with the whole prefill's output.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{ar_reference, request, sharp_tiny_path, Oracle};
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Batch, Completion, Decoder, Event, Request, SamplingParams};
use dflash_models::synthetic::{drafter_config_for, random_drafter, special_id};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{load_model, DflashDrafter, Target};
use dflash_runtime::cpu::CpuBackend;

const BLOCK: usize = 4;
/// The step budget while the joiners wait: below the crowd's own tokens.
const BUDGET: usize = 16;
/// What queued prompts keep of [`BUDGET`]: a quarter.
const RESERVE: usize = BUDGET / 4;
/// Tokens of a crowd row: enough to outlive the joiners' prefill many times over.
const CROWD_TOKENS: usize = 64;
const JOIN_TOKENS: usize = 24;

/// What a crowd-and-join run saw.
struct Joined {
    /// Per joiner, the step (counted from 1 after it was queued) that gave its first token.
    first_step: Vec<usize>,
    /// Crowd rows that had ended by the step the last joiner got its first token.
    crowd_done_by_then: usize,
    /// Every request's completion: the crowd's, then the joiners'.
    done: Vec<Completion>,
}

/// Per request: the step that gave its first token, and its completion.
struct Seen {
    first: Vec<Option<usize>>,
    done: Vec<Option<Completion>>,
}

impl Seen {
    fn new(n: usize) -> Self {
        Self {
            first: vec![None; n],
            done: vec![None; n],
        }
    }

    fn note(&mut self, events: &mut Vec<Event<usize>>, step: usize) {
        for e in events.drain(..) {
            match e {
                Event::Progress { key, ids, .. } if !ids.is_empty() => {
                    self.first[key].get_or_insert(step);
                }
                Event::Done { key, completion } => self.done[key] = Some(completion),
                Event::Progress { .. } => {}
            }
        }
    }
}

/// Starts `crowd` with the default budget and steps until every crowd row has its first
/// token; then sets the budget to [`BUDGET`], queues `joiners` and steps until every request
/// has finished.
fn crowd_and_join(
    dec: &mut dyn Decoder,
    tok: &TextTokenizer,
    crowd: &[Request],
    joiners: &[Request],
) -> Joined {
    let n = crowd.len();
    let mut batch = Batch::new();
    let mut events = Vec::new();
    let mut seen = Seen::new(n + joiners.len());
    dec.set_batch_tokens(512);
    for (k, r) in crowd.iter().enumerate() {
        batch.enqueue(dec, k, r).unwrap();
    }
    for _ in 0..n {
        batch.step(dec, tok, &mut events).unwrap();
        seen.note(&mut events, 0);
        if seen.first[..n].iter().all(Option::is_some) {
            break;
        }
    }
    assert!(
        seen.first[..n].iter().all(Option::is_some),
        "the crowd is live"
    );
    dec.set_batch_tokens(BUDGET);
    for (k, r) in joiners.iter().enumerate() {
        batch.enqueue(dec, n + k, r).unwrap();
    }
    let mut crowd_done_by_then = None;
    let mut step = 0;
    while !batch.is_empty() {
        step += 1;
        assert!(step < 10_000, "the run ends");
        batch.step(dec, tok, &mut events).unwrap();
        seen.note(&mut events, step);
        if crowd_done_by_then.is_none() && seen.first[n..].iter().all(Option::is_some) {
            crowd_done_by_then = Some(seen.done[..n].iter().filter(|d| d.is_some()).count());
        }
    }
    Joined {
        first_step: seen.first[n..].iter().map(|s| s.unwrap()).collect(),
        crowd_done_by_then: crowd_done_by_then.unwrap(),
        done: seen.done.into_iter().map(Option::unwrap).collect(),
    }
}

/// Checks that every joiner got its first token by step `ceil(prompt tokens queued up to and
/// including its own / RESERVE)` while the whole crowd was still live.
fn check_bound(j: &Joined, joiners: &[Request], label: &str) {
    let mut ahead = 0;
    for (i, (r, &step)) in joiners.iter().zip(&j.first_step).enumerate() {
        ahead += r.prompt.len();
        let bound = ahead.div_ceil(RESERVE);
        assert!(
            step <= bound,
            "{label}: joiner {i} got its first token at step {step}, bound {bound}"
        );
    }
    assert_eq!(
        j.crowd_done_by_then, 0,
        "{label}: every crowd row was still live when the joiners got their first tokens"
    );
}

/// Crowd prompts (short, distinct) and joiner prompts (longer than the reserve).
fn prompts(crowd: usize) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let c = (0..crowd as u32)
        .map(|i| vec![5 + i, 9 + 3 * i, 17 + i])
        .collect();
    let j = vec![(40..50).collect(), vec![7, 3, 100, 2, 61, 8, 8, 19, 33]];
    (c, j)
}

fn greedy(prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Request> {
    prompts
        .iter()
        .map(|p| request(p.clone(), max_tokens, SamplingParams::greedy()))
        .collect()
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        seed,
        ..SamplingParams::greedy()
    }
}

/// Checks that each of `got` is its greedy reference cut to its request's token limit.
fn check_greedy(got: &[Completion], refs: &[Completion], requests: &[Request], label: &str) {
    for (i, ((g, r), q)) in got.iter().zip(refs).zip(requests).enumerate() {
        let want: Vec<u32> = r.tokens.iter().take(q.max_tokens).copied().collect();
        assert_eq!(
            g.tokens, want,
            "{label}: row {i} equals its B=1 greedy output"
        );
    }
}

#[test]
fn joiners_get_their_first_token_within_the_reserve_while_many_rows_draft() {
    let b = Arc::new(CpuBackend::new(1));
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    let tok = m.tokenizer;
    let (crowd_p, join_p) = prompts(8);
    let (crowd, joiners) = (greedy(&crowd_p, CROWD_TOKENS), greedy(&join_p, JOIN_TOKENS));
    let all: Vec<Request> = crowd.iter().chain(&joiners).cloned().collect();
    let prompts_all: Vec<Vec<u32>> = all.iter().map(|r| r.prompt.clone()).collect();
    let (refs, target) = ar_reference(m.model, &tok, &prompts_all, CROWD_TOKENS + BLOCK);
    for (i, r) in refs.iter().take(crowd.len()).enumerate() {
        assert!(
            r.tokens.len() >= CROWD_TOKENS,
            "crowd row {i} does not end early: {} tokens",
            r.tokens.len()
        );
    }

    // An oracle drafter: rows accept different counts, several tokens a round.
    let mut oracle = Oracle::new(BLOCK, target.vocab(), vec![1, 2]);
    oracle.stop_ids = tok.stop_ids.clone();
    for (p, r) in prompts_all.iter().zip(&refs) {
        oracle.expect(p, r);
    }
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, AcceptPolicy::PerRow).unwrap();
    let j = crowd_and_join(&mut dec, &tok, &crowd, &joiners);
    check_bound(&j, &joiners, "DFlash, oracle");
    check_greedy(&j.done, &refs, &all, "DFlash, oracle");
    assert!(
        j.done.iter().map(|c| c.stats.accepted).sum::<usize>() > 0,
        "drafts were accepted"
    );

    // A random drafter, a crowd of greedy and sampled rows and a sampled joiner: each row
    // writes what it writes alone.
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, special_id("<|mask|>"));
    let drafter = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap();
    let DflashDecoder { target, .. } = dec;
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let mut crowd = crowd;
    for (i, r) in crowd.iter_mut().enumerate().filter(|(i, _)| i % 3 == 1) {
        r.params = sampled(100 + i as u64);
    }
    let mut joiners = joiners;
    joiners[1].params = sampled(7);
    let all: Vec<Request> = crowd.iter().chain(&joiners).cloned().collect();
    let alone: Vec<Completion> = all
        .iter()
        .map(|r| run_scheduled(&mut dec, &tok, std::slice::from_ref(r), 1, &mut |_, _| {}))
        .map(|c| c.unwrap().remove(0))
        .collect();
    let j = crowd_and_join(&mut dec, &tok, &crowd, &joiners);
    check_bound(&j, &joiners, "DFlash, random drafter");
    for (i, (g, a)) in j.done.iter().zip(&alone).enumerate() {
        assert_eq!(g.tokens, a.tokens, "row {i} writes what it writes alone");
        if all[i].params.is_greedy() {
            let want: Vec<u32> = refs[i]
                .tokens
                .iter()
                .take(all[i].max_tokens)
                .copied()
                .collect();
            assert_eq!(
                g.tokens, want,
                "greedy row {i} equals its B=1 greedy output"
            );
        }
    }
    assert!(j.done.iter().any(|c| c.stats.rounds > 0));
}

#[test]
fn ar_joiners_get_their_first_token_within_the_reserve() {
    let b = Arc::new(CpuBackend::new(1));
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    let tok = m.tokenizer;
    // Twenty rows: more tokens than the budget.
    let (crowd_p, join_p) = prompts(20);
    let (crowd, joiners) = (greedy(&crowd_p, CROWD_TOKENS), greedy(&join_p, JOIN_TOKENS));
    let all: Vec<Request> = crowd.iter().chain(&joiners).cloned().collect();
    let prompts_all: Vec<Vec<u32>> = all.iter().map(|r| r.prompt.clone()).collect();
    let (refs, target) = ar_reference(m.model, &tok, &prompts_all, CROWD_TOKENS);
    let mut dec = ArDecoder::new(target);
    let j = crowd_and_join(&mut dec, &tok, &crowd, &joiners);
    check_bound(&j, &joiners, "AR");
    check_greedy(&j.done, &refs, &all, "AR");
}

#[test]
fn hybrid_joiner_gets_one_granule_when_the_live_rows_leave_less() {
    let b = Arc::new(CpuBackend::new(1));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny_qwen35");
    let m = load_model(b.clone(), &dir).unwrap();
    assert_eq!(m.model.prefill_granule(), 64);
    let tok = m.tokenizer;
    let crowd = greedy(&[vec![5, 9, 17], vec![40, 2, 27, 3]], 48);
    let joiner = request(
        (0..70).map(|i| 3 + i % 50).collect(),
        8,
        SamplingParams::greedy(),
    );
    let all = [crowd.clone(), vec![joiner.clone()]].concat();
    let mut dec = ArDecoder::new(m.model);
    let alone: Vec<Completion> = all
        .iter()
        .map(|r| run_scheduled(&mut dec, &tok, std::slice::from_ref(r), 1, &mut |_, _| {}))
        .map(|c| c.unwrap().remove(0))
        .collect();
    let mut batch = Batch::new();
    let mut events = Vec::new();
    for (k, r) in crowd.iter().enumerate() {
        batch.enqueue(&mut dec, k, r).unwrap();
    }
    batch.step(&mut dec, &tok, &mut events).unwrap();
    assert_eq!(events.len(), 2, "both crowd rows are live: {events:?}");
    events.clear();
    // Two live rows leave 38 of 40 tokens: less than the 64-token granule of the joiner's body.
    dec.set_batch_tokens(40);
    batch.enqueue(&mut dec, 2, &joiner).unwrap();
    let mut seen = Seen::new(3);
    let mut step = 0;
    while !batch.is_empty() {
        step += 1;
        assert!(step < 1_000, "the run ends");
        batch.step(&mut dec, &tok, &mut events).unwrap();
        seen.note(&mut events, step);
        if seen.first[2].is_none() {
            assert!(
                seen.done.iter().all(Option::is_none),
                "a row ended before the joiner got its first token"
            );
        }
    }
    // The 64-token body in one step, the 6-token tail in the next.
    assert_eq!(seen.first[2], Some(2));
    for (i, (g, a)) in seen.done.iter().zip(&alone).enumerate() {
        assert_eq!(
            g.as_ref().unwrap().tokens,
            a.tokens,
            "row {i} writes what it writes alone"
        );
    }
}
