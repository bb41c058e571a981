//! Proposals from a DFlash2 candidate lattice.
//!
//! Slot by slot, each row's walk scores the slot's candidates given the candidate it chose at
//! the slot before (the anchor for the first slot). Greedy rows take the first best score (q is
//! then a point mass); sampled rows draw from `q = softmax(score / T)` over the slot's top-k
//! candidates, as the reference `CandidateSelector.select` does, picking with the round's
//! draft uniform of the slot (`Dist::pick`, candidates in lattice order), so a DFlash2 row
//! consumes its uniforms exactly as a DFlash row does. That q is sparse: every token outside
//! the candidates has q = 0, which the rejection sampler (`dflash::residual`) honours, so the
//! output still follows the target's distribution.

use dflash_models::selector::first_max;
use dflash_models::CandidateLattice;

use crate::sampling::{Dist, SamplingParams};

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

/// Walks row `row` of `lattice` with one uniform per slot (`u`, unread when greedy): the
/// drafts and, per draft, the distribution it was drawn from.
pub(crate) fn walk(
    lattice: &CandidateLattice,
    row: usize,
    params: &SamplingParams,
    u: &[f32],
) -> (Vec<u32>, Vec<Dist>) {
    let n = lattice.slots();
    assert_eq!(u.len(), n, "one uniform per lattice slot");
    let mut drafts = Vec::with_capacity(n);
    let mut qs = Vec::with_capacity(n);
    let mut prev = 0;
    for (slot, &u) in u.iter().enumerate() {
        let candidates = lattice.candidates(row, slot);
        let scores = lattice.scores(row, slot, prev);
        let (index, q) = if params.is_greedy() {
            let i = first_max(scores);
            (i, Dist::point(candidates[i]))
        } else {
            let q = selector_dist(candidates, scores, params.temperature);
            let d = q.pick(u);
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

    fn lattice() -> CandidateLattice {
        // Two slots of two candidates; slot 1 prefers 21 after 11 and 20 after 10.
        let mut l = CandidateLattice::new(2, 2);
        l.push_row(&[10, 11, 20, 21], &[0.0, 0.5, 0.0, 0.0, 3.0, 0.0, 0.0, 3.0]);
        l
    }

    #[test]
    fn greedy_walk_follows_its_own_choices() {
        let (drafts, qs) = walk(&lattice(), 0, &SamplingParams::greedy(), &[0.0; 2]);
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
        let l = lattice();
        // Slot 0: q = (0.438, 0.562) over (10, 11), so u = 0.3 picks 10; slot 1 after 10:
        // q = (0.818, 0.182) over (20, 21), so u = 0.9 picks 21.
        let (drafts, qs) = walk(&l, 0, &params, &[0.3, 0.9]);
        assert_eq!(drafts, vec![10, 21]);
        let e = (-0.25f32).exp();
        assert!((qs[0].prob(11) - 1.0 / (1.0 + e)).abs() < 1e-6);
        assert_eq!(qs[0].prob(99), 0.0);
        // Slot 1's q is the softmax after the candidate slot 0 drew.
        let e3 = (-1.5f32).exp();
        assert!((qs[1].prob(20) - 1.0 / (1.0 + e3)).abs() < 1e-6);
        let total: f32 = qs[1].items.iter().map(|x| x.1).sum();
        assert!((total - 1.0).abs() < 1e-6);
        // The same uniforms give the same walk; u = 0.5 at slot 0 picks 11, then 21 at 0.5.
        assert_eq!(walk(&l, 0, &params, &[0.3, 0.9]).0, drafts);
        assert_eq!(walk(&l, 0, &params, &[0.5, 0.5]).0, vec![11, 21]);
    }
}
