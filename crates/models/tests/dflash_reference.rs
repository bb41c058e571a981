//! The DFlash drafter against the published reference (`DFlashDraftModel` of z-lab/dflash) on a
//! tiny random drafter: two drafting rounds with the context cache carried between them
//! (fixture made by tools/make_drafter_fixture.py).

use std::path::Path;
use std::sync::Arc;

use dflash_models::{DflashDrafter, Drafter};
use dflash_runtime::cpu::{CpuBackend, CpuWeight, KvType};
use dflash_runtime::{Backend, HostWeight};

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

#[test]
fn drafter_matches_the_reference_over_two_rounds() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dflash_ref_tiny");
    // The reference keeps its KV cache in f32; so does the drafter here (the f16 cache has
    // its own bound, golden_smollm2.rs).
    let backend = Arc::new(CpuBackend::new(2).with_kv_type(KvType::F32));
    let mut drafter = DflashDrafter::open(backend.clone(), &dir).unwrap();
    assert_eq!(drafter.block_size(), 8);
    assert_eq!(drafter.tap_layers(), &[1, 3]);
    let io_bytes = std::fs::read(dir.join("io.safetensors")).unwrap();
    let io = safetensors::SafeTensors::deserialize(&io_bytes).unwrap();
    let (es, e) = tensor(&io, "embed_tokens");
    let (ls, l) = tensor(&io, "lm_head");
    let embed = CpuWeight::f32(HostWeight::from_f32("embed", es[0], es[1], &e));
    let lm_head = CpuWeight::f32(HostWeight::from_f32("lm_head", ls[0], ls[1], &l));
    let row = drafter.new_row(64).unwrap();
    let mut worst = 0f32;
    for round in ["round1", "round2"] {
        let (hs, hidden) = tensor(&io, &format!("{round}_target_hidden"));
        let taps = backend.upload(&hidden, hs[0], hs[1]);
        let start = drafter.context_len(row);
        assert_eq!(
            start as i64,
            int(&io, &format!("{round}_cache_len_before"))[0]
        );
        let tap_rows: Vec<u32> = (0..hs[0] as u32).collect();
        drafter.extend(&[(row, hs[0])], &taps, &tap_rows).unwrap();
        let block_pos = int(&io, &format!("{round}_block_positions"));
        assert_eq!(
            drafter.context_len(row) as i64,
            block_pos[0],
            "block starts after context"
        );
        let ids = int(&io, &format!("{round}_block_ids"));
        drafter
            .draft(&[(row, ids[0] as u32)], 8, &embed, &lm_head)
            .unwrap();
        let got = backend.to_host(drafter.logits());
        let (shape, want) = tensor(&io, &format!("{round}_logits"));
        assert_eq!(shape, vec![7, 512]);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            worst = worst.max((g - w).abs());
            assert!(
                (g - w).abs() < 1e-4 + 1e-4 * w.abs(),
                "{round} logit {i}: {g} vs {w}"
            );
        }
        let drafts: Vec<i64> = got
            .chunks_exact(512)
            .map(|r| dflash_runtime::cpu::ops::elementwise::argmax(r) as i64)
            .collect();
        assert_eq!(
            drafts,
            int(&io, &format!("{round}_draft_ids")),
            "{round} drafts"
        );
    }
    eprintln!("largest logit difference from the reference: {worst:.2e}");
}
