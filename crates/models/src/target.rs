//! The interface the decoding engine sees of a target model.

use dflash_runtime::Backend;

use crate::error::Result;
use crate::kv_usage::KvUsage;

/// Which logits a row wants from a forward step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    /// None (e.g. a prefill chunk that is not the last).
    None,
    /// Only the last token's.
    Last,
    /// Every token's (a verify block).
    All,
}

/// One row's share of a forward step: `tokens` continue the row at its current length.
#[derive(Clone, Copy, Debug)]
pub struct RowStep<'a> {
    pub row: usize,
    pub tokens: &'a [u32],
    pub logits: LogitRows,
    /// The tokens are a piece of the row's prompt (prefill), not decode or verify tokens. A
    /// backend may compute prompt rows on a faster path (`dflash_runtime::RowSpan::prompt`);
    /// a prompt must be fed with this set in every piece, so that its tokens get the same
    /// bits however it is cut, and generated tokens never with it, so that decode and verify
    /// rows keep equal bits.
    pub prompt: bool,
    /// The row reads its logits only for a greedy choice (the first largest value of each
    /// logit row and its position). When every row of a forward that wants logits says so,
    /// the target may compute the head with [`dflash_runtime::Backend::matmul_argmax`]: those
    /// values and positions stay exact, the other logits may not be.
    pub argmax_only: bool,
}

/// Whether every step of `steps` that wants logits reads them only for a greedy choice.
pub fn argmax_only(steps: &[RowStep<'_>]) -> bool {
    steps
        .iter()
        .filter(|s| s.logits != LogitRows::None)
        .all(|s| s.argmax_only)
}

/// A causal language model that runs batches of rows, each with its own KV cache length.
pub trait Target: Send {
    type B: Backend;

    fn backend(&self) -> &Self::B;
    fn vocab(&self) -> usize;
    fn hidden(&self) -> usize;
    fn n_layers(&self) -> usize;
    fn context_length(&self) -> usize;

    /// Opens a new row (sequence slot) with room for `capacity` positions.
    fn new_row(&mut self, capacity: usize) -> Result<usize>;
    /// Frees a row's slot and cache.
    fn release_row(&mut self, row: usize);
    /// Number of positions in row `row`'s cache.
    fn row_len(&self, row: usize) -> usize;
    /// Drops positions `len..` of row `row` (rolls back rejected tokens). A target with
    /// recurrent state can roll a row back only into its last forward step (an error beyond
    /// that); KV-only targets can cut anywhere.
    fn truncate_row(&mut self, row: usize, len: usize) -> Result<()>;
    /// KV cache memory of the open rows.
    fn kv_usage(&self) -> KvUsage;
    /// Copies row `src`'s cache into a new row (shared prompt prefix).
    fn fork_row(&mut self, src: usize, capacity: usize) -> Result<usize>;

    /// Layers whose outputs (residual stream after the layer) are captured on every forward,
    /// concatenated in this order into [`Target::taps`].
    fn set_tap_layers(&mut self, layers: &[usize]) -> Result<()>;

    /// Runs all rows' tokens in one batch, appending them to each row's cache.
    fn forward(&mut self, steps: &[RowStep<'_>]) -> Result<()>;
    /// Logits of the last forward: one row per requested position, rows in step order (when
    /// every row asked [`RowStep::argmax_only`], exact only in each row's first largest value
    /// and its position).
    fn logits(&self) -> &<Self::B as Backend>::Tensor;
    /// Tapped hidden states of the last forward: `[tokens, layers x hidden]`, in step order.
    fn taps(&self) -> &<Self::B as Backend>::Tensor;

    /// Token embedding table (shared with drafters).
    fn embedding(&self) -> &<Self::B as Backend>::Weight;
    /// Output projection (shared with drafters).
    fn lm_head(&self) -> &<Self::B as Backend>::Weight;
    /// A reduced output head: rows `ids` of [`Target::lm_head`] in their stored format,
    /// uploaded for the same numeric path (a drafter's vocabulary shortlist).
    fn lm_head_rows(&self, ids: &[u32]) -> Result<<Self::B as Backend>::Weight>;

    /// Prompt positions a prefill piece should start and end at multiples of (except the
    /// prompt's last, shorter-than-one-granule part): a target whose numerics depend on how a
    /// prompt is cut (the chunked gated delta rule) names its chunk, so every prefill schedule
    /// computes the same bits.
    fn prefill_granule(&self) -> usize {
        1
    }

    /// Whether the rows of one batch can each keep a different number of a verified block's
    /// tokens (every row truncated to its own length, its valid prefix staying contiguous).
    /// A layout that cannot — one rectangular cache shared by the batch — makes DFlash commit
    /// the batch's smallest accept count instead.
    fn per_row_commit(&self) -> bool {
        true
    }
}
