//! Chunked prefill: rows whose prompts are fed a piece at a time inside the decoding steps.
//!
//! A queued row holds its prompt and how much of it the target has seen. Each step, after
//! the live rows' own tokens (one per AR row, a verify block per DFlash row), the rest of
//! the step's token budget goes to the queued rows in arrival order: each takes the next
//! piece of its prompt, as long as the budget lasts, so several new rows can share one step.
//! The step whose piece ends a prompt asks for that position's logits; the row's first token
//! comes from them, and the row joins the live rows from the next step on.

use std::ops::Range;
use std::time::Instant;

use crate::sampling::SamplingParams;

/// Tokens a step may run by default: live rows' tokens plus prefill pieces.
pub const DEFAULT_BATCH_TOKENS: usize = 512;

/// A row whose prompt is still being fed; `extra` is the decoder's own per-row data.
pub(crate) struct Queued<X> {
    pub row: usize,
    pub prompt: Vec<u32>,
    /// Prompt tokens already in the target's cache.
    pub fed: usize,
    pub params: SamplingParams,
    /// When the first piece ran.
    pub started: Option<Instant>,
    pub extra: X,
}

/// One queued row's piece of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Index into the queue.
    pub at: usize,
    pub range: Range<usize>,
    /// The piece ends the prompt (its last position's logits are asked for).
    pub last: bool,
}

/// Rows waiting for (the rest of) their prefill, in arrival order.
pub(crate) struct PrefillQueue<X> {
    rows: Vec<Queued<X>>,
}

impl<X> Default for PrefillQueue<X> {
    fn default() -> Self {
        Self { rows: Vec::new() }
    }
}

impl<X> PrefillQueue<X> {
    pub fn push(&mut self, row: usize, prompt: &[u32], params: &SamplingParams, extra: X) {
        self.rows.push(Queued {
            row,
            prompt: prompt.to_vec(),
            fed: 0,
            params: params.clone(),
            started: None,
            extra,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn get(&self, at: usize) -> &Queued<X> {
        &self.rows[at]
    }

    /// Takes `row` out of the queue (a request ended before its prefill did).
    pub fn remove(&mut self, row: usize) -> Option<Queued<X>> {
        let at = self.rows.iter().position(|q| q.row == row)?;
        Some(self.rows.remove(at))
    }

    /// The pieces of a step with `budget` tokens for prefill, in arrival order.
    pub fn plan(&self, budget: usize) -> Vec<Piece> {
        let mut left = budget;
        let mut pieces = Vec::new();
        for (at, q) in self.rows.iter().enumerate() {
            if left == 0 {
                break;
            }
            let n = (q.prompt.len() - q.fed).min(left);
            left -= n;
            pieces.push(Piece {
                at,
                range: q.fed..q.fed + n,
                last: q.fed + n == q.prompt.len(),
            });
        }
        pieces
    }

    /// Records that `pieces` ran (from `t0`); returns the rows whose prompts are now fully
    /// fed, in piece order, out of the queue.
    pub fn advance(&mut self, pieces: &[Piece], t0: Instant) -> Vec<Queued<X>> {
        for p in pieces {
            let q = &mut self.rows[p.at];
            q.fed = p.range.end;
            q.started.get_or_insert(t0);
        }
        let mut done = Vec::new();
        // Back to front so the indices of earlier pieces stay valid.
        for p in pieces.iter().rev().filter(|p| p.last) {
            done.push(self.rows.remove(p.at));
        }
        done.reverse();
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(lens: &[usize]) -> PrefillQueue<()> {
        let mut q = PrefillQueue::default();
        for (i, &n) in lens.iter().enumerate() {
            q.push(i, &vec![1; n], &SamplingParams::greedy(), ());
        }
        q
    }

    #[test]
    fn pieces_fill_the_budget_in_arrival_order() {
        let mut q = queue(&[10, 3, 7]);
        let p = q.plan(12);
        assert_eq!(
            p,
            vec![
                Piece {
                    at: 0,
                    range: 0..10,
                    last: true
                },
                Piece {
                    at: 1,
                    range: 0..2,
                    last: false
                },
            ]
        );
        let done = q.advance(&p, Instant::now());
        assert_eq!(done.iter().map(|d| d.row).collect::<Vec<_>>(), [0]);
        assert_eq!(q.len(), 2);
        let p = q.plan(4);
        assert_eq!(p[0].range, 2..3);
        assert!(p[0].last);
        assert_eq!(p[1].range, 0..3);
        assert!(!p[1].last);
        let done = q.advance(&p, Instant::now());
        assert_eq!(done.iter().map(|d| d.row).collect::<Vec<_>>(), [1]);
        assert!(q.plan(0).is_empty());
        let p = q.plan(100);
        assert_eq!(p[0].range, 3..7);
        assert_eq!(q.advance(&p, Instant::now()).len(), 1);
        assert!(q.is_empty());
    }

    #[test]
    fn several_rows_finish_in_one_step() {
        let mut q = queue(&[2, 3, 4]);
        let p = q.plan(9);
        let done = q.advance(&p, Instant::now());
        assert_eq!(done.iter().map(|d| d.row).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(done.iter().all(|d| d.fed == d.prompt.len()));
    }
}
