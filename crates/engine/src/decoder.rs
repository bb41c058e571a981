//! The decoder interface: a strategy that advances a batch of rows by one or more tokens.

use dflash_models::{KvUsage, ModelError};

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
/// A row starts either with a whole prefill that yields its first token at once
/// ([`Decoder::start_row`]) or queued ([`Decoder::queue_row`]): then the steps feed its prompt
/// in pieces and the step that feeds the last piece yields its first token. Every
/// [`Decoder::step`] yields at least one more token for every row past its prefill. Tokens come out in order and are exactly
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

    /// Opens a row for `prompt` with room for `capacity` positions to begin with (the cache
    /// grows as the row does) without running it: later steps feed the prompt in pieces that,
    /// with the other rows' tokens, fit the step's token budget ([`Decoder::set_batch_tokens`]).
    /// The step that feeds the last piece emits the row's first token, chosen from that
    /// piece's last logits.
    fn queue_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<RowId>;

    /// The token budget of a step (at least 1): the live rows' own tokens (one per AR row, a
    /// verify block per DFlash row) always run; queued rows' prompt pieces fill what is left,
    /// in the order the rows were queued, but never less than a reserve of a quarter of the
    /// budget (at least one prefill granule), so queued rows join within a bounded number of
    /// steps however many tokens the live rows run. A step thus runs at most the larger of the
    /// budget and the live rows' tokens plus the reserve.
    fn set_batch_tokens(&mut self, tokens: usize);

    /// Advances every live row and feeds queued rows' prompts; appends `(row, new tokens)` to
    /// `out` (at least one token for each row past its prefill, the first token for a row
    /// whose prefill ended).
    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()>;

    /// Ends a row and frees its slot.
    fn finish_row(&mut self, row: RowId) -> RowStats;

    /// KV cache memory of the open rows (target and drafter together).
    fn kv_usage(&self) -> KvUsage;

    /// Number of live rows (queued ones included).
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
