//! A target whose cache layout cannot commit a different accept count per row makes the
//! DFlash decoder fall back to the clamp on its own, even when per-row was asked for: the
//! batch then commits every round's minimum and still writes exactly the B=1 greedy output.

mod common;

use common::{ar_reference, request, sharp_tiny_path, Oracle};
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::SamplingParams;
use dflash_models::TargetModel;
use dflash_models::{load_model, RowStep, Target};
use dflash_runtime::cpu::CpuWeight;
use dflash_runtime::cpu::{CpuBackend, CpuTensor};
use std::sync::Arc;

/// A model that reports a rectangular (shared) cache layout; everything else is delegated.
struct RectangularCache(TargetModel<CpuBackend>);

impl Target for RectangularCache {
    type B = CpuBackend;

    fn backend(&self) -> &CpuBackend {
        self.0.backend()
    }
    fn vocab(&self) -> usize {
        self.0.vocab()
    }
    fn hidden(&self) -> usize {
        self.0.hidden()
    }
    fn n_layers(&self) -> usize {
        self.0.n_layers()
    }
    fn context_length(&self) -> usize {
        self.0.context_length()
    }
    fn new_row(&mut self, capacity: usize) -> dflash_models::Result<usize> {
        self.0.new_row(capacity)
    }
    fn release_row(&mut self, row: usize) {
        self.0.release_row(row)
    }
    fn kv_usage(&self) -> dflash_models::KvUsage {
        self.0.kv_usage()
    }
    fn prefill_granule(&self) -> usize {
        self.0.prefill_granule()
    }
    fn row_len(&self, row: usize) -> usize {
        self.0.row_len(row)
    }
    fn truncate_row(&mut self, row: usize, len: usize) -> dflash_models::Result<()> {
        self.0.truncate_row(row, len)
    }
    fn fork_row(&mut self, src: usize, capacity: usize) -> dflash_models::Result<usize> {
        self.0.fork_row(src, capacity)
    }
    fn set_tap_layers(&mut self, layers: &[usize]) -> dflash_models::Result<()> {
        self.0.set_tap_layers(layers)
    }
    fn forward(&mut self, steps: &[RowStep<'_>]) -> dflash_models::Result<()> {
        self.0.forward(steps)
    }
    fn logits(&self) -> &CpuTensor {
        self.0.logits()
    }
    fn taps(&self) -> &CpuTensor {
        self.0.taps()
    }
    fn embedding(&self) -> &CpuWeight {
        self.0.embedding()
    }
    fn lm_head(&self) -> &CpuWeight {
        self.0.lm_head()
    }
    fn lm_head_rows(&self, ids: &[u32]) -> dflash_models::Result<CpuWeight> {
        self.0.lm_head_rows(ids)
    }
    fn per_row_commit(&self) -> bool {
        false
    }
}

#[test]
fn a_layout_without_per_row_commits_falls_back_to_the_clamp() {
    let b = Arc::new(CpuBackend::new(1));
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    let tok = m.tokenizer;
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 17], vec![40, 2, 77, 3, 8], vec![100, 101]];
    let (refs, target) = ar_reference(m.model, &tok, &prompts, 24 + 6);

    let block = 6;
    let mut oracle = Oracle::new(block, target.vocab(), vec![1, 2]);
    oracle.stop_ids = tok.stop_ids.clone();
    for (p, r) in prompts.iter().zip(&refs) {
        oracle.expect(p, r);
    }
    let mut dec = DflashDecoder::new(
        RectangularCache(target),
        oracle,
        block,
        AcceptPolicy::PerRow,
    )
    .unwrap();
    assert_eq!(dec.policy(), AcceptPolicy::Clamp, "the decoder fell back");

    let requests: Vec<_> = prompts
        .iter()
        .map(|p| request(p.clone(), 24, SamplingParams::greedy()))
        .collect();
    let got = run_scheduled(&mut dec, &tok, &requests, 3, &mut |_, _| {}).unwrap();
    for (i, (c, r)) in got.iter().zip(&refs).enumerate() {
        let want: Vec<u32> = r.tokens.iter().take(24).copied().collect();
        assert_eq!(c.tokens, want, "row {i} equals its B=1 output");
    }
    let oracle = &dec.drafter;
    assert!(
        oracle.rounds_with_different_accepts() > 0,
        "rows disagreed in some round, so the clamp mattered"
    );
    let totals = oracle.expected_totals(true);
    for (row, c) in got.iter().enumerate() {
        if let Some(&want) = totals.get(&row) {
            assert_eq!(
                c.stats.accepted, want,
                "row {row} committed the round minima"
            );
        }
    }
    assert!(
        !totals.is_empty(),
        "some row's accepts were exactly predictable"
    );
}
