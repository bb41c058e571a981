//! The shipped drafter in our engine drafts what the training package (PyTorch, with target
//! features from transformers) drafts for the same context (fixture made by
//! tools/make_trained_drafter_fixture.py). Slots whose top-1/top-2 logit margin in PyTorch is
//! below 1e-2 are near-ties that f32 summation order may flip; all others must agree. With its
//! layer weights re-encoded as Q8_0 at load (`--draft-weights q8_0`) the drafter still drafts
//! what PyTorch drafts on all but a few of those slots; as Q4_1 (the CPU's default) on most.

use std::path::Path;
use std::sync::Arc;

use dflash_models::default_model::{ensure_default_model, Silent};
use dflash_models::{load_model, DflashDrafter, Drafter, LogitRows, RowStep, Target};
use dflash_runtime::cpu::ops::elementwise::argmax;
use dflash_runtime::cpu::{CpuBackend, Isa, MatmulMode};
use dflash_runtime::{Backend, DType};
use serde_json::Value;

/// Slots where the shipped drafter (layer weights re-encoded as `weights`, or as stored) drafts
/// what PyTorch drafts, and the slots compared (PyTorch margin >= 1e-2).
fn agreement(weights: Option<DType>) -> (usize, usize) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/trained_drafter_tf.json")).unwrap(),
    )
    .unwrap();
    // The f32 path: the fixture's target features come from transformers in f32 (the int8
    // path moves them, see golden_smollm2.rs, and with them the drafts near ties).
    let b = Arc::new(CpuBackend::with_options(
        0,
        Isa::detect(),
        MatmulMode::Reference,
    ));
    let path = ensure_default_model(&Silent).expect("the default model must be obtainable");
    let mut target = load_model(b.clone(), &path).unwrap().model;
    let dir = root.join("../../models/drafters/smollm2-135m-instruct-dflash");
    let mut drafter = DflashDrafter::open_as(b.clone(), &dir, weights).unwrap();
    target.set_tap_layers(drafter.tap_layers()).unwrap();
    let block = fixture["block_size"].as_u64().unwrap() as usize;
    let (mut compared, mut agree) = (0, 0);
    for (ci, case) in fixture["cases"].as_array().unwrap().iter().enumerate() {
        let toks: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let a = toks.len() - 1;
        let row = target.new_row(a + block).unwrap();
        let drow = drafter.new_row(a + block).unwrap();
        target
            .forward(&[RowStep {
                row,
                tokens: &toks[..a],
                logits: LogitRows::None,
                prompt: true,
                argmax_only: false,
            }])
            .unwrap();
        let tap_rows: Vec<u32> = (0..a as u32).collect();
        drafter
            .extend(&[(drow, a)], target.taps(), &tap_rows)
            .unwrap();
        drafter
            .draft(
                &[(drow, toks[a])],
                block,
                target.embedding(),
                target.lm_head(),
            )
            .unwrap();
        let logits = b.to_host(drafter.logits());
        let vocab = target.vocab();
        for (slot, (want, margin)) in case["drafts"]
            .as_array()
            .unwrap()
            .iter()
            .zip(case["margins"].as_array().unwrap())
            .enumerate()
        {
            let got = argmax(&logits[slot * vocab..(slot + 1) * vocab]);
            if margin.as_f64().unwrap() < 1e-2 {
                continue;
            }
            compared += 1;
            if got as u64 == want.as_u64().unwrap() {
                agree += 1;
            } else if weights.is_none() {
                panic!(
                    "case {ci} slot {}: {got} against PyTorch's {want}",
                    slot + 1
                );
            }
        }
        target.release_row(row);
        drafter.release_row(drow);
    }
    assert!(compared > 300, "only {compared} slots compared");
    (agree, compared)
}

#[test]
fn shipped_drafter_matches_the_training_implementation() {
    let (agree, compared) = agreement(None);
    assert_eq!(agree, compared);
}

#[test]
fn shipped_drafter_with_q8_0_weights_drafts_nearly_the_same() {
    let (agree, compared) = agreement(Some(DType::Q8_0));
    println!("Q8_0 drafter weights: {agree} of {compared} slots as PyTorch");
    assert!(
        agree * 100 >= compared * 97,
        "Q8_0 drafter weights: only {agree} of {compared} slots as PyTorch"
    );
}

/// The least share of slots (percent) where the drafter with Q4_1 layer weights (the CPU's
/// default, `--draft-weights q4_1`) must draft what PyTorch drafts. A 4-bit re-encoding moves
/// drafts where the top two logits are within its rounding: 327 of 356 slots (92 %) for the
/// drafter of 2026-12-02, whose MT-Bench τ it left unchanged (2.638 against 2.635 as stored,
/// docs/benchmarks/2026-12-02-drafter-round5-h200.md); 311 of 355 (87.6 %) for the round-8
/// drafter, τ 2.786 against 2.806 as stored on the CPU's int8 path
/// (docs/benchmarks/2026-12-04-drafter-round8-h200.md); 295 of 354 (83.3 %) for the round-9
/// drafter, τ 2.823 against 2.848 as stored (0.9 %;
/// docs/benchmarks/2026-12-04-drafter-round9-h200.md); 316 of 351 (90.0 %) for the drafter
/// fine-tuned with short blocks (docs/benchmarks/2026-12-05-cpu-short-blocks.md). Each
/// fine-tune at a low learning rate may sharpen near-ties the 4-bit rounding then flips, at
/// under 1 % of τ. A broken re-encoding or kernel falls far below.
const Q4_1_MIN_AGREEMENT_PCT: usize = 80;

#[test]
fn shipped_drafter_with_q4_1_weights_drafts_nearly_the_same() {
    let (agree, compared) = agreement(Some(DType::Q4_1));
    println!("Q4_1 drafter weights: {agree} of {compared} slots as PyTorch");
    assert!(
        agree * 100 >= compared * Q4_1_MIN_AGREEMENT_PCT,
        "Q4_1 drafter weights: only {agree} of {compared} slots as PyTorch"
    );
}
