//! DFlash speculative decoding over a batch of rows.
//!
//! One round: the drafter proposes `block - 1` tokens after each row's current token in one
//! forward pass; the target verifies every row's whole block in one forward pass; each row
//! keeps the longest prefix the target agrees with plus one token of the target's own (greedy:
//! exact match with the argmax; sampling: speculative rejection sampling, so the output
//! follows the target's distribution); then each row commits its own count — the target's
//! KV cache is cut back to the committed length and the drafter's context grows by the
//! committed tokens' features. Rows never wait for each other's accept counts unless the
//! clamp policy is chosen. A DFlash2 drafter's proposals come from walking its candidate
//! lattice (`selector_walk`), with the selector's sparse distribution as q.

use std::time::Instant;

use dflash_models::{Drafter, LogitRows, RowStep, Target};
use dflash_runtime::Backend;

use crate::ar::{RowSampling, PREFILL_CHUNK};
use crate::decoder::{Decoder, EngineError, Result, RowId};
use crate::sampling::{Dist, SamplingParams};
use crate::selector_walk::walk;
use crate::spec_gate::{SpecGate, SpecMode};
use crate::stats::RowStats;

/// How a batch commits accepted tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptPolicy {
    /// Every row commits its own accept count.
    PerRow,
    /// Every row commits the smallest accept count of the round (the rectangular fallback).
    Clamp,
}

impl AcceptPolicy {
    /// The policy from `DFLASH_PER_ROW_ACCEPTS` (`0` selects the clamp), else per-row.
    pub fn from_env() -> Self {
        match std::env::var("DFLASH_PER_ROW_ACCEPTS").as_deref() {
            Ok("0") => AcceptPolicy::Clamp,
            _ => AcceptPolicy::PerRow,
        }
    }
}

struct SpecRow {
    drow: usize,
    /// The last committed token: emitted, but not yet in the target's cache.
    cur: u32,
    sampling: RowSampling,
    stats: RowStats,
}

/// A row's outcome in one round.
struct Verdict {
    /// Accepted drafts.
    accepted: usize,
    /// The token after the accepted drafts (the target's own choice).
    bonus: u32,
}

/// DFlash decoding: a target and a drafter over the same backend.
pub struct DflashDecoder<T: Target, D: Drafter<B = T::B>> {
    pub target: T,
    pub drafter: D,
    block: usize,
    policy: AcceptPolicy,
    gate: SpecGate,
    rows: Vec<Option<SpecRow>>,
    target_logits: Vec<f32>,
    draft_logits: Vec<f32>,
    scratch: Vec<f32>,
}

impl<T: Target, D: Drafter<B = T::B>> DflashDecoder<T, D> {
    /// Pairs `target` with `drafter`, drafting blocks of `block` slots (at most the drafter's
    /// trained block size).
    pub fn new(mut target: T, drafter: D, block: usize, policy: AcceptPolicy) -> Result<Self> {
        if block < 2 || block > drafter.block_size() {
            return Err(EngineError::Invalid(format!(
                "block size {block} must be between 2 and the drafter's trained block of {}",
                drafter.block_size()
            )));
        }
        target.set_tap_layers(drafter.tap_layers())?;
        let policy = if policy == AcceptPolicy::PerRow && !target.per_row_commit() {
            tracing::warn!(
                "the target's cache layout cannot commit a different accept count per row; \
                 DFlash batches fall back to the clamp (every row commits the batch minimum)"
            );
            AcceptPolicy::Clamp
        } else {
            tracing::info!(
                block,
                ?policy,
                reason = match policy {
                    AcceptPolicy::PerRow => "per-row KV caches keep every row's prefix contiguous",
                    AcceptPolicy::Clamp =>
                        "clamp requested (--batch-accept clamp or DFLASH_PER_ROW_ACCEPTS=0)",
                },
                "DFlash batch accept policy"
            );
            policy
        };
        Ok(Self {
            target,
            drafter,
            block,
            policy,
            gate: SpecGate::new(SpecMode::Always),
            rows: Vec::new(),
            target_logits: Vec::new(),
            draft_logits: Vec::new(),
            scratch: Vec::new(),
        })
    }

    pub fn policy(&self) -> AcceptPolicy {
        self.policy
    }

    /// Whether every round drafts ([`SpecMode::Always`], the default) or greedy batches draft
    /// only while it is measured to pay ([`SpecMode::Auto`]).
    pub fn set_spec_mode(&mut self, mode: SpecMode) {
        tracing::info!(?mode, "DFlash speculation");
        self.gate = SpecGate::new(mode);
    }

    pub fn spec_mode(&self) -> SpecMode {
        self.gate.mode()
    }

    /// Proposes drafts for one row from its slot-1.. logits; returns tokens and their q.
    fn propose(
        sampling: &mut RowSampling,
        logits: &[f32],
        vocab: usize,
        n: usize,
        scratch: &mut Vec<f32>,
    ) -> (Vec<u32>, Vec<Dist>) {
        let mut drafts = Vec::with_capacity(n);
        let mut qs = Vec::with_capacity(n);
        let mut history = sampling.history.clone();
        for i in 0..n {
            let q = sampling.params.distribution(
                &logits[i * vocab..(i + 1) * vocab],
                &history,
                scratch,
            );
            let d = sampling.sampler.sample(&q);
            history.push(d);
            drafts.push(d);
            qs.push(q);
        }
        (drafts, qs)
    }

    /// Verifies one row's drafts against the target's logits for its block.
    fn judge(
        sampling: &mut RowSampling,
        block_logits: &[f32],
        vocab: usize,
        drafts: &[u32],
        qs: &[Dist],
        scratch: &mut Vec<f32>,
    ) -> Verdict {
        let params: &SamplingParams = &sampling.params;
        let mut history = sampling.history.clone();
        for (i, (&d, q)) in drafts.iter().zip(qs).enumerate() {
            let p =
                params.distribution(&block_logits[i * vocab..(i + 1) * vocab], &history, scratch);
            let accept = if params.is_greedy() {
                p.items[0].0 == d
            } else {
                let (pd, qd) = (p.prob(d), q.prob(d));
                sampling.sampler.uniform() * qd < pd
            };
            if !accept {
                let bonus = if params.is_greedy() {
                    p.items[0].0
                } else {
                    sampling.sampler.sample(&residual(&p, q))
                };
                return Verdict { accepted: i, bonus };
            }
            history.push(d);
        }
        let n = drafts.len();
        let p = params.distribution(&block_logits[n * vocab..(n + 1) * vocab], &history, scratch);
        Verdict {
            accepted: n,
            bonus: sampling.sampler.sample(&p),
        }
    }
}

/// `normalize(max(p - q, 0))`, or `p` when that is empty. `q` may be sparse (a DFlash2
/// selector's top-k candidates): every id it does not list has q = 0.
pub(crate) fn residual(p: &Dist, q: &Dist) -> Dist {
    // Both can cover the whole vocabulary at T > 0: look q up by id, not by search.
    let q_by_id = q.probs_by_id();
    let q_prob = |id: u32| q_by_id.get(id as usize).copied().unwrap_or(0.0);
    let mut items: Vec<(u32, f32)> = p
        .items
        .iter()
        .map(|&(id, pp)| (id, (pp - q_prob(id)).max(0.0)))
        .filter(|x| x.1 > 0.0)
        .collect();
    let mass: f32 = items.iter().map(|x| x.1).sum();
    if items.is_empty() || mass <= 0.0 {
        return p.clone();
    }
    for it in &mut items {
        it.1 /= mass;
    }
    Dist { items }
}

impl<T: Target, D: Drafter<B = T::B>> Decoder for DflashDecoder<T, D> {
    fn start_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<(RowId, u32)> {
        params.validate().map_err(|e| EngineError::Invalid(e.0))?;
        if prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        let t0 = Instant::now();
        let trow = self.target.new_row(capacity)?;
        let drow = match self.drafter.new_row(capacity) {
            Ok(r) => r,
            Err(e) => {
                self.target.release_row(trow);
                return Err(e.into());
            }
        };
        let prefill = (|| -> Result<()> {
            let chunks: Vec<&[u32]> = prompt.chunks(PREFILL_CHUNK).collect();
            for (i, chunk) in chunks.iter().enumerate() {
                let last = i + 1 == chunks.len();
                self.target.forward(&[RowStep {
                    row: trow,
                    tokens: chunk,
                    logits: if last {
                        LogitRows::Last
                    } else {
                        LogitRows::None
                    },
                }])?;
                let rows: Vec<u32> = (0..chunk.len() as u32).collect();
                self.drafter
                    .extend(&[(drow, chunk.len())], self.target.taps(), &rows)?;
            }
            Ok(())
        })();
        if let Err(e) = prefill {
            self.target.release_row(trow);
            self.drafter.release_row(drow);
            return Err(e);
        }
        self.target
            .backend()
            .copy_to_host(self.target.logits(), &mut self.target_logits);
        let mut sampling = RowSampling::new(params, prompt);
        let first = sampling.next(&self.target_logits, &mut self.scratch);
        if self.rows.len() <= trow {
            self.rows.resize_with(trow + 1, || None);
        }
        self.rows[trow] = Some(SpecRow {
            drow,
            cur: first,
            sampling,
            stats: RowStats {
                prompt_tokens: prompt.len(),
                generated_tokens: 1,
                prefill_s: t0.elapsed().as_secs_f64(),
                accepted_at: vec![0; self.block - 1],
                ..Default::default()
            },
        });
        Ok((trow, first))
    }

    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        let live: Vec<usize> = (0..self.rows.len())
            .filter(|&r| self.rows[r].is_some())
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        let vocab = self.target.vocab();
        let ctx = self.target.context_length();
        // Near the end of the context the block shrinks so verification stays inside it.
        let room = live
            .iter()
            .map(|&r| ctx.saturating_sub(self.target.row_len(r)))
            .min()
            .unwrap_or(0);
        let all_greedy = live.iter().all(|&r| {
            let row = self.rows[r].as_ref().expect("live");
            row.sampling.params.is_greedy()
        });
        let t_round = Instant::now();
        let block = if self.gate.speculate(all_greedy) {
            self.block.min(room)
        } else {
            room.min(1)
        };
        if block < 1 {
            return Err(EngineError::Invalid(
                "a row reached the end of the model's context".into(),
            ));
        }

        // Draft.
        let t_draft = Instant::now();
        let mut proposals: Vec<(Vec<u32>, Vec<Dist>)> = Vec::with_capacity(live.len());
        if block >= 2 {
            let firsts: Vec<(usize, u32)> = live
                .iter()
                .map(|&r| {
                    let row = self.rows[r].as_ref().expect("live");
                    (row.drow, row.cur)
                })
                .collect();
            self.drafter.draft(
                &firsts,
                block,
                self.target.embedding(),
                self.target.lm_head(),
            )?;
            if let Some(lattice) = self.drafter.lattice() {
                // DFlash2: walk each row's candidate lattice.
                for (i, &r) in live.iter().enumerate() {
                    let row = self.rows[r].as_mut().expect("live");
                    proposals.push(walk(lattice, i, &mut row.sampling));
                }
            } else {
                self.target
                    .backend()
                    .copy_to_host(self.drafter.logits(), &mut self.draft_logits);
                let per_row = (block - 1) * vocab;
                for (i, &r) in live.iter().enumerate() {
                    let row = self.rows[r].as_mut().expect("live");
                    let logits = &self.draft_logits[i * per_row..(i + 1) * per_row];
                    proposals.push(Self::propose(
                        &mut row.sampling,
                        logits,
                        vocab,
                        block - 1,
                        &mut self.scratch,
                    ));
                }
            }
        } else {
            proposals.resize_with(live.len(), || (Vec::new(), Vec::new()));
        }
        let draft_s = t_draft.elapsed().as_secs_f64();

        // Verify every row's block in one target forward.
        let t_verify = Instant::now();
        let blocks: Vec<Vec<u32>> = live
            .iter()
            .zip(&proposals)
            .map(|(&r, (drafts, _))| {
                let mut b = Vec::with_capacity(block);
                b.push(self.rows[r].as_ref().expect("live").cur);
                b.extend_from_slice(drafts);
                b
            })
            .collect();
        let steps: Vec<RowStep<'_>> = live
            .iter()
            .zip(&blocks)
            .map(|(&r, b)| RowStep {
                row: r,
                tokens: b,
                logits: LogitRows::All,
            })
            .collect();
        let starts: Vec<usize> = live.iter().map(|&r| self.target.row_len(r)).collect();
        self.target.forward(&steps)?;
        self.target
            .backend()
            .copy_to_host(self.target.logits(), &mut self.target_logits);
        let verify_s = t_verify.elapsed().as_secs_f64();

        // Accept and commit.
        let t_commit = Instant::now();
        let mut verdicts: Vec<Verdict> = Vec::with_capacity(live.len());
        for (i, &r) in live.iter().enumerate() {
            let row = self.rows[r].as_mut().expect("live");
            let logits = &self.target_logits[i * block * vocab..(i + 1) * block * vocab];
            let (drafts, qs) = &proposals[i];
            verdicts.push(Self::judge(
                &mut row.sampling,
                logits,
                vocab,
                drafts,
                qs,
                &mut self.scratch,
            ));
        }
        if self.policy == AcceptPolicy::Clamp {
            let floor = verdicts.iter().map(|v| v.accepted).min().unwrap_or(0);
            for (v, (drafts, _)) in verdicts.iter_mut().zip(&proposals) {
                if v.accepted > floor {
                    // The draft at the floor was accepted, so it is a valid next token.
                    v.bonus = drafts[floor];
                    v.accepted = floor;
                }
            }
        }
        let mut extend_rows = Vec::with_capacity(live.len());
        let mut tap_rows = Vec::new();
        for (i, &r) in live.iter().enumerate() {
            let v = &verdicts[i];
            let row = self.rows[r].as_mut().expect("live");
            let committed = v.accepted + 1;
            self.target.truncate_row(r, starts[i] + committed);
            extend_rows.push((row.drow, committed));
            tap_rows.extend((0..committed).map(|j| (i * block + j) as u32));
            let mut emitted = proposals[i].0[..v.accepted].to_vec();
            emitted.push(v.bonus);
            row.sampling.history.extend_from_slice(&emitted);
            row.cur = v.bonus;
            let st = &mut row.stats;
            if block >= 2 {
                st.rounds += 1;
                st.drafted += block - 1;
                st.accepted += v.accepted;
                for a in st.accepted_at.iter_mut().take(v.accepted) {
                    *a += 1;
                }
            } else {
                st.plain_steps += 1;
            }
            st.generated_tokens += emitted.len();
            out.push((r, emitted));
        }
        self.drafter
            .extend(&extend_rows, self.target.taps(), &tap_rows)?;
        let commit_s = t_commit.elapsed().as_secs_f64();
        let committed: usize = verdicts.iter().map(|v| v.accepted + 1).sum();
        self.gate
            .record(block >= 2, committed, t_round.elapsed().as_secs_f64());
        for &r in &live {
            let st = &mut self.rows[r].as_mut().expect("live").stats;
            st.draft_s += draft_s;
            st.verify_s += verify_s;
            st.commit_s += commit_s;
            st.decode_s += draft_s + verify_s + commit_s;
        }
        Ok(())
    }

    fn finish_row(&mut self, row: RowId) -> RowStats {
        match self.rows.get_mut(row).and_then(Option::take) {
            Some(r) => {
                self.target.release_row(row);
                self.drafter.release_row(r.drow);
                r.stats
            }
            None => RowStats::default(),
        }
    }

    fn live_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.is_some()).count()
    }

    fn context_length(&self) -> usize {
        self.target.context_length()
    }

    fn lookahead(&self) -> usize {
        self.block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_treats_a_sparse_q_as_zero_elsewhere() {
        let p = Dist {
            items: vec![(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        };
        // A selector's q over two candidates, listed in candidate (not id) order.
        let q = Dist {
            items: vec![(3, 0.7), (1, 0.3)],
        };
        let r = residual(&p, &q);
        // max(p - q, 0) = [0.1, 0, 0.3, 0] -> normalised over 0.4.
        let want = [(0, 0.25), (2, 0.75)];
        assert_eq!(r.items.len(), 2);
        for (got, w) in r.items.iter().zip(want) {
            assert_eq!(got.0, w.0);
            assert!((got.1 - w.1).abs() < 1e-6);
        }
        // q covering p entirely (p <= q everywhere it is positive): falls back to p.
        let all = Dist {
            items: vec![(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        };
        assert_eq!(residual(&p, &all), p);
    }
}
