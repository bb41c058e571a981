//! The decoder interface: a strategy that advances a batch of rows by one or more tokens.

use dflash_models::ModelError;

use crate::sampling::SamplingParams;
use crate::stats::RowStats;

/// A decoder's handle for a row (stable while the row lives).
pub type RowId = usize;

/// Errors while decoding.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

/// A decoding strategy over rows that run together.
///
/// Each row starts with a prefill that yields its first token; every later [`Decoder::step`]
/// yields at least one more token for every live row. Tokens come out in order and are exactly
/// what the strategy commits; the caller decides when a row is done and calls
/// [`Decoder::finish_row`].
pub trait Decoder {
    /// Prefills `prompt` into a new row with room for `capacity` positions; returns the row and
    /// its first generated token.
    fn start_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<(RowId, u32)>;

    /// Advances every live row; appends `(row, new tokens)` to `out` (at least one token each).
    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()>;

    /// Ends a row and frees its slot.
    fn finish_row(&mut self, row: RowId) -> RowStats;

    /// Number of live rows.
    fn live_rows(&self) -> usize;

    /// Positions the model can hold per row.
    fn context_length(&self) -> usize;

    /// For a row started with `SamplingParams::keep_logits`: the target's logits behind the
    /// tokens the last `start_row` or `step` emitted for it, one vocabulary-wide row per token,
    /// in order; empty for other rows.
    fn token_logits(&self, row: RowId) -> &[f32];

    /// Extra positions a row needs beyond its tokens (speculative blocks overshoot).
    fn lookahead(&self) -> usize {
        0
    }
}
