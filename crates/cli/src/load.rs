//! Builds what a subcommand runs: the backend, the model, its tokenizer and template, the
//! drafter when one is used, and a decoder over them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::Decoder;
use dflash_models::chat::{ChatTemplate, Message};
use dflash_models::default_model::ensure_default_model;
use dflash_models::dflash::DrafterConfig;
use dflash_models::llama::LlamaModel;
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::{load_model, DflashDrafter, Drafter, Target};
use dflash_runtime::cpu::CpuBackend;

use crate::args::{BatchAccept, DraftArgs, ModelArgs};
use crate::progress::Bars;

/// Default draft block on the CPU backend. Verifying a block costs a target forward over every
/// slot, and on a few CPU cores that grows with the block; with the shipped drafter the best
/// throughput measured on a 2-core machine was at 3-4 slots (docs/benchmarks). `--block-size`
/// overrides it, up to the drafter's trained block.
const CPU_DEFAULT_BLOCK: usize = 4;

/// Where the drafter for the default model lives in the source tree.
const DEFAULT_DRAFTER: &str = "models/drafters/smollm2-135m-instruct-dflash";

/// A loaded target with what is needed to talk to it.
pub struct Bundle {
    pub backend: Arc<CpuBackend>,
    pub target: LlamaModel<CpuBackend>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
    pub path: PathBuf,
    /// Human-readable device description (e.g. `cpu avx512 x2`).
    pub device: String,
    /// True when the user named no model (the default model runs).
    pub is_default: bool,
}

/// A model ready to generate.
pub struct Loaded {
    pub decoder: Box<dyn Decoder>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
    pub path: PathBuf,
    pub device: String,
}

fn check_device(args: &ModelArgs) -> Result<()> {
    match args.device.as_deref() {
        None | Some("cpu") => Ok(()),
        Some(d) if d == "cuda" || d.starts_with("cuda:") => {
            bail!("device `{d}`: this build of dflash has no CUDA support (build with --features cuda)")
        }
        Some(d) => bail!("unknown device `{d}` (expected cpu, cuda or cuda:N)"),
    }
}

/// Loads the target model the user named, or the default model.
pub fn load_target(args: &ModelArgs) -> Result<Bundle> {
    check_device(args)?;
    let (path, is_default) = match &args.model {
        Some(p) => {
            if !p.exists() {
                bail!("model not found: {}", p.display());
            }
            (p.clone(), false)
        }
        None => (ensure_default_model(&Bars::default())?, true),
    };
    let backend = Arc::new(CpuBackend::new(args.threads));
    let device = format!("cpu {} x{}", backend.isa(), backend.threads());
    let loaded = load_model(backend.clone(), &path)
        .with_context(|| format!("cannot load the model at {}", path.display()))?;
    tracing::info!(model = %loaded.name, %device, "model loaded");
    Ok(Bundle {
        backend,
        target: loaded.model,
        tokenizer: loaded.tokenizer,
        template: loaded.template,
        name: loaded.name,
        path,
        device,
        is_default,
    })
}

/// The shipped drafter for the default model, if this installation has it.
pub fn default_drafter() -> Option<PathBuf> {
    let candidates = [
        std::env::current_exe().ok().and_then(|e| {
            e.parent()?
                .parent()?
                .parent()
                .map(|root| root.join(DEFAULT_DRAFTER))
        }),
        Some(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(DEFAULT_DRAFTER),
        ),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.join("config.json").exists())
}

/// Which drafter to use: the one named, the default one for the default model, or none.
pub fn drafter_dir(draft: &DraftArgs, bundle: &Bundle) -> Result<Option<PathBuf>> {
    if draft.no_draft {
        return Ok(None);
    }
    match &draft.draft {
        Some(d) => {
            if !d.join("config.json").exists() {
                bail!("drafter not found: {} has no config.json", d.display());
            }
            Ok(Some(d.clone()))
        }
        None if bundle.is_default => Ok(default_drafter()),
        None => Ok(None),
    }
}

/// A decoder over `bundle`'s target: DFlash with the drafter at `drafter`, else plain.
pub fn decoder(bundle: Bundle, drafter: Option<&Path>, draft: &DraftArgs) -> Result<Loaded> {
    let Bundle {
        backend,
        target,
        tokenizer,
        template,
        name,
        path,
        device,
        ..
    } = bundle;
    let decoder: Box<dyn Decoder> = match drafter {
        None => Box::new(ArDecoder::new(target)),
        Some(dir) => {
            // The configuration is checked against the target before any weight is read.
            DrafterConfig::read(dir)
                .and_then(|c| c.check_target(target.hidden(), target.n_layers(), target.vocab()))
                .with_context(|| format!("the drafter at {} does not fit {name}", dir.display()))?;
            let d = DflashDrafter::open(backend, dir)
                .with_context(|| format!("cannot load the drafter at {}", dir.display()))?;
            let block = draft
                .block_size
                .unwrap_or(d.block_size().min(CPU_DEFAULT_BLOCK));
            let policy = match draft.batch_accept {
                BatchAccept::Clamp => AcceptPolicy::Clamp,
                BatchAccept::PerRow => AcceptPolicy::from_env(),
            };
            Box::new(DflashDecoder::new(target, d, block, policy)?)
        }
    };
    Ok(Loaded {
        decoder,
        tokenizer,
        template,
        name,
        path,
        device,
    })
}

/// Loads the model and, unless disabled, its drafter.
pub fn load(args: &ModelArgs, draft: &DraftArgs) -> Result<Loaded> {
    let bundle = load_target(args)?;
    let dir = drafter_dir(draft, &bundle)?;
    decoder(bundle, dir.as_deref(), draft)
}

/// Token ids for a conversation: through the chat template unless `raw` (or when the model
/// has no template, with a warning), else the last message's text alone.
pub fn chat_ids(
    tokenizer: &TextTokenizer,
    template: Option<&ChatTemplate>,
    messages: &[Message],
    raw: bool,
) -> Result<Vec<u32>> {
    match (template, raw) {
        (Some(t), false) => {
            let text = t.render(messages, true)?;
            // The template writes any BOS itself.
            Ok(tokenizer.encode(&text, false)?)
        }
        (None, false) => {
            tracing::warn!("the model has no chat template; using the prompt as raw text");
            let text = messages.last().map(|m| m.content.as_str()).unwrap_or("");
            Ok(tokenizer.encode(text, true)?)
        }
        (_, true) => {
            let text = messages.last().map(|m| m.content.as_str()).unwrap_or("");
            Ok(tokenizer.encode(text, true)?)
        }
    }
}

impl Loaded {
    /// Token ids for a user prompt with an optional system message.
    pub fn prompt_ids(&self, prompt: &str, system: Option<&str>, raw: bool) -> Result<Vec<u32>> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", prompt));
        chat_ids(&self.tokenizer, self.template.as_ref(), &messages, raw)
    }
}
