//! dflash-models: what a network is.
//!
//! Loading (GGUF files, Hugging Face directories), tokenizers and chat templates, the
//! Llama-family target architecture and the DFlash drafter, written against the runtime's
//! `Backend` so they run on any device.

pub mod chat;
pub mod config;
pub mod default_model;
pub mod dflash;
pub mod drafter;
pub mod error;
pub mod llama;
pub mod load;
pub mod paths;
pub mod rows;
pub mod source;
pub mod synthetic;
pub mod target;
pub mod tokenizer;

pub use error::{ModelError, Result};

pub use dflash::DflashDrafter;
pub use drafter::Drafter;
pub use load::{load_model, LoadedModel};
pub use paths::ProjectionPath;
pub use target::{LogitRows, RowStep, Target};
