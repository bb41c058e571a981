//! The lossless gate on a Qwen 3.5 hybrid target (the tiny transformers-checked model of
//! crates/models/tests/fixtures/tiny_qwen35: 4 Gated DeltaNet + 2 gated attention layers):
//! greedy DFlash output equals greedy autoregressive output token for token —
//! - B = 1 with an oracle drafter that forces every accept count 0..B-1 and full accepts,
//!   and with a randomly initialised drafter (almost every block rejected: every round rolls
//!   the GDN state back);
//! - batched, B = 2/4/8, equal-length and ragged prompts (rows at different positions), per
//!   row and under the clamp, with rounds in which rows accepted different counts asserted
//!   and every row's accepted total checked against its own drafts (per row) or the round
//!   minima (clamp);
//! - identical prompts in every row give identical outputs although rows accept differently.
//!
//! Prompts include lengths above 64 so the prefill runs the chunked form of the gated delta
//! rule; verification always runs the token-by-token form.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use common::*;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Completion, FinishReason, SamplingParams};
use dflash_models::synthetic::{drafter_config_for, random_drafter};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{load_model, DflashDrafter, Target, TargetModel};
use rand::{Rng, SeedableRng};

const TOKENS: usize = 48;
const BLOCK: usize = 8;
/// Tap layers the oracle claims (any valid layers of the 6-layer target).
const TAPS: [usize; 2] = [1, 4];

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny_qwen35")
}

fn load(b: &Arc<Cpu>) -> (TargetModel<Cpu>, TextTokenizer) {
    let m = load_model(b.clone(), &model_dir()).unwrap();
    assert!(matches!(m.model, TargetModel::Qwen35(_)));
    (m.model, m.tokenizer)
}

struct Shared {
    backend: Arc<Cpu>,
    /// Eight prompts of one length, then eight ragged ones (some longer than 64 tokens).
    prompts: Vec<Vec<u32>>,
    refs: Vec<Completion>,
}

fn shared() -> &'static Shared {
    static S: OnceLock<Shared> = OnceLock::new();
    S.get_or_init(|| {
        let backend = Arc::new(Cpu::new(2));
        let (target, tok) = load(&backend);
        let vocab = target.vocab() as u32;
        let mut rng = rand::rngs::StdRng::seed_from_u64(35);
        // Ordinary tokens only (the last three ids are the special tokens).
        let mut prompt =
            |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab - 3)).collect() };
        let mut prompts: Vec<Vec<u32>> = (0..8).map(|_| prompt(20)).collect();
        for n in [3, 70, 11, 129, 40, 1, 90, 25] {
            prompts.push(prompt(n));
        }
        let (refs, _) = ar_reference(target, &tok, &prompts, TOKENS + BLOCK);
        Shared {
            backend,
            prompts,
            refs,
        }
    })
}

fn want(c: &Completion, n: usize) -> Vec<u32> {
    c.tokens.iter().take(n).copied().collect()
}

/// Runs pool entries `idx` together under `policy`; checks outputs and accept totals.
fn oracle_run(
    idx: &[usize],
    policy: AcceptPolicy,
    schedule: Schedule,
    label: &str,
) -> (Vec<Completion>, Oracle) {
    let sh = shared();
    let (target, tok) = load(&sh.backend);
    let mut oracle = Oracle::with_schedule(BLOCK, target.vocab(), TAPS.to_vec(), schedule);
    oracle.stop_ids = tok.stop_ids.clone();
    for &i in idx {
        oracle.expect(&sh.prompts[i], &sh.refs[i]);
    }
    let requests: Vec<_> = idx
        .iter()
        .map(|&i| request(sh.prompts[i].clone(), TOKENS, SamplingParams::greedy()))
        .collect();
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, policy).unwrap();
    assert_eq!(dec.policy(), policy);
    let got = run_scheduled(&mut dec, &tok, &requests, usize::MAX, &mut |_, _| {}).unwrap();
    for (k, (&i, c)) in idx.iter().zip(&got).enumerate() {
        assert_eq!(
            c.tokens,
            want(&sh.refs[i], TOKENS),
            "{label}: row {k} (prompt {i})"
        );
        let reason = if c.tokens.len() == TOKENS {
            FinishReason::Length
        } else {
            FinishReason::Stop
        };
        assert_eq!(c.finish_reason, reason, "{label}: row {k}");
    }
    let totals = dec.drafter.expected_totals(policy == AcceptPolicy::Clamp);
    assert_eq!(
        totals.len(),
        idx.len(),
        "{label}: every row exactly predictable"
    );
    for (&row, &n) in &totals {
        assert_eq!(got[row].stats.accepted, n, "{label}: row {row} accepted");
    }
    (got, dec.drafter)
}

#[test]
fn b1_oracle_forces_every_accept_count() {
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..16 {
        let (_, oracle) = oracle_run(
            &[i],
            AcceptPolicy::PerRow,
            Schedule::Rotating,
            &format!("B=1 prompt {i}"),
        );
        seen.extend(oracle.accept_counts_seen());
    }
    assert_eq!(
        seen,
        (0..BLOCK).collect(),
        "every accept count 0..={} ran",
        BLOCK - 1
    );
}

#[test]
fn b1_random_drafter_equals_ar() {
    let sh = shared();
    let (target, tok) = load(&sh.backend);
    let cfg = drafter_config_for(64, 4, 2, 96, target.n_layers(), 2, BLOCK, 297);
    let drafter =
        DflashDrafter::load(sh.backend.clone(), cfg.clone(), &random_drafter(&cfg, 7)).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    for (i, p) in sh.prompts.iter().enumerate() {
        let r = request(p.clone(), TOKENS, SamplingParams::greedy());
        let got = run_scheduled(&mut dec, &tok, &[r], 1, &mut |_, _| {})
            .unwrap()
            .remove(0);
        assert_eq!(
            got.tokens,
            want(&sh.refs[i], TOKENS),
            "random drafter, prompt {i}"
        );
    }
}

#[test]
fn batched_per_row_and_clamp_equal_b1() {
    for policy in [AcceptPolicy::PerRow, AcceptPolicy::Clamp] {
        let schedule = match policy {
            AcceptPolicy::PerRow => Schedule::Rotating,
            AcceptPolicy::Clamp => Schedule::OneRowPerRound,
        };
        for (set, offset) in [("equal", 0), ("ragged", 8)] {
            for b in [2usize, 4, 8] {
                let idx: Vec<usize> = (offset..offset + b).collect();
                let label = format!("{policy:?} {set} B={b}");
                let (_, oracle) = oracle_run(&idx, policy, schedule, &label);
                assert!(
                    oracle.rounds_with_different_accepts() > 0,
                    "{label}: rows accepted different counts in some round"
                );
            }
        }
    }
}

#[test]
fn identical_prompts_give_identical_rows() {
    let (got, oracle) = oracle_run(
        &[11; 4],
        AcceptPolicy::PerRow,
        Schedule::Rotating,
        "identical B=4",
    );
    assert!(oracle.rounds_with_different_accepts() > 0);
    for c in &got[1..] {
        assert_eq!(c.tokens, got[0].tokens);
    }
}
