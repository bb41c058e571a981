//! The lossless gate: greedy DFlash output equals greedy autoregressive output, token for
//! token, on 20 prompts x 128 tokens of the default model — with an oracle drafter that forces
//! every accept count 0..B-1 and full accepts, with a randomly initialised drafter, and with the
//! trained drafter shipped for the default model; and for DFlash2, with the oracle proposing
//! through a candidate lattice (every accept count again) and with a randomly initialised
//! DFlash2 drafter (convolutions, sliding windows, selector); and with the trained drafter as
//! the CPU runs it by default (Q4_1 layer weights) drafting over a vocabulary shortlist of
//! 1024 tokens. A second gate runs the oracle and the trained drafter with the CPU's two-term
//! int8 activations (`DFLASH_MATMUL=int8x2`), whose verify rows must also equal decode rows.

mod common;

use common::*;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_batch;
use dflash_engine::{Completion, Decoder, SamplingParams};
use dflash_models::draft_vocab::{DraftVocab, DRAFT_VOCAB_FILE};
use dflash_models::synthetic::{dflash2_config_for, drafter_config_for, random_drafter};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{DflashDrafter, Target};
use dflash_runtime::cpu::{CpuBackend, Isa, MatmulMode};
use dflash_runtime::{Activations, DType};
use std::sync::Arc;

const TOKENS: usize = 128;
const BLOCK: usize = 16;

#[test]
fn greedy_dflash_equals_greedy_ar() {
    let b = backend();
    let m = default_model(&b);
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| chat_prompt(&m, p)).collect();
    let tok = m.tokenizer;
    // The oracle needs to know a little past the last token DFlash may be asked about.
    let (reference, target) = ar_reference(m.model, &tok, &prompts, TOKENS + BLOCK);

    // (b) Oracle drafter: every accept count, including the full block.
    let taps = vec![1, 8, 14, 20, 27];
    let mut oracle = Oracle::new(BLOCK, target.vocab(), taps.clone());
    oracle.queue.extend(sequences(&prompts, &reference));
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, AcceptPolicy::PerRow).unwrap();
    let (_, rounds) = decode_each(&mut dec, &tok, &prompts, &reference, "oracle drafter");
    assert_eq!(
        dec.drafter.accept_counts_seen(),
        (0..BLOCK).collect(),
        "every accept count 0..{} ran",
        BLOCK - 1
    );
    assert!(rounds > 0);

    // (a) Randomly initialised drafter (almost nothing accepted: stresses rollback).
    let target = dec.target;
    let cfg = drafter_config_for(576, 9, 3, 1536, 30, 2, BLOCK, 16);
    let drafter = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 7)).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    decode_each(&mut dec, &tok, &prompts, &reference, "random drafter");

    // (d) DFlash2: the oracle proposing through a candidate lattice, every accept count.
    let target = dec.target;
    let mut oracle = Oracle::new(BLOCK, target.vocab(), taps.clone()).selector();
    oracle.queue.extend(sequences(&prompts, &reference));
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, AcceptPolicy::PerRow).unwrap();
    decode_each(&mut dec, &tok, &prompts, &reference, "lattice oracle");
    assert_eq!(
        dec.drafter.accept_counts_seen(),
        (0..BLOCK).collect(),
        "lattice oracle: every accept count"
    );

    // (e) A randomly initialised DFlash2 drafter (windows of 64 positions: they cut the
    // context of every prompt before the end).
    let target = dec.target;
    let cfg = dflash2_config_for(
        drafter_config_for(576, 9, 3, 1536, 30, 2, BLOCK, 16),
        target.vocab(),
        64,
    );
    let drafter = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 9)).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    decode_each(
        &mut dec,
        &tok,
        &prompts[..8],
        &reference,
        "random DFlash2 drafter",
    );

    // (c) The trained drafter shipped for the default model, at its trained block size.
    let target = dec.target;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/drafters/smollm2-135m-instruct-dflash");
    let drafter = DflashDrafter::open(b.clone(), &dir).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let what = "trained drafter";
    let (accepted, _) = decode_each(&mut dec, &tok, &prompts, &reference, what);
    assert!(accepted > 0, "the trained drafter gets drafts accepted");

    // (f) The trained drafter as the CPU runs it by default: its layer weights re-encoded as
    // Q4_1 at load, over the 1024 most frequent tokens of its shipped ranking (its head is
    // those rows of the target's head, and tokens the target writes outside the list can
    // never be drafted).
    let target = dec.target;
    let ranked = DraftVocab::read(&dir.join(DRAFT_VOCAB_FILE)).unwrap();
    let ids = ranked.top(1024).unwrap().to_vec();
    let mut drafter = DflashDrafter::open_as(b.clone(), &dir, Some(DType::Q4_1)).unwrap();
    drafter
        .set_vocab_shortlist(ids.clone(), target.lm_head_rows(&ids).unwrap())
        .unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let what = "trained drafter with Q4_1 weights and a shortlist";
    let (accepted, _) = decode_each(&mut dec, &tok, &prompts[..8], &reference, what);
    let unlisted = reference[..8]
        .iter()
        .flat_map(|c| c.tokens.iter().take(TOKENS))
        .filter(|t| !ids.contains(t))
        .count();
    assert!(accepted > 0, "the shortlisted drafter gets drafts accepted");
    assert!(
        unlisted > 0,
        "the target writes tokens outside the shortlist"
    );
}

/// The lossless gate under two-term int8 activations (`DFLASH_MATMUL=int8x2`): a verify block's
/// rows and a decode row take the same kernels' sums in the same order there too, so greedy
/// DFlash equals greedy AR with the oracle (every accept count) and with the trained drafter.
#[test]
fn greedy_dflash_equals_greedy_ar_with_two_term_int8_activations() {
    const PROMPTS_X2: usize = 6;
    let b = Arc::new(CpuBackend::with_options(
        0,
        Isa::detect(),
        MatmulMode::Int8x2,
    ));
    let m = default_model(&b);
    let paths = m.model.matmul_paths();
    let x2 = paths
        .iter()
        .filter(|p| p.path.activations == Activations::Int8x2)
        .count();
    if x2 == 0 {
        println!(
            "SKIPPED (not a pass): this CPU has no int8 kernel ({:?}), so int8x2 takes the f32 \
             kernels and there is nothing to check",
            Isa::detect()
        );
        return;
    }
    let prompts: Vec<Vec<u32>> = PROMPTS[..PROMPTS_X2]
        .iter()
        .map(|p| chat_prompt(&m, p))
        .collect();
    let tok = m.tokenizer;
    let (reference, target) = ar_reference(m.model, &tok, &prompts, TOKENS + BLOCK);

    let mut oracle = Oracle::new(BLOCK, target.vocab(), vec![1, 8, 14, 20, 27]);
    oracle.queue.extend(sequences(&prompts, &reference));
    let mut dec = DflashDecoder::new(target, oracle, BLOCK, AcceptPolicy::PerRow).unwrap();
    decode_each(
        &mut dec,
        &tok,
        &prompts,
        &reference,
        "int8x2, oracle drafter",
    );
    assert_eq!(
        dec.drafter.accept_counts_seen(),
        (0..BLOCK).collect(),
        "int8x2: every accept count 0..{} ran",
        BLOCK - 1
    );

    let target = dec.target;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/drafters/smollm2-135m-instruct-dflash");
    let drafter = DflashDrafter::open(b.clone(), &dir).unwrap();
    let mut dec = DflashDecoder::new(target, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let what = "int8x2, trained drafter";
    let (accepted, _) = decode_each(&mut dec, &tok, &prompts, &reference, what);
    assert!(
        accepted > 0,
        "int8x2: the trained drafter gets drafts accepted"
    );
}

/// Decodes each prompt alone with `dec` (greedy, `TOKENS` tokens) and asserts it writes the AR
/// reference's tokens; returns the drafts accepted and the rounds, summed over the prompts.
fn decode_each(
    dec: &mut dyn Decoder,
    tok: &TextTokenizer,
    prompts: &[Vec<u32>],
    reference: &[Completion],
    what: &str,
) -> (usize, usize) {
    let (mut accepted, mut rounds) = (0, 0);
    for (i, p) in prompts.iter().enumerate() {
        let r = request(p.clone(), TOKENS, SamplingParams::greedy());
        let got = run_batch(dec, tok, &[r], &mut |_, _| {}).unwrap().remove(0);
        let want: Vec<u32> = reference[i].tokens.iter().take(TOKENS).copied().collect();
        assert_eq!(got.tokens, want, "{what}, prompt {i}");
        accepted += got.stats.accepted;
        rounds += got.stats.rounds;
    }
    (accepted, rounds)
}
