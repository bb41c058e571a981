//! Drafting over a vocabulary shortlist: the drafter's logits cover only the K target ids of
//! its shortlist (column c is target id `ids[c]`). A row drafts from the distribution over
//! those K tokens (the sampling parameters applied there, the repetition penalties from the
//! history's listed ids), so q is that distribution and 0 for every other id; drafts and q are
//! mapped back to target ids before verification, which is unchanged. The rejection test
//! `u * q(d) < p(d)` and the residual `max(p - q, 0)` stay exact with such a q, and greedy
//! verification never reads q, so greedy output is still the target's own.

use crate::dflash::propose;
use crate::sampling::{Dist, SamplingParams};

/// Marks a target id outside the shortlist in [`VocabMap`]'s inverse table.
const UNLISTED: u32 = u32::MAX;

/// A shortlist's columns and their inverse.
#[derive(Debug)]
pub struct VocabMap {
    ids: Vec<u32>,
    /// Column of each target id, or [`UNLISTED`].
    column: Vec<u32>,
}

impl VocabMap {
    /// The map of shortlist `ids` (distinct target ids below `vocab`), or why not.
    pub fn new(ids: &[u32], vocab: usize) -> Result<Self, String> {
        let mut column = vec![UNLISTED; vocab];
        for (c, &id) in ids.iter().enumerate() {
            let slot = column.get_mut(id as usize).ok_or_else(|| {
                format!("the drafter's shortlist lists token {id}; the target has {vocab}")
            })?;
            if *slot != UNLISTED {
                return Err(format!("the drafter's shortlist lists token {id} twice"));
            }
            *slot = c as u32;
        }
        if ids.is_empty() {
            return Err("the drafter's shortlist is empty".into());
        }
        Ok(Self {
            ids: ids.to_vec(),
            column,
        })
    }

    /// Columns of the drafter's logits.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The target id of column `c`.
    pub fn target_id(&self, c: u32) -> u32 {
        self.ids[c as usize]
    }

    /// The listed ids of `history`, as columns (in order, repeats kept).
    fn columns_of(&self, history: &[u32]) -> Vec<u32> {
        history
            .iter()
            .filter_map(|&id| self.column.get(id as usize).copied())
            .filter(|&c| c != UNLISTED)
            .collect()
    }

    /// `d` over columns, as a distribution over target ids (same order and probabilities).
    fn to_target(&self, d: Dist) -> Dist {
        Dist {
            items: d
                .items
                .into_iter()
                .map(|(c, p)| (self.target_id(c), p))
                .collect(),
        }
    }
}

/// [`propose`] for a drafter whose logits (`u.len()` slots of `map.len()` values) cover the
/// shortlist `map`: drafts and their distributions in target ids.
pub fn propose_listed(
    map: &VocabMap,
    params: &SamplingParams,
    history: &[u32],
    logits: &[f32],
    u: &[f32],
    scratch: &mut Vec<f32>,
) -> (Vec<u32>, Vec<Dist>) {
    let history = map.columns_of(history);
    let (drafts, qs) = propose(params, &history, logits, map.len(), u, scratch);
    (
        drafts.into_iter().map(|c| map.target_id(c)).collect(),
        qs.into_iter().map(|q| map.to_target(q)).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, repetition_penalty: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            repetition_penalty,
            ..SamplingParams::default()
        }
    }

    #[test]
    fn a_shortlist_draft_is_the_full_vocabulary_draft_with_unlisted_tokens_impossible() {
        // Target vocabulary of 8; the shortlist lists 4 of them in rank order.
        let ids = [5u32, 1, 6, 2];
        let map = VocabMap::new(&ids, 8).unwrap();
        let full: Vec<f32> = vec![0.3, 2.0, -1.0, 9.0, 0.1, 1.5, 0.7, 4.0];
        let listed: Vec<f32> = ids.iter().map(|&id| full[id as usize]).collect();
        // The same logits over the whole vocabulary with every unlisted token at -inf.
        let masked: Vec<f32> = (0..8)
            .map(|i| {
                if ids.contains(&(i as u32)) {
                    full[i]
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let history = [1u32, 3, 6, 1];
        let mut scratch = Vec::new();
        for p in [params(0.0, 1.0), params(1.0, 1.0), params(0.7, 1.3)] {
            for u in [0.0f32, 0.3, 0.77, 0.999] {
                let (d, q) = propose_listed(&map, &p, &history, &listed, &[u], &mut scratch);
                let (dm, qm) = propose(&p, &history, &masked, 8, &[u], &mut scratch);
                if p.is_greedy() {
                    assert_eq!(d, dm, "{p:?}");
                }
                // Sampled: the draft is q's token at u (q lists the tokens in column order).
                assert_eq!(q[0].pick(u), d[0], "{p:?} u {u}");
                for id in 0..8u32 {
                    let (a, b) = (q[0].prob(id), qm[0].prob(id));
                    assert!((a - b).abs() < 1e-6, "{p:?} id {id}: {a} vs {b}");
                }
                assert!(ids.contains(&d[0]));
                assert_eq!(q[0].prob(3), 0.0, "token 3 is not listed");
            }
        }
        // Greedy: the listed argmax (token 3 has the largest logit but is not listed).
        let (d, _) = propose_listed(&map, &params(0.0, 1.0), &[], &listed, &[0.0], &mut scratch);
        assert_eq!(d, vec![1]);
    }

    #[test]
    fn bad_shortlists_are_refused() {
        assert!(VocabMap::new(&[], 4).is_err());
        assert!(VocabMap::new(&[1, 1], 4).unwrap_err().contains("twice"));
        assert!(VocabMap::new(&[4], 4).unwrap_err().contains("has 4"));
    }
}
