//! Deferred context (`Drafter::extend_deferred`): a drafter that keeps the features of plain
//! rounds and writes their keys and values when it next drafts drafts exactly as one that
//! wrote them at once — bit for bit, for DFlash and DFlash2 drafters, with rows released and
//! their slots reused while tokens wait, and past the most tokens it holds at once.

use std::sync::Arc;

use dflash_models::synthetic::{
    dflash2_config_for, drafter_config_for, random_drafter, special_id,
};
use dflash_models::{DflashDrafter, Drafter};
use dflash_runtime::cpu::{CpuBackend, CpuTensor, CpuWeight};
use dflash_runtime::{Backend, HostWeight};
use rand::{Rng, SeedableRng};

const HIDDEN: usize = 64;
const VOCAB: usize = 300;
const BLOCK: usize = 4;

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `n` feature rows of a target with `taps` tapped layers.
fn features(b: &CpuBackend, n: usize, taps: usize, seed: u64) -> CpuTensor {
    b.upload(&random(n * taps * HIDDEN, seed), n, taps * HIDDEN)
}

/// The same script of context extensions and drafts, eager or deferred: the draft logits of
/// every draft, as bits.
fn run(deferred: bool, dflash2: bool) -> Vec<Vec<u32>> {
    let b = Arc::new(CpuBackend::new(1));
    let mut cfg = drafter_config_for(HIDDEN, 4, 2, 128, 4, 2, BLOCK, special_id("<|mask|>"));
    if dflash2 {
        cfg = dflash2_config_for(cfg, VOCAB, 3);
    }
    let taps = cfg.target_layer_ids.len();
    let mut d = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap();
    let embed = CpuWeight::f32(HostWeight::from_f32(
        "embed",
        VOCAB,
        HIDDEN,
        &random(VOCAB * HIDDEN, 1),
    ));
    let head = CpuWeight::f32(HostWeight::from_f32(
        "head",
        VOCAB,
        HIDDEN,
        &random(VOCAB * HIDDEN, 2),
    ));
    let extend = |d: &mut DflashDrafter<CpuBackend>, rows: &[(usize, usize)], seed: u64| {
        let n: usize = rows.iter().map(|r| r.1).sum();
        let f = features(&b, n + 3, taps, seed);
        // Feature rows out of order and not from the start: the rows are picked, not sliced.
        let picked: Vec<u32> = (0..n as u32).rev().map(|i| i + 3).collect();
        if deferred {
            d.extend_deferred(rows, &f, &picked).unwrap();
        } else {
            d.extend(rows, &f, &picked).unwrap();
        }
    };
    let mut out = Vec::new();
    let mut draft = |d: &mut DflashDrafter<CpuBackend>, rows: &[(usize, u32)]| {
        d.draft(rows, BLOCK, &embed, &head).unwrap();
        let mut host = Vec::new();
        b.copy_to_host(d.logits(), &mut host);
        out.push(host.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
    };

    let (r0, r1) = (d.new_row(64).unwrap(), d.new_row(64).unwrap());
    // Prompts (written at once, as the engine does), then plain rounds.
    d.extend(
        &[(r0, 7), (r1, 5)],
        &features(&b, 12, taps, 10),
        &(0..12).collect::<Vec<u32>>(),
    )
    .unwrap();
    for round in 0..5 {
        extend(&mut d, &[(r0, 1), (r1, 1)], 20 + round);
    }
    // A third row joins, waits, and leaves before any draft; its slot is reused at once.
    let r2 = d.new_row(64).unwrap();
    extend(&mut d, &[(r2, 6), (r0, 1)], 30);
    d.release_row(r2);
    let r3 = d.new_row(64).unwrap();
    assert_eq!(r3, r2, "the slot is reused");
    // Its prompt is written at once: the old row's waiting tokens must not land on it later.
    d.extend(&[(r3, 4)], &features(&b, 4, taps, 31), &[0, 1, 2, 3])
        .unwrap();
    extend(&mut d, &[(r1, 1)], 32);
    for r in [r0, r1, r3] {
        let want = [7 + 6, 5 + 6, 4][[r0, r1, r3].iter().position(|&x| x == r).unwrap()];
        assert_eq!(
            d.context_len(r),
            want,
            "context lengths count waiting tokens"
        );
    }
    draft(&mut d, &[(r0, 11), (r1, 12), (r3, 13)]);
    // Drafting wrote everything: more plain rounds, then a draft of one row.
    for round in 0..3 {
        extend(&mut d, &[(r0, 2), (r3, 1)], 40 + round);
    }
    draft(&mut d, &[(r3, 14)]);
    // More waiting tokens than the drafter holds at once (1,024): written in passes.
    for round in 0..9 {
        extend(&mut d, &[(r1, 120)], 50 + round);
    }
    draft(&mut d, &[(r1, 15), (r0, 16)]);
    out
}

#[test]
fn deferred_context_drafts_as_context_written_at_once() {
    for dflash2 in [false, true] {
        let eager = run(false, dflash2);
        let deferred = run(true, dflash2);
        assert_eq!(eager.len(), 3);
        for (i, (a, b)) in eager.iter().zip(&deferred).enumerate() {
            assert!(!a.is_empty());
            assert_eq!(a, b, "draft {i} differs (DFlash2: {dflash2})");
        }
    }
}
