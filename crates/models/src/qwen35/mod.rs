//! Qwen 3.5 hybrid targets: Gated DeltaNet layers and gated full-attention layers
//! (notes/qwen35_gdn.md), from HF directories or llama.cpp `qwen35` GGUF files.

pub mod config;
pub mod model;

pub use config::{LayerKind, Qwen35Config};
pub use model::{Naming, Qwen35Model, MAX_ROLLBACK};
