//! The DFlash2 drafter against the published reference (`DFlash2DraftModel` of z-lab/dflash)
//! on a tiny random drafter with 3-tap convolutions, a sliding non-causal layer (window 6) and a
//! full layer, an output multiplier, a soft cap and an embedding scale: two drafting rounds with
//! the context cache carried between them (fixture made by tools/make_drafter2_fixture.py).
//!
//! Compared: the raw logits of slots 1..7, the candidate set and every lattice score the walk
//! can ask for, the greedy path, and the selector's q along the reference's sampled path.
//! Tolerance: |Δ| ≤ 1e-4 + 1e-4·|x| for logits and scores (f32 on both sides, different
//! summation orders; the values are below 40), 1e-4 for probabilities.

use std::path::Path;
use std::sync::Arc;

use dflash_models::dflash::DrafterKind;
use dflash_models::{DflashDrafter, Drafter};
use dflash_runtime::cpu::{CpuBackend, CpuWeight, KvType};
use dflash_runtime::{Backend, HostWeight};

const TEMPERATURE: f32 = 0.7;

fn tensor(st: &safetensors::SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (t.shape().to_vec(), v)
}

fn int(st: &safetensors::SafeTensors<'_>, name: &str) -> Vec<i64> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn close(got: f32, want: f32) -> bool {
    (got - want).abs() <= 1e-4 + 1e-4 * want.abs()
}

#[test]
fn dflash2_drafter_matches_the_reference_over_two_rounds() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash2_ref_tiny");
    // The reference keeps its KV cache in f32; so does the drafter here (the f16 cache has
    // its own bound, golden_smollm2.rs).
    let backend = Arc::new(CpuBackend::new(2).with_kv_type(KvType::F32));
    let mut drafter = DflashDrafter::open(backend.clone(), &dir).unwrap();
    assert_eq!(drafter.cfg.kind(), DrafterKind::Dflash2);
    assert_eq!(drafter.block_size(), 8);
    assert_eq!(drafter.tap_layers(), &[1, 3]);
    let io_bytes = std::fs::read(dir.join("io.safetensors")).unwrap();
    let io = safetensors::SafeTensors::deserialize(&io_bytes).unwrap();
    let (es, e) = tensor(&io, "embed_tokens");
    let (ls, l) = tensor(&io, "lm_head");
    let embed = CpuWeight::f32(HostWeight::from_f32("embed", es[0], es[1], &e));
    let lm_head = CpuWeight::f32(HostWeight::from_f32("lm_head", ls[0], ls[1], &l));
    let vocab = ls[0];
    let row = drafter.new_row(64).unwrap();
    let (mut worst_logit, mut worst_score, mut worst_q) = (0f32, 0f32, 0f32);
    for round in ["round1", "round2"] {
        let name = |s: &str| format!("{round}_{s}");
        let (hs, hidden) = tensor(&io, &name("target_hidden"));
        let taps = backend.upload(&hidden, hs[0], hs[1]);
        assert_eq!(
            drafter.context_len(row) as i64,
            int(&io, &name("cache_len_before"))[0]
        );
        let tap_rows: Vec<u32> = (0..hs[0] as u32).collect();
        drafter.extend(&[(row, hs[0])], &taps, &tap_rows).unwrap();
        assert_eq!(
            drafter.context_len(row) as i64,
            int(&io, &name("block_positions"))[0]
        );
        let ids = int(&io, &name("block_ids"));
        drafter
            .draft(&[(row, ids[0] as u32)], 8, &embed, &lm_head)
            .unwrap();

        // Raw logits of slots 1..7.
        let got = backend.to_host(drafter.logits());
        let (shape, want) = tensor(&io, &name("raw_logits"));
        assert_eq!(shape, vec![7, vocab]);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            worst_logit = worst_logit.max((g - w).abs());
            assert!(close(*g, *w), "{round} logit {i}: {g} vs {w}");
        }

        // The lattice: same candidates; every score, matched by candidate id.
        let lat = drafter
            .lattice()
            .expect("a DFlash2 drafter leaves a lattice");
        let (k, slots) = (lat.top_k(), lat.slots());
        assert_eq!((k, slots, lat.rows()), (6, 7, 1));
        let ref_cand = int(&io, &name("candidates"));
        let (_, ref_scores) = tensor(&io, &name("scores"));
        let ref_index = |slot: usize, id: u32| {
            ref_cand[slot * k..(slot + 1) * k]
                .iter()
                .position(|&c| c as u32 == id)
                .unwrap_or_else(|| {
                    panic!("{round} slot {slot}: candidate {id} not in the reference's")
                })
        };
        for slot in 0..slots {
            let cands = lat.candidates(0, slot);
            // Ours are sorted by score; the reference's top-k is unsorted.
            let (_, logits) = tensor(&io, &name("logits"));
            let row_logits = &logits[slot * vocab..(slot + 1) * vocab];
            for w in cands.windows(2) {
                assert!(row_logits[w[0] as usize] >= row_logits[w[1] as usize]);
            }
            let n_prev = if slot == 0 { 1 } else { k };
            for prev in 0..n_prev {
                let ref_prev = if slot == 0 {
                    0
                } else {
                    ref_index(slot - 1, lat.candidates(0, slot - 1)[prev])
                };
                for (ci, &c) in cands.iter().enumerate() {
                    let j = ref_index(slot, c);
                    let want = ref_scores[(slot * k + ref_prev) * k + j];
                    let got = lat.scores(0, slot, prev)[ci];
                    worst_score = worst_score.max((got - want).abs());
                    assert!(
                        close(got, want),
                        "{round} slot {slot} prev {prev} cand {c}: {got} vs {want}"
                    );
                }
            }
        }

        // Greedy walk.
        let want_greedy: Vec<u32> = int(&io, &name("greedy_path"))
            .iter()
            .map(|&x| x as u32)
            .collect();
        assert_eq!(lat.greedy_path(0), want_greedy, "{round} greedy path");

        // q = softmax(score / T) over the candidates along the reference's sampled path.
        let path = int(&io, &name("sampled_path"));
        let (_, ref_q) = tensor(&io, &name("sampled_q"));
        let mut prev = 0;
        for slot in 0..slots {
            let cands = lat.candidates(0, slot);
            let scores = lat.scores(0, slot, prev);
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores
                .iter()
                .map(|s| ((s - max) / TEMPERATURE).exp())
                .collect();
            let total: f32 = e.iter().sum();
            for (ci, &c) in cands.iter().enumerate() {
                let want = ref_q[slot * k + ref_index(slot, c)];
                worst_q = worst_q.max((e[ci] / total - want).abs());
                assert!(
                    (e[ci] / total - want).abs() < 1e-4,
                    "{round} slot {slot} q({c})"
                );
            }
            prev = cands
                .iter()
                .position(|&c| c as i64 == path[slot])
                .expect("the sampled token is a candidate");
        }
    }
    eprintln!(
        "largest differences from the reference: logits {worst_logit:.2e}, scores \
         {worst_score:.2e}, q {worst_q:.2e}"
    );
}
