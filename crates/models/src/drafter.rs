//! The interface the decoding engine sees of a block drafter.

use dflash_runtime::Backend;

use crate::error::Result;
use crate::kv_usage::KvUsage;
use crate::selector::CandidateLattice;

/// A drafter that proposes a block of tokens per row in one forward pass, conditioned on
/// features tapped from the target.
///
/// Each row keeps its own committed context; a row's block always starts at the position
/// right after its context (`context_len`).
pub trait Drafter: Send {
    type B: Backend;

    /// Trained block size (slot 0 holds the current token, slots 1.. are proposals).
    fn block_size(&self) -> usize;
    /// Target layers whose outputs the drafter consumes, in order.
    fn tap_layers(&self) -> &[usize];

    fn new_row(&mut self, capacity: usize) -> Result<usize>;
    fn release_row(&mut self, row: usize);
    /// KV cache memory of the open rows' contexts.
    fn kv_usage(&self) -> KvUsage;
    /// Committed context positions of row `row`.
    fn context_len(&self, row: usize) -> usize;
    /// Appends context features: for each `(row, count)` in order, the next `count` entries of
    /// `tap_rows` index rows of `taps` (`[tokens, layers x hidden]`) that belong to that row.
    fn extend(
        &mut self,
        rows: &[(usize, usize)],
        taps: &<Self::B as Backend>::Tensor,
        tap_rows: &[u32],
    ) -> Result<()>;
    /// [`Drafter::extend`] whose work may wait: the tokens are placed at once (the context
    /// lengths grow), their features are kept, and their keys and values are written when
    /// the drafter next drafts or flushes (in one pass over every waiting token). For rounds
    /// that did not draft: while drafting does not pay, the context's upkeep then costs a copy
    /// per round. The default extends at once.
    fn extend_deferred(
        &mut self,
        rows: &[(usize, usize)],
        taps: &<Self::B as Backend>::Tensor,
        tap_rows: &[u32],
    ) -> Result<()> {
        self.extend(rows, taps, tap_rows)
    }
    /// Writes every deferred context token ([`Drafter::extend_deferred`]); drafting does it
    /// first anyway. The default has nothing to write.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }
    /// Whether the next drafts are read only for each slot's largest logit (every row drafts
    /// greedily): the drafter may then compute its head with
    /// [`dflash_runtime::Backend::matmul_argmax`], whose other logits may be approximate.
    /// The default computes every logit anyway.
    fn set_argmax_only(&mut self, _on: bool) {}
    /// Drafts a block of `block` slots for every `(row, current token)`; afterwards
    /// [`Drafter::logits`] holds `block - 1` rows of logits per row (slots 1..block), rows in
    /// order. The context is not changed.
    fn draft(
        &mut self,
        rows: &[(usize, u32)],
        block: usize,
        embed: &<Self::B as Backend>::Weight,
        lm_head: &<Self::B as Backend>::Weight,
    ) -> Result<()>;
    fn logits(&self) -> &<Self::B as Backend>::Tensor;
    /// When the drafter's head covers a vocabulary shortlist, the target id of each column of
    /// [`Drafter::logits`] (the drafter proposes only these tokens: q = 0 for every other).
    fn vocab_map(&self) -> Option<&[u32]> {
        None
    }
    /// After [`Drafter::draft`], a drafter with a candidate selector (DFlash2) gives the
    /// lattice its proposals are walked from; the engine then ignores [`Drafter::logits`].
    fn lattice(&self) -> Option<&CandidateLattice> {
        None
    }
}
