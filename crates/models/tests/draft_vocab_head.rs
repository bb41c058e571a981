//! A drafter over a vocabulary shortlist: its head is the listed rows of the target's head in
//! their stored format (Q8_0, Q4_1 and f32 targets), multiplied by the same kernels, so its
//! logits are the full head's logits at the listed ids, bit for bit; a DFlash2 drafter refuses
//! a shortlist, and rows past the head are an error.

use std::sync::Arc;

use dflash_models::synthetic::{
    dflash2_config_for, drafter_config_for, random_drafter, special_id, write_synthetic,
    SyntheticSpec,
};
use dflash_models::{load_model, DflashDrafter, Drafter, LogitRows, RowStep, Target, TargetModel};
use dflash_runtime::cpu::CpuBackend;
use dflash_runtime::{Backend, DType};

const BLOCK: usize = 4;

#[test]
fn shortlist_logits_are_the_full_logits_at_the_listed_ids() {
    for dtype in [DType::Q8_0, DType::Q4_1, DType::F32] {
        let b = Arc::new(CpuBackend::new(1));
        let spec = SyntheticSpec {
            dtype,
            ..SyntheticSpec::tiny()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_synthetic(&spec, &path).unwrap();
        let mut target = load_model(b.clone(), &path).unwrap().model;
        let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, special_id("<|mask|>"));
        let mut drafter =
            DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 3)).unwrap();
        target.set_tap_layers(drafter.tap_layers()).unwrap();

        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 200).collect();
        let row = target.new_row(64).unwrap();
        target
            .forward(&[RowStep {
                row,
                tokens: &prompt,
                logits: LogitRows::Last,
                prompt: true,
                argmax_only: false,
            }])
            .unwrap();
        let drow = drafter.new_row(64).unwrap();
        let taps: Vec<u32> = (0..prompt.len() as u32).collect();
        drafter
            .extend(&[(drow, prompt.len())], target.taps(), &taps)
            .unwrap();

        let draft = |d: &mut DflashDrafter<CpuBackend>, t: &TargetModel<CpuBackend>| {
            d.draft(&[(drow, 42)], BLOCK, t.embedding(), t.lm_head())
                .unwrap();
            let mut host = Vec::new();
            b.copy_to_host(d.logits(), &mut host);
            (b.shape(d.logits()), host)
        };
        let ((rows, vocab), full) = draft(&mut drafter, &target);
        assert_eq!((rows, vocab), (BLOCK - 1, target.vocab()));

        // Every third id, highest first: a column is not its id.
        let ids: Vec<u32> = (0..vocab as u32).rev().step_by(3).collect();
        drafter
            .set_vocab_shortlist(ids.clone(), target.lm_head_rows(&ids).unwrap())
            .unwrap();
        assert_eq!(drafter.vocab_map(), Some(ids.as_slice()));
        let ((rows, k), listed) = draft(&mut drafter, &target);
        assert_eq!((rows, k), (BLOCK - 1, ids.len()));
        for r in 0..rows {
            for (c, &id) in ids.iter().enumerate() {
                let (got, want) = (listed[r * k + c], full[r * vocab + id as usize]);
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{dtype:?} slot {r}, id {id}: {got} vs {want}"
                );
            }
        }

        let e = target
            .lm_head_rows(&[vocab as u32])
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("{vocab} rows")), "{e}");
    }
}

#[test]
fn a_dflash2_drafter_refuses_a_shortlist() {
    let b = Arc::new(CpuBackend::new(1));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_synthetic(&SyntheticSpec::tiny(), &path).unwrap();
    let target = load_model(b.clone(), &path).unwrap().model;
    let base = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, special_id("<|mask|>"));
    let cfg = dflash2_config_for(base, target.vocab(), 8);
    let mut drafter =
        DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap();
    let ids = vec![3, 1, 2];
    let e = drafter
        .set_vocab_shortlist(ids.clone(), target.lm_head_rows(&ids).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("DFlash2"), "{e}");
}
