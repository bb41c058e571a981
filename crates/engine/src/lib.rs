//! dflash-engine: what decoding is.
//!
//! Sampling, plain autoregressive decoding (the baseline and the reference for the lossless
//! contract), DFlash speculative rounds over batches of rows, and the session driver that
//! turns a decoder's tokens into text with stop handling and statistics.

pub mod ar;
pub mod batch;
mod choose;
pub mod decoder;
pub mod dflash;
pub mod logprobs;
mod output;
pub mod prefill;
pub mod sampling;
pub mod selector_walk;
pub mod session;
pub mod shortlist;
pub mod spec_gate;
pub mod stats;

pub use batch::{Batch, Event};
pub use decoder::{Decoder, EngineError, RowId};
pub use sampling::{Sampler, SamplingParams};
pub use session::{Completion, FinishReason, Request};
pub use spec_gate::SpecMode;
pub use stats::RowStats;
