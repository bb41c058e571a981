//! Proposals from a DFlash2 candidate lattice.
//!
//! Slot by slot, each row's walk scores the slot's candidates given the candidate it chose at
//! the slot before (the anchor for the first slot). Greedy rows take the first best score (q is
//! then a point mass); sampled rows draw from `q = softmax(score / T)` over the slot's top-k
//! candidates, as the reference `CandidateSelector.select` does. That q is sparse: every token
//! outside the candidates has q = 0, which the rejection sampler (`dflash::residual`) honours,
//! so the output still follows the target's distribution.

use dflash_models::selector::first_max;
use dflash_models::CandidateLattice;

use crate::ar::RowSampling;
use crate::sampling::Dist;

/// `softmax(scores / temperature)` over `candidates` (in candidate order).
pub fn selector_dist(candidates: &[u32], scores: &[f32], temperature: f32) -> Dist {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let inv_t = 1.0 / temperature;
    let mut items: Vec<(u32, f32)> = candidates
        .iter()
        .zip(scores)
        .map(|(&id, &s)| (id, ((s - max) * inv_t).exp()))
        .collect();
    let total: f32 = items.iter().map(|x| x.1).sum();
    if !(total > 0.0 && total.is_finite()) {
        // Degenerate scores (NaN): the first best candidate.
        return Dist::point(candidates[first_max(scores)]);
    }
    for it in &mut items {
        it.1 /= total;
    }
    Dist { items }
}

/// Walks row `row` of `lattice`: the drafts and, per draft, the distribution it was drawn from.
pub(crate) fn walk(
    lattice: &CandidateLattice,
    row: usize,
    sampling: &mut RowSampling,
) -> (Vec<u32>, Vec<Dist>) {
    let n = lattice.slots();
    let mut drafts = Vec::with_capacity(n);
    let mut qs = Vec::with_capacity(n);
    let mut prev = 0;
    for slot in 0..n {
        let candidates = lattice.candidates(row, slot);
        let scores = lattice.scores(row, slot, prev);
        let (index, q) = if sampling.params.is_greedy() {
            let i = first_max(scores);
            (i, Dist::point(candidates[i]))
        } else {
            let q = selector_dist(candidates, scores, sampling.params.temperature);
            let d = sampling.sampler.sample(&q);
            let i = candidates
                .iter()
                .position(|&c| c == d)
                .expect("a draw from the candidates");
            (i, q)
        };
        prev = index;
        drafts.push(candidates[index]);
        qs.push(q);
    }
    (drafts, qs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SamplingParams;

    fn lattice() -> CandidateLattice {
        // Two slots of two candidates; slot 1 prefers 21 after 11 and 20 after 10.
        let mut l = CandidateLattice::new(2, 2);
        l.push_row(&[10, 11, 20, 21], &[0.0, 0.5, 0.0, 0.0, 3.0, 0.0, 0.0, 3.0]);
        l
    }

    #[test]
    fn greedy_walk_follows_its_own_choices() {
        let mut s = RowSampling::new(&SamplingParams::greedy(), &[1]);
        let (drafts, qs) = walk(&lattice(), 0, &mut s);
        assert_eq!(drafts, vec![11, 21]);
        assert_eq!(qs[1], Dist::point(21));
    }

    #[test]
    fn sampled_walk_reports_the_conditional_softmax() {
        let params = SamplingParams {
            temperature: 2.0,
            seed: 3,
            ..SamplingParams::default()
        };
        let mut s = RowSampling::new(&params, &[1]);
        let l = lattice();
        let (drafts, qs) = walk(&l, 0, &mut s);
        let e = (-0.25f32).exp();
        assert!((qs[0].prob(11) - 1.0 / (1.0 + e)).abs() < 1e-6);
        assert_eq!(qs[0].prob(99), 0.0);
        // Slot 1's q is the softmax after whichever candidate slot 0 drew.
        let after = if drafts[0] == 10 { 20 } else { 21 };
        let e3 = (-1.5f32).exp();
        assert!((qs[1].prob(after) - 1.0 / (1.0 + e3)).abs() < 1e-6);
        let total: f32 = qs[1].items.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
