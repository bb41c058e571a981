//! dflash-models: what a network is.
//!
//! Loading (GGUF files, Hugging Face directories), tokenizers and chat templates, the
//! Llama-family and Qwen 3.5 hybrid target architectures and the DFlash / DFlash2 drafters,
//! written against the runtime's
//! `Backend` so they run on any device.

pub mod any_target;
pub mod bounds;
pub mod chat;
pub mod config;
pub mod default_model;
pub mod dflash;
mod dflash2;
pub mod draft_vocab;
pub mod drafter;
pub mod drafter_config;
pub mod error;
pub mod kv_usage;
pub mod llama;
pub mod load;
pub mod paths;
pub mod qwen35;
pub mod rows;
pub mod selector;
pub mod source;
pub mod step;
pub mod synthetic;
pub mod target;
pub mod tokenizer;

pub use error::{ModelError, Result};
pub use kv_usage::KvUsage;

pub use any_target::TargetModel;
pub use dflash::DflashDrafter;
pub use drafter::Drafter;
pub use load::{load_model, LoadedModel};
pub use paths::ProjectionPath;
pub use selector::CandidateLattice;
pub use target::{argmax_only, LogitRows, RowStep, Target};
