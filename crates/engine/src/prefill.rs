//! Chunked prefill: rows whose prompts are fed a piece at a time inside the decoding steps.
//!
//! A queued row holds its prompt and how much of it the target has seen. Each step, after
//! the live rows' own tokens (one per AR row, a verify block per DFlash row), the rest of
//! the step's token budget goes to the queued rows in arrival order: each takes the next
//! piece of its prompt, as long as the budget lasts, so several new rows can share one step.
//! The queued rows always get at least a quarter of the budget (and at least one granule,
//! see below), however many tokens the live rows run ([`prompt_budget`]): many live rows
//! verifying DFlash blocks can run more tokens than the whole budget, and joining rows must
//! still move: such a step runs the live rows' tokens plus the reserve, over the budget.
//! The step whose piece ends a prompt asks for that position's logits; the row's first token
//! comes from them, and the row joins the live rows from the next step on.
//!
//! Piece boundaries follow the target's prefill granule ([`Target::prefill_granule`]): the
//! prompt's body (its length rounded down to a multiple of the granule) is cut only at
//! multiples of it, and the rest (shorter than one granule) runs as its own piece(s). A whole
//! prefill ([`whole_pieces`]) cuts the same way, so every schedule computes a prompt's state
//! in the same order — for the Qwen 3.5 hybrid the gated delta rule then runs the same
//! 64-token chunks and the same token-by-token tail whatever the budget. Llama-family
//! targets have granule 1.

use std::ops::Range;
use std::time::Instant;

use crate::sampling::SamplingParams;

/// Tokens a step may run by default: live rows' tokens plus prefill pieces.
pub const DEFAULT_BATCH_TOKENS: usize = 512;

/// Queued prompts get at least one part in this many of the step's token budget.
const PROMPT_RESERVE_PARTS: usize = 4;

/// Prompt tokens a step may feed when its live rows run `live_tokens` tokens: what they
/// leave of `batch_tokens`, but never less than a reserve of a quarter of `batch_tokens`,
/// and never less than one `granule` (a prompt's body is cut only at its multiples). So
/// queued rows join within a bounded number of steps whatever the live rows run, and a step
/// runs at most `max(batch_tokens, live_tokens + reserve)` tokens.
pub(crate) fn prompt_budget(batch_tokens: usize, live_tokens: usize, granule: usize) -> usize {
    let reserve = batch_tokens
        .div_ceil(PROMPT_RESERVE_PARTS)
        .max(granule)
        .max(1);
    batch_tokens.saturating_sub(live_tokens).max(reserve)
}

/// Longest prompt piece of a whole prefill (bounds activation memory; a multiple of every
/// target's granule).
pub const PREFILL_CHUNK: usize = 512;

/// Where the body of a prompt of `len` tokens ends: `len` rounded down to a multiple of
/// `granule`.
fn body_end(len: usize, granule: usize) -> usize {
    len - len % granule.max(1)
}

/// The pieces of a whole prefill of `len` tokens: the body in pieces of at most
/// [`PREFILL_CHUNK`], then the tail.
pub(crate) fn whole_pieces(len: usize, granule: usize) -> Vec<Range<usize>> {
    let body = body_end(len, granule);
    let mut out: Vec<Range<usize>> = (0..body)
        .step_by(PREFILL_CHUNK)
        .map(|s| s..(s + PREFILL_CHUNK).min(body))
        .collect();
    if body < len {
        out.push(body..len);
    }
    out
}

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

    /// The pieces of a step with `budget` tokens for prefill, in arrival order; body pieces
    /// are whole multiples of `granule` (a row that cannot take one waits, and so do the rows
    /// after it).
    pub fn plan(&self, budget: usize, granule: usize) -> Vec<Piece> {
        let g = granule.max(1);
        let mut left = budget;
        let mut pieces = Vec::new();
        for (at, q) in self.rows.iter().enumerate() {
            let body = body_end(q.prompt.len(), g);
            let n = if q.fed < body {
                (body - q.fed).min(left / g * g)
            } else {
                (q.prompt.len() - q.fed).min(left)
            };
            if n == 0 {
                break;
            }
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
        let p = q.plan(12, 1);
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
        let p = q.plan(4, 1);
        assert_eq!(p[0].range, 2..3);
        assert!(p[0].last);
        assert_eq!(p[1].range, 0..3);
        assert!(!p[1].last);
        let done = q.advance(&p, Instant::now());
        assert_eq!(done.iter().map(|d| d.row).collect::<Vec<_>>(), [1]);
        assert!(q.plan(0, 1).is_empty());
        let p = q.plan(100, 1);
        assert_eq!(p[0].range, 3..7);
        assert_eq!(q.advance(&p, Instant::now()).len(), 1);
        assert!(q.is_empty());
    }

    #[test]
    fn prompts_keep_a_reserve_of_the_budget_whatever_the_live_rows_run() {
        // The live rows leave more than the reserve: prompts get what they leave.
        assert_eq!(prompt_budget(512, 64, 1), 448);
        assert_eq!(prompt_budget(512, 0, 1), 512);
        // 128 rows verifying blocks of 4 fill the budget, 256 overrun it: a quarter is kept.
        assert_eq!(prompt_budget(512, 512, 1), 128);
        assert_eq!(prompt_budget(512, 1024, 1), 128);
        assert_eq!(prompt_budget(512, 400, 1), 128);
        assert_eq!(prompt_budget(64, 64, 1), 16);
        // Rounded up; never below one token, nor below one granule.
        assert_eq!(prompt_budget(10, 40, 1), 3);
        assert_eq!(prompt_budget(1, 40, 1), 1);
        assert_eq!(prompt_budget(40, 2, 64), 64);
        assert_eq!(prompt_budget(512, 600, 64), 128);
        assert_eq!(prompt_budget(100, 0, 64), 100);
        // A reserve of one granule lets a body piece through.
        let q = queue(&[150]);
        assert_eq!(q.plan(prompt_budget(40, 2, 64), 64)[0].range, 0..64);
    }

    #[test]
    fn several_rows_finish_in_one_step() {
        let mut q = queue(&[2, 3, 4]);
        let p = q.plan(9, 1);
        let done = q.advance(&p, Instant::now());
        assert_eq!(done.iter().map(|d| d.row).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(done.iter().all(|d| d.fed == d.prompt.len()));
    }

    #[test]
    fn granule_aligned_pieces_cut_the_body_at_multiples_and_the_tail_apart() {
        // 150 = body 128 + tail 22 at granule 64.
        assert_eq!(whole_pieces(150, 64), vec![0..128, 128..150]);
        assert_eq!(whole_pieces(1100, 1), vec![0..512, 512..1024, 1024..1100]);
        assert_eq!(whole_pieces(40, 64), vec![0..40]);
        let mut q = queue(&[150, 30, 64]);
        // 100 tokens: one 64-token body piece, then the 30-token prompt (all tail) whole; the
        // third row's 64-token body does not fit what is left, so it waits.
        let p = q.plan(100, 64);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].range.clone(), p[0].last), (0..64, false));
        assert_eq!((p[1].range.clone(), p[1].last), (0..30, true));
        assert_eq!(q.advance(&p, Instant::now()).len(), 1);
        // 63 tokens cannot hold a body piece: nothing runs.
        assert!(q.plan(63, 64).is_empty());
        let p = q.plan(80, 64);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].range, 64..128);
        q.advance(&p, Instant::now());
        // The tail may be split freely.
        let p = q.plan(10, 64);
        assert_eq!(p[0].range, 128..138);
        assert!(!p[0].last);
    }
}
