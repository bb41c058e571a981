//! The batched parity gate: with B = 2, 4 and 8 rows decoding together (equal-length prompts
//! and ragged prompts, 128 greedy tokens per row), every row's batched DFlash output equals
//! its own B=1 autoregressive output, token for token, both when every row commits its own
//! accept count (per-row policy) and when all rows commit the round's minimum (clamp policy).
//!
//! The oracle drafter injects errors at a different block slot for every row, and the test
//! checks that rows really accepted different counts in the same round and that each row's
//! accepted total is exactly what its own drafts (per-row) or the round minimum (clamp) give,
//! so the gate cannot pass by never diverging. Also: identical prompts in every row give
//! identical outputs, a randomly initialised drafter in a batch, and continuous batching
//! (more requests than `max_live`, rows joining as others finish). DFlash2: the oracle
//! proposing through a candidate lattice in a ragged batch, and a random DFlash2 drafter.

mod common;

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use common::*;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::{run_batch, run_scheduled};
use dflash_engine::{Completion, FinishReason, Request, SamplingParams};
use dflash_models::synthetic::{dflash2_config_for, drafter_config_for, random_drafter};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::TargetModel;
use dflash_models::{DflashDrafter, Drafter, Target};

/// Tokens per row.
const TOKENS: usize = 128;
/// Oracle block: drafts at slots 1..BLOCK.
const BLOCK: usize = 8;
/// Tap layers the oracle claims (any valid layers of the 30-layer target).
const TAPS: [usize; 3] = [1, 14, 27];

/// Questions (indices into `PROMPTS`). The first four have answers longer than 128 tokens in
/// both prompt forms (so B=2 and B=4 rows are exactly checkable); in B=8 some rows end early
/// (end of sequence) and leave the batch while the others go on.
const QUESTIONS: [usize; 8] = [5, 7, 11, 12, 1, 3, 9, 4];

/// Prompts and their B=1 greedy references, computed once for every test in this file.
struct Shared {
    backend: Arc<Cpu>,
    /// The chat prompts of `QUESTIONS` with their first tokens cut so all have one length.
    equal: Vec<Vec<u32>>,
    /// The chat prompts of `QUESTIONS` (different lengths).
    ragged: Vec<Vec<u32>>,
    /// References of `equal` then `ragged` (TOKENS + BLOCK tokens, or up to EOS).
    refs: Vec<Completion>,
}

fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(|| {
        let backend = backend();
        let m = default_model(&backend);
        let ragged: Vec<Vec<u32>> = QUESTIONS
            .iter()
            .map(|&q| chat_prompt(&m, PROMPTS[q]))
            .collect();
        // Cutting from the front keeps each question and the assistant header.
        let len = ragged.iter().map(Vec::len).min().unwrap() - 2;
        let equal: Vec<Vec<u32>> = ragged.iter().map(|p| p[p.len() - len..].to_vec()).collect();
        for i in 0..equal.len() {
            for j in 0..i {
                assert_ne!(
                    equal[i], equal[j],
                    "equal-length prompts {j} and {i} differ"
                );
            }
        }
        let t0 = Instant::now();
        let all: Vec<Vec<u32>> = equal.iter().chain(&ragged).cloned().collect();
        let (refs, _) = ar_reference(m.model, &m.tokenizer, &all, TOKENS + BLOCK);
        eprintln!(
            "AR references: {} prompts x {} tokens in {:.1} s; prompt lengths {:?}; \
             reference lengths {:?}",
            all.len(),
            TOKENS + BLOCK,
            t0.elapsed().as_secs_f64(),
            all.iter().map(Vec::len).collect::<Vec<_>>(),
            refs.iter().map(|c| c.tokens.len()).collect::<Vec<_>>(),
        );
        Shared {
            backend,
            equal,
            ragged,
            refs,
        }
    })
}

impl Shared {
    fn model(&self) -> (TargetModel<Cpu>, TextTokenizer) {
        let m = default_model(&self.backend);
        (m.model, m.tokenizer)
    }

    /// Prompt and reference of pool entry `i` (0..8 equal, 8..16 ragged).
    fn entry(&self, i: usize) -> (&[u32], &Completion) {
        let p = if i < 8 {
            &self.equal[i]
        } else {
            &self.ragged[i - 8]
        };
        (p, &self.refs[i])
    }
}

/// What B=1 greedy decoding gives for a request of `max_tokens` tokens.
fn expected(reference: &Completion, max_tokens: usize) -> (Vec<u32>, FinishReason) {
    let toks: Vec<u32> = reference.tokens.iter().take(max_tokens).copied().collect();
    let reason = if toks.len() == max_tokens {
        FinishReason::Length
    } else {
        assert_eq!(reference.finish_reason, FinishReason::Stop);
        FinishReason::Stop
    };
    (toks, reason)
}

/// One batched run: pool entries (0..8 equal-length prompts, 8..16 ragged), their token
/// limits, the accept policy and how many rows may decode at once.
struct Case<'a> {
    idx: &'a [usize],
    max_tokens: &'a [usize],
    policy: AcceptPolicy,
    max_live: usize,
    label: &'a str,
    /// The oracle proposes through a DFlash2 candidate lattice.
    selector: bool,
}

/// Runs `case` with an oracle drafter; checks every output against its B=1 reference and each
/// row's accepted total against the oracle. Returns the outputs, the oracle and the target.
fn oracle_case(
    sh: &Shared,
    target: TargetModel<Cpu>,
    tok: &TextTokenizer,
    case: Case<'_>,
) -> (Vec<Completion>, Oracle, TargetModel<Cpu>) {
    let Case {
        idx,
        max_tokens,
        policy,
        max_live,
        label,
        selector,
    } = case;
    let t0 = Instant::now();
    // Per-row: every row errs at its own slot each round. Clamp: one row errs per round (with
    // every row erring, the minimum is almost always 0 and 128 tokens take 128 rounds).
    let schedule = match policy {
        AcceptPolicy::PerRow => Schedule::Rotating,
        AcceptPolicy::Clamp => Schedule::OneRowPerRound,
    };
    let mut oracle = Oracle::with_schedule(BLOCK, target.vocab(), TAPS.to_vec(), schedule);
    if selector {
        oracle = oracle.selector();
    }
    let mut requests = Vec::new();
    oracle.stop_ids = tok.stop_ids.clone();
    for &i in idx {
        let (p, r) = sh.entry(i);
        oracle.expect(p, r);
    }
    for (&i, &n) in idx.iter().zip(max_tokens) {
        requests.push(request(sh.entry(i).0.to_vec(), n, SamplingParams::greedy()));
    }
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, policy).unwrap();
    let got = run_scheduled(&mut dec, tok, &requests, max_live, &mut |_, _| {}).unwrap();
    for (k, ((&i, &n), c)) in idx.iter().zip(max_tokens).zip(&got).enumerate() {
        let (want, reason) = expected(sh.entry(i).1, n);
        assert_eq!(
            c.tokens, want,
            "{label}: row {k} (pool entry {i}) differs from B=1"
        );
        assert_eq!(c.finish_reason, reason, "{label}: row {k} finish reason");
    }
    // The oracle opened rows in request order, so oracle row k is request k.
    let totals = dec.drafter.expected_totals(policy == AcceptPolicy::Clamp);
    assert_eq!(
        totals.len(),
        idx.len(),
        "{label}: every row's accepts are exactly predictable"
    );
    for (&row, &want) in &totals {
        assert_eq!(
            got[row].stats.accepted, want,
            "{label}: row {row} accepted what its {policy:?} commits give"
        );
    }
    eprintln!(
        "{label}: {} rounds, {} rows exact-checked, {:.1} s",
        dec.drafter.expected_accepts.len(),
        totals.len(),
        t0.elapsed().as_secs_f64()
    );
    (got, dec.drafter, dec.target)
}

#[test]
fn batched_dflash_equals_b1_per_row_and_clamp() {
    let sh = shared();
    let (mut target, tok) = sh.model();
    for policy in [AcceptPolicy::PerRow, AcceptPolicy::Clamp] {
        for (set, offset) in [("equal", 0), ("ragged", 8)] {
            for b in [2usize, 4, 8] {
                let idx: Vec<usize> = (offset..offset + b).collect();
                if set == "ragged" {
                    let lens: Vec<usize> = idx.iter().map(|&i| sh.entry(i).0.len()).collect();
                    assert!(
                        lens.iter().any(|&l| l != lens[0]),
                        "ragged lengths {lens:?}"
                    );
                } else {
                    assert!(idx
                        .iter()
                        .all(|&i| sh.entry(i).0.len() == sh.equal[0].len()));
                }
                let label = format!("{policy:?} {set} B={b}");
                let case = Case {
                    idx: &idx,
                    max_tokens: &vec![TOKENS; b],
                    policy,
                    max_live: usize::MAX,
                    label: &label,
                    selector: false,
                };
                let (_, oracle, t) = oracle_case(sh, target, &tok, case);
                target = t;
                assert!(
                    oracle.rounds_with_different_accepts() > 0,
                    "{label}: some round had rows accepting different counts"
                );
            }
        }
    }
}

#[test]
fn identical_prompts_give_identical_rows() {
    let sh = shared();
    let (target, tok) = sh.model();
    let label = "PerRow identical B=4";
    let case = Case {
        // PROMPTS[7]: its greedy output runs the full TOKENS on the int8 and the f32 CPU paths
        // (PROMPTS[5], used before, ends after 19 tokens on the int8 path).
        idx: &[9; 4],
        max_tokens: &[TOKENS; 4],
        policy: AcceptPolicy::PerRow,
        max_live: usize::MAX,
        label,
        selector: false,
    };
    let (got, oracle, _) = oracle_case(sh, target, &tok, case);
    // Same prompt, same output, even though the oracle made the rows accept differently (so
    // the rows sat at different positions for most of the run).
    assert!(oracle.rounds_with_different_accepts() > 0, "{label}");
    assert_eq!(got[0].tokens.len(), TOKENS);
    for c in &got[1..] {
        assert_eq!(c.tokens, got[0].tokens, "{label}: identical rows agree");
    }
}

#[test]
fn continuous_batching_equals_b1() {
    let sh = shared();
    let (target, tok) = sh.model();
    // Six requests, at most three live: rows finish at different times (token limits, one end
    // of sequence) and the waiting ones join between rounds, taking freed slots.
    let idx = [8, 1, 15, 10, 3, 13];
    let max_tokens = [20, TOKENS, 50, 90, 35, TOKENS];
    let case = Case {
        idx: &idx,
        max_tokens: &max_tokens,
        policy: AcceptPolicy::PerRow,
        max_live: 3,
        label: "PerRow scheduled 6 requests, max_live 3",
        selector: false,
    };
    let (_, oracle, _) = oracle_case(sh, target, &tok, case);
    assert!(oracle.rounds_with_different_accepts() > 0);
    assert!(
        oracle.round_rows.iter().all(|r| r.len() <= 3),
        "never more than max_live rows in a round"
    );
    assert!(
        oracle
            .round_rows
            .iter()
            .any(|r| r.iter().any(|x| x.0 < 3) && r.iter().any(|x| x.0 >= 3)),
        "a late request decoded alongside an early one"
    );
}

#[test]
fn random_drafter_batch_equals_b1() {
    let sh = shared();
    let (target, tok) = sh.model();
    let t0 = Instant::now();
    let cfg = drafter_config_for(576, 9, 3, 1536, 30, 2, 16, 16);
    let drafter =
        DflashDrafter::load(sh.backend.clone(), cfg.clone(), &random_drafter(&cfg, 7)).unwrap();
    assert_eq!(drafter.block_size(), 16);
    // A small block: a random drafter is almost never right, so every round costs a verify.
    let mut dec = DflashDecoder::new(target, drafter, 4, AcceptPolicy::PerRow).unwrap();
    let idx = [8, 1, 15];
    let tokens = 64;
    let requests: Vec<Request> = idx
        .iter()
        .map(|&i| request(sh.entry(i).0.to_vec(), tokens, SamplingParams::greedy()))
        .collect();
    let got = run_batch(&mut dec, &tok, &requests, &mut |_, _| {}).unwrap();
    for (k, (&i, c)) in idx.iter().zip(&got).enumerate() {
        let (want, reason) = expected(sh.entry(i).1, tokens);
        assert_eq!(c.tokens, want, "random drafter: row {k} (pool entry {i})");
        assert_eq!(c.finish_reason, reason);
    }
    eprintln!(
        "random drafter B={}: {} accepted, {:.1} s",
        idx.len(),
        got.iter().map(|c| c.stats.accepted).sum::<usize>(),
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn dflash2_batch_equals_b1() {
    let sh = shared();
    let (target, tok) = sh.model();
    // The oracle through a candidate lattice: ragged B=4, every row its own accept count.
    let idx: Vec<usize> = (8..12).collect();
    let case = Case {
        idx: &idx,
        max_tokens: &[TOKENS; 4],
        policy: AcceptPolicy::PerRow,
        max_live: usize::MAX,
        label: "PerRow ragged B=4, lattice oracle",
        selector: true,
    };
    let (_, oracle, target) = oracle_case(sh, target, &tok, case);
    assert!(oracle.rounds_with_different_accepts() > 0);

    // A random DFlash2 drafter (window 48: it cuts every row's context) in a ragged batch.
    let t0 = Instant::now();
    let cfg = dflash2_config_for(
        drafter_config_for(576, 9, 3, 1536, 30, 2, 8, 16),
        target.vocab(),
        48,
    );
    let drafter =
        DflashDrafter::load(sh.backend.clone(), cfg.clone(), &random_drafter(&cfg, 11)).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, 4, AcceptPolicy::PerRow).unwrap();
    let idx = [8, 1, 15];
    let tokens = 64;
    let requests: Vec<Request> = idx
        .iter()
        .map(|&i| request(sh.entry(i).0.to_vec(), tokens, SamplingParams::greedy()))
        .collect();
    let got = run_batch(&mut dec, &tok, &requests, &mut |_, _| {}).unwrap();
    for (k, (&i, c)) in idx.iter().zip(&got).enumerate() {
        let (want, reason) = expected(sh.entry(i).1, tokens);
        assert_eq!(
            c.tokens, want,
            "random DFlash2 drafter: row {k} (pool entry {i})"
        );
        assert_eq!(c.finish_reason, reason);
    }
    eprintln!(
        "random DFlash2 drafter B={}: {} accepted, {:.1} s",
        idx.len(),
        got.iter().map(|c| c.stats.accepted).sum::<usize>(),
        t0.elapsed().as_secs_f64()
    );
}
