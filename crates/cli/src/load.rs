//! Builds what a subcommand runs: the backend, the model, its tokenizer and template, and a
//! decoder over them.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dflash_engine::ar::ArDecoder;
use dflash_engine::Decoder;
use dflash_models::chat::{ChatTemplate, Message};
use dflash_models::default_model::ensure_default_model;
use dflash_models::load_model;
use dflash_models::tokenizer::TextTokenizer;
use dflash_runtime::cpu::CpuBackend;

use crate::args::ModelArgs;
use crate::progress::Bars;

/// A model ready to generate.
pub struct Loaded {
    pub decoder: Box<dyn Decoder>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
    pub path: PathBuf,
    /// Human-readable device description (e.g. `cpu avx512 x2`).
    pub device: String,
}

/// The model path the user named, or the default model (downloaded on first use).
pub fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    match &args.model {
        Some(p) => {
            if !p.exists() {
                bail!("model not found: {}", p.display());
            }
            Ok(p.clone())
        }
        None => Ok(ensure_default_model(&Bars::default())?),
    }
}

/// Loads the model for `args` with a plain autoregressive decoder.
pub fn load(args: &ModelArgs) -> Result<Loaded> {
    match args.device.as_deref() {
        None | Some("cpu") => {}
        Some(d) if d == "cuda" || d.starts_with("cuda:") => {
            bail!("device `{d}`: this build of dflash has no CUDA support (build with --features cuda)")
        }
        Some(d) => bail!("unknown device `{d}` (expected cpu, cuda or cuda:N)"),
    }
    let path = model_path(args)?;
    let backend = Arc::new(CpuBackend::new(args.threads));
    let device = format!("cpu {} x{}", backend.isa(), backend.threads());
    let loaded = load_model(backend, &path)
        .with_context(|| format!("cannot load the model at {}", path.display()))?;
    tracing::info!(model = %loaded.name, %device, "model loaded");
    Ok(Loaded {
        decoder: Box::new(ArDecoder::new(loaded.model)),
        tokenizer: loaded.tokenizer,
        template: loaded.template,
        name: loaded.name,
        path,
        device,
    })
}

impl Loaded {
    /// Token ids for a user prompt: through the chat template (with an optional system
    /// message) unless `raw`, or when the model has no template.
    pub fn prompt_ids(&self, prompt: &str, system: Option<&str>, raw: bool) -> Result<Vec<u32>> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", prompt));
        self.chat_ids(&messages, raw)
    }

    /// Token ids for a conversation (or the last message's text alone when `raw`).
    pub fn chat_ids(&self, messages: &[Message], raw: bool) -> Result<Vec<u32>> {
        match (&self.template, raw) {
            (Some(t), false) => {
                let text = t.render(messages, true)?;
                // The template writes any BOS itself.
                Ok(self.tokenizer.encode(&text, false)?)
            }
            (None, false) => {
                tracing::warn!("the model has no chat template; using the prompt as raw text");
                let text = messages.last().map(|m| m.content.as_str()).unwrap_or("");
                Ok(self.tokenizer.encode(text, true)?)
            }
            (_, true) => {
                let text = messages.last().map(|m| m.content.as_str()).unwrap_or("");
                Ok(self.tokenizer.encode(text, true)?)
            }
        }
    }
}
