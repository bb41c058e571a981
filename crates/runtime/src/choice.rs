//! Token choice on the device: what the [`Backend`](crate::Backend) token-choice ops are given.
//!
//! The definition of every choice is the engine's host code (`dflash_engine::sampling` and
//! the rejection test of `dflash_engine::dflash`); a backend that offers these ops computes
//! the same thing where the logits are, so that only token ids and accept counts travel back.
//! Randomness stays on the host: each op is handed the uniforms the row's seeded sampler drew,
//! a fixed number per token (one per sampled token; per DFlash round `block - 1` for the
//! drafts, `block - 1` for the accept tests and one for the last token), so a row's random
//! stream is the same whichever side chooses.

/// How one row's tokens are chosen (the engine's sampling parameters less the seed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChoiceParams {
    /// 0: greedy (the first largest processed logit).
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: u32,
    /// Keep the most likely tokens whose mass reaches p (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely (0: off).
    pub min_p: f32,
    /// HF repetition penalty over the row's history (1: off).
    pub repetition_penalty: f32,
}

impl ChoiceParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Whether the logits are changed by the history.
    pub fn penalized(&self) -> bool {
        self.repetition_penalty != 1.0
    }

    /// Whether a filter keeps only part of the distribution (which orders it by probability).
    pub fn filtered(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// One token from one row of logits.
#[derive(Clone, Copy, Debug)]
pub struct SampleRow<'a> {
    pub params: ChoiceParams,
    /// Ids seen so far (for the repetition penalty; any order, repeats allowed).
    pub history: &'a [u32],
    /// The uniform in `[0, 1)` the token is drawn with (unused when greedy).
    pub u: f32,
}

/// A row's drafts from its slots of the drafter's logits: slot i is chosen with the history
/// followed by the drafts of slots `0..i`.
#[derive(Clone, Copy, Debug)]
pub struct DraftRow<'a> {
    pub params: ChoiceParams,
    pub history: &'a [u32],
    /// One uniform per slot (unused when greedy).
    pub u: &'a [f32],
}

/// A row's DFlash verification: its block of target logits (`drafts.len() + 1` rows), the
/// drafter's logits the drafts were drawn from (`drafts.len()` rows, read at T > 0 only).
#[derive(Clone, Copy, Debug)]
pub struct VerifyRow<'a> {
    pub params: ChoiceParams,
    /// Ids before the block (the block's first token included).
    pub history: &'a [u32],
    pub drafts: &'a [u32],
    /// One uniform per draft for the accept test `u * q(d) < p(d)` (unused when greedy).
    pub accept_u: &'a [f32],
    /// The uniform of the token after the accepted drafts (residual or last slot).
    pub last_u: f32,
}

/// A row's outcome of a verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix).
    pub accepted: usize,
    /// The target's own token after them.
    pub token: u32,
}
