//! `SpecMode::Auto` (drafting only while it pays) never changes greedy output: whatever mix of
//! speculative rounds and plain steps the timing leads to, every row of a batch writes exactly
//! its B=1 greedy output. With a drafter that proposes the right tokens and one that proposes
//! random ones; both kinds of round run (the gate tries each and keeps probing), also while
//! joining rows' prompt pieces ride in the rounds.

mod common;

use std::sync::Arc;

use common::{ar_reference, request, sharp_tiny_path, Oracle};
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Completion, Decoder, SamplingParams, SpecMode};
use dflash_models::synthetic::{drafter_config_for, random_drafter, special_id};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{load_model, DflashDrafter, Target};
use dflash_runtime::cpu::CpuBackend;

const TOKENS: usize = 48;
const BLOCK: usize = 4;

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![5, 9, 17],
        vec![40, 2, 77, 3, 8],
        vec![100, 101],
        vec![7; 6],
    ]
}

/// The two runs of a check: all rows at once, then two at a time with a step budget that cuts
/// the prompts into pieces, so joining rows' prompt pieces ride in the live rows' rounds (which
/// the gate measures too): `(max_live, batch_tokens)`.
const RUNS: [(usize, usize); 2] = [(4, 512), (2, 10)];

fn both_kinds_ran((rounds, plain): (usize, usize)) {
    assert!(
        rounds > 0 && plain > 0,
        "both kinds ran: {rounds} speculative, {plain} plain"
    );
}

/// One run of the prompts, at most `max_live` at a time with a step budget of
/// `batch_tokens`; returns the speculative rounds and plain steps of all rows.
fn check_run(
    dec: &mut dyn Decoder,
    tok: &TextTokenizer,
    refs: &[Completion],
    max_live: usize,
    batch_tokens: usize,
) -> (usize, usize) {
    dec.set_batch_tokens(batch_tokens);
    let requests: Vec<_> = prompts()
        .into_iter()
        .map(|p| request(p, TOKENS, SamplingParams::greedy()))
        .collect();
    let got = run_scheduled(dec, tok, &requests, max_live, &mut |_, _| {}).unwrap();
    let (mut rounds, mut plain) = (0, 0);
    for (i, (c, r)) in got.iter().zip(refs).enumerate() {
        let want: Vec<u32> = r.tokens.iter().take(TOKENS).copied().collect();
        assert_eq!(c.tokens, want, "row {i} equals its B=1 greedy output");
        rounds += c.stats.rounds;
        plain += c.stats.plain_steps;
    }
    (rounds, plain)
}

#[test]
fn auto_speculation_keeps_greedy_output() {
    let b = Arc::new(CpuBackend::new(1));
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    let tok = m.tokenizer;
    let (refs, target) = ar_reference(m.model, &tok, &prompts(), TOKENS + BLOCK);

    // A drafter that knows the continuation (errors at rotating slots).
    let mut oracle = Oracle::new(BLOCK, target.vocab(), vec![1, 2]);
    oracle.stop_ids = tok.stop_ids.clone();
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, AcceptPolicy::PerRow).unwrap();
    dec.set_spec_mode(SpecMode::Auto);
    let mut kinds = (0, 0);
    for (max_live, batch_tokens) in RUNS {
        // The oracle's rows, in the order the run opens them.
        for (p, r) in prompts().iter().zip(&refs) {
            dec.drafter.expect(p, r);
        }
        let k = check_run(&mut dec, &tok, &refs, max_live, batch_tokens);
        kinds = (kinds.0 + k.0, kinds.1 + k.1);
    }
    both_kinds_ran(kinds);

    // A randomly initialised drafter.
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, special_id("<|mask|>"));
    let drafter = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap();
    let DflashDecoder { target, .. } = dec;
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    dec.set_spec_mode(SpecMode::Auto);
    let mut kinds = (0, 0);
    for (max_live, batch_tokens) in RUNS {
        let k = check_run(&mut dec, &tok, &refs, max_live, batch_tokens);
        kinds = (kinds.0 + k.0, kinds.1 + k.1);
    }
    both_kinds_ran(kinds);
}
