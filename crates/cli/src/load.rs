//! Builds what a subcommand runs: the backend, the model, its tokenizer and template, the
//! drafter when one is used, and a decoder over them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::{Decoder, SpecMode};
use dflash_models::chat::{conversation_ids, ChatTemplate, Message};
use dflash_models::default_model::ensure_default_model;
use dflash_models::dflash::DrafterConfig;
use dflash_models::draft_vocab::{DraftVocab, DRAFT_VOCAB_FILE};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::TargetModel;
use dflash_models::{load_model, DflashDrafter, Drafter, ProjectionPath, Target};
use dflash_runtime::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use dflash_runtime::cuda::CudaBackend;
use dflash_runtime::{Backend, DType};

use crate::args::{BatchAccept, DraftArgs, DraftWeights, ModelArgs, Speculation};
use crate::progress::Bars;

/// Default draft block on the CPU backend. Verifying a block costs a target forward over every
/// slot, and on a few CPU cores that grows with the block (a verify of 2 costs ~1.2 decode
/// steps, of 3 ~1.4), while the drafter's acceptance falls with the slot; on a 2-core machine
/// block 2 measured best with every drafter shipped so far (2026-12-02: DFlash / AR 1.08x
/// against 1.03x at block 3, medians of three runs;
/// docs/benchmarks/2026-12-02-drafter-round5-h200.md). `--block-size` overrides it, up to the
/// drafter's trained block.
const CPU_DEFAULT_BLOCK: usize = 2;

/// Default draft block on the CUDA backend. With the shipped drafter block 4 measured best on
/// an H200 on both numeric paths: with int8 activations (the default; τ 1.84 at block 4, 1.96
/// at 8, 2.07 at 16) DFlash / AR 1.19-1.20x against 1.04-1.05x at 8 and 0.97x at 16
/// (docs/benchmarks/2026-12-02-h200-int8-default.md); with f32 activations 1.28x against
/// 1.13x and 1.04-1.07x (2026-12-02-h200-attention-merge.md). `--block-size` overrides it, up
/// to the drafter's trained block.
#[cfg(feature = "cuda")]
const CUDA_DEFAULT_BLOCK: usize = 4;

/// Default draft vocabulary on the CPU: the drafter's head over the 4096 most frequent target
/// tokens of its shipped ranking. With the shipped drafter at block 2 it measured best on a
/// 2-core machine: DFlash / AR 0.93 against 0.86 at 8192, 0.87 at 16384 and 0.78 with the full
/// vocabulary, for τ 1.46 against 1.48; with the retrained drafter of 2026-12-01, 0.88 (tied
/// with 8192) against 0.84 (docs/benchmarks/2026-12-01-cpu-draft-shortlist.md).
const CPU_DEFAULT_DRAFT_VOCAB: usize = 4096;

/// Default draft vocabulary on the CUDA backend: the full vocabulary. The 4096-token shortlist
/// costs τ there (1.84 → 1.75 at block 4) and gains no speed: on an H100 with the shipped
/// drafter, DFlash at block 4 1,729 / 1,718 tok/s against 1,749 / 1,722 with the full
/// vocabulary (docs/benchmarks/2026-12-02-h200-int8-default.md).
#[cfg(feature = "cuda")]
const CUDA_DEFAULT_DRAFT_VOCAB: usize = 0;

/// Default format of the drafter's layer weights on the CPU: re-encoded as Q4_1 at load. A
/// draft step on a few cores reads the drafter's weights once per step (31.6 MB as stored in
/// bf16, about a third of the default target's bytes); as Q4_1 it reads about a quarter of
/// that. With the shipped drafter on a 2-vCPU AMD EPYC at block 2: draft 0.65–0.83 ms per round
/// against 0.88–1.09 as stored, DFlash / AR 1.01–1.11 (median 1.06 over six runs) against
/// 0.94–1.05 (median 1.00), and MT-Bench τ (block 16) 2.638 against 2.635 as stored
/// (docs/benchmarks/2026-12-02-drafter-round5-h200.md). Output is the target's either way.
const CPU_DEFAULT_DRAFT_WEIGHTS: Option<DType> = Some(DType::Q4_1);

/// Default format of the drafter's layer weights on the CUDA backend: as stored. On an H100 a
/// draft step is not bound by the drafter's bytes: Q4_1 and Q8_0 re-encodings drafted no
/// faster (0.210 / 0.221 ms per round against 0.214 at block 4) and DFlash ran at 1,731–1,749
/// and 1,705–1,716 tok/s against 1,722–1,749 as stored
/// (docs/benchmarks/2026-12-02-h200-int8-default.md).
#[cfg(feature = "cuda")]
const CUDA_DEFAULT_DRAFT_WEIGHTS: Option<DType> = None;

/// How a device runs a drafter where the flags leave it open.
#[derive(Clone, Copy, Debug)]
struct DraftDefaults {
    /// The largest default block (`None`: the drafter's trained block).
    block_cap: Option<usize>,
    /// The draft vocabulary shortlist (0: the full vocabulary).
    vocab: usize,
    /// The format the drafter's layer weights are re-encoded as (`None`: as stored).
    weights: Option<DType>,
}

/// Where the drafter for the default model lives in the source tree.
const DEFAULT_DRAFTER: &str = "models/drafters/smollm2-135m-instruct-dflash";

/// A target model on the device it was loaded for.
pub enum DeviceTarget {
    Cpu(Arc<CpuBackend>, Box<TargetModel<CpuBackend>>),
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaBackend>, Box<TargetModel<CudaBackend>>),
}

/// A loaded target with what is needed to talk to it.
pub struct Bundle {
    pub target: DeviceTarget,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
    pub path: PathBuf,
    /// Human-readable device description (e.g. `cpu avx512 x2 kv f16`).
    pub device: String,
    /// True when the user named no model (the default model runs).
    pub is_default: bool,
}

/// A model ready to generate.
pub struct Loaded {
    pub decoder: Box<dyn Decoder>,
    /// The numeric path of each projection of the target and the drafter.
    pub matmul: Vec<ProjectionPath>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
    pub path: PathBuf,
    pub device: String,
}

/// Where to run: `--device`, else the first CUDA GPU when this build has CUDA and one is
/// usable, else the CPU.
enum DeviceChoice {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(usize),
}

fn choose_device(args: &ModelArgs) -> Result<DeviceChoice> {
    let cuda_ordinal = |d: &str| -> Result<usize> {
        match d.strip_prefix("cuda:") {
            None => Ok(0),
            Some(n) => n
                .parse()
                .map_err(|_| anyhow::anyhow!("device `{d}`: expected cuda:N with N a GPU index")),
        }
    };
    match args.device.as_deref() {
        Some("cpu") => Ok(DeviceChoice::Cpu),
        Some(d) if d == "cuda" || d.starts_with("cuda:") => {
            let ordinal = cuda_ordinal(d)?;
            #[cfg(feature = "cuda")]
            {
                Ok(DeviceChoice::Cuda(ordinal))
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = ordinal;
                bail!("device `{d}`: this build of dflash has no CUDA support (build with --features cuda)")
            }
        }
        Some(d) => bail!("unknown device `{d}` (expected cpu, cuda or cuda:N)"),
        None => {
            #[cfg(feature = "cuda")]
            {
                match dflash_runtime::cuda::CudaBackend::new() {
                    Ok(_) => return Ok(DeviceChoice::Cuda(0)),
                    Err(e) => tracing::info!("no usable CUDA device ({e}); running on the CPU"),
                }
            }
            Ok(DeviceChoice::Cpu)
        }
    }
}

/// Loads the target model the user named, or the default model.
pub fn load_target(args: &ModelArgs) -> Result<Bundle> {
    let choice = choose_device(args)?;
    let (path, is_default) = match &args.model {
        Some(p) => {
            if !p.exists() {
                bail!("model not found: {}", p.display());
            }
            (p.clone(), false)
        }
        None => (ensure_default_model(&Bars::default())?, true),
    };
    let context = || format!("cannot load the model at {}", path.display());
    let (target, device, loaded_parts) = match choice {
        DeviceChoice::Cpu => {
            let mut backend = CpuBackend::from_env(args.cpu_threads())?;
            if let Some(kv) = args.kv_cache {
                backend = backend.with_kv_type(kv.into());
            }
            let backend = Arc::new(backend);
            let device = format!(
                "cpu {} x{} kv {}",
                backend.isa(),
                backend.threads(),
                backend.kv_type()
            );
            let m = load_model(backend.clone(), &path).with_context(context)?;
            let parts = (m.tokenizer, m.template, m.name);
            (DeviceTarget::Cpu(backend, Box::new(m.model)), device, parts)
        }
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(ordinal) => {
            let mut opts = dflash_runtime::cuda::CudaOptions::from_env()?;
            opts.device = ordinal;
            if let Some(kv) = args.kv_cache {
                opts.kv_type = kv.into();
            }
            let backend = Arc::new(CudaBackend::with_options(opts)?);
            let mut device = format!(
                "cuda:{ordinal} {} ({}) kv {}",
                backend.device_name(),
                backend.kernel_target(),
                backend.kv_type()
            );
            if !backend.skipped_launches().is_empty() {
                // Every report names the device: a measurement with launches left out
                // cannot pass for a real one.
                let skipped = backend.skipped_launches().join(", ");
                device.push_str(&format!(" SKIPPING [{skipped}], results wrong"));
            }
            let m = load_model(backend.clone(), &path).with_context(context)?;
            let parts = (m.tokenizer, m.template, m.name);
            (
                DeviceTarget::Cuda(backend, Box::new(m.model)),
                device,
                parts,
            )
        }
    };
    let (tokenizer, template, name) = loaded_parts;
    tracing::info!(model = %name, %device, "model loaded");
    Ok(Bundle {
        target,
        tokenizer,
        template,
        name,
        path,
        device,
        is_default,
    })
}

/// Where this installation may keep the shipped drafter for the default model.
fn default_drafter_candidates() -> Vec<PathBuf> {
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
    candidates.into_iter().flatten().collect()
}

/// The first of `candidates` that holds a drafter, or the warning to give when none does.
pub fn find_drafter(candidates: &[PathBuf]) -> std::result::Result<PathBuf, String> {
    candidates
        .iter()
        .find(|p| p.join("config.json").exists())
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            format!(
                "the shipped DFlash drafter for the default model was not found (looked in {}); \
                 decoding without speculation. Pass --draft DIR, or --no-draft to silence this",
                looked.join(", ")
            )
        })
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
        None if bundle.is_default => match find_drafter(&default_drafter_candidates()) {
            Ok(d) => Ok(Some(d)),
            Err(warning) => {
                tracing::warn!("{warning}");
                Ok(None)
            }
        },
        None => Ok(None),
    }
}

/// A decoder over `bundle`'s target: DFlash with the drafter at `drafter`, else plain.
pub fn decoder(bundle: Bundle, drafter: Option<&Path>, draft: &DraftArgs) -> Result<Loaded> {
    let Bundle {
        target,
        tokenizer,
        template,
        name,
        path,
        device,
        ..
    } = bundle;
    let (decoder, matmul) = match target {
        DeviceTarget::Cpu(b, t) => {
            let defaults = DraftDefaults {
                block_cap: Some(CPU_DEFAULT_BLOCK),
                vocab: CPU_DEFAULT_DRAFT_VOCAB,
                weights: CPU_DEFAULT_DRAFT_WEIGHTS,
            };
            decoder_on(b, *t, &name, drafter, draft, defaults)?
        }
        #[cfg(feature = "cuda")]
        DeviceTarget::Cuda(b, t) => {
            let defaults = DraftDefaults {
                block_cap: Some(CUDA_DEFAULT_BLOCK),
                vocab: CUDA_DEFAULT_DRAFT_VOCAB,
                weights: CUDA_DEFAULT_DRAFT_WEIGHTS,
            };
            decoder_on(b, *t, &name, drafter, draft, defaults)?
        }
    };
    Ok(Loaded {
        decoder,
        matmul,
        tokenizer,
        template,
        name,
        path,
        device,
    })
}

fn decoder_on<B: Backend>(
    backend: Arc<B>,
    target: TargetModel<B>,
    name: &str,
    drafter: Option<&Path>,
    draft: &DraftArgs,
    defaults: DraftDefaults,
) -> Result<(Box<dyn Decoder>, Vec<ProjectionPath>)> {
    let mut paths = target.matmul_paths();
    let Some(dir) = drafter else {
        return Ok((Box::new(ArDecoder::new(target)), paths));
    };
    // The configuration is checked against the target before any weight is read.
    DrafterConfig::read(dir)
        .and_then(|c| c.check_target(target.hidden(), target.n_layers(), target.vocab()))
        .with_context(|| format!("the drafter at {} does not fit {name}", dir.display()))?;
    let weights = draft
        .draft_weights
        .map_or(defaults.weights, DraftWeights::dtype);
    let mut d = DflashDrafter::open_as(backend, dir, weights)
        .with_context(|| format!("cannot load the drafter at {}", dir.display()))?;
    shortlist(&mut d, &target, dir, draft.draft_vocab, defaults.vocab)?;
    paths.extend(d.matmul_paths());
    let trained = d.block_size();
    let block = draft
        .block_size
        .unwrap_or(defaults.block_cap.map_or(trained, |cap| trained.min(cap)));
    let policy = match draft.batch_accept {
        BatchAccept::Clamp => AcceptPolicy::Clamp,
        BatchAccept::PerRow => AcceptPolicy::from_env(),
    };
    let mut dec = DflashDecoder::new(target, d, block, policy)?;
    dec.set_spec_mode(
        draft
            .speculation
            .map_or(SpecMode::Always, Speculation::mode),
    );
    Ok((Box::new(dec), paths))
}

/// Gives drafter `d` (loaded from `dir`) the vocabulary shortlist asked for: `asked` tokens
/// (`--draft-vocab`; an error when its ranking is missing or too short), else `default` tokens
/// when the drafter ships a ranking; 0 keeps the full vocabulary.
fn shortlist<B: Backend>(
    d: &mut DflashDrafter<B>,
    target: &TargetModel<B>,
    dir: &Path,
    asked: Option<usize>,
    default: usize,
) -> Result<()> {
    let file = dir.join(DRAFT_VOCAB_FILE);
    let k = match asked {
        Some(0) => return Ok(()),
        Some(k) => k,
        None if default == 0 || d.cfg.dflash2.is_some() || !file.exists() => return Ok(()),
        None => default,
    };
    let context = || format!("--draft-vocab {k}: the ranking {}", file.display());
    let ranked = DraftVocab::read(&file).with_context(context)?;
    ranked.check(target.vocab()).with_context(context)?;
    // The whole file when the default asks for more than it ranks.
    let k = if asked.is_none() {
        k.min(ranked.len())
    } else {
        k
    };
    let ids = ranked.top(k).with_context(context)?.to_vec();
    let head = target.lm_head_rows(&ids)?;
    d.set_vocab_shortlist(ids, head)
        .with_context(|| format!("the drafter at {}", dir.display()))?;
    tracing::info!(
        tokens = k,
        of = target.vocab(),
        "drafting over a vocabulary shortlist"
    );
    Ok(())
}

/// Loads the model and, unless disabled, its drafter.
pub fn load(args: &ModelArgs, draft: &DraftArgs) -> Result<Loaded> {
    let bundle = load_target(args)?;
    let dir = drafter_dir(draft, &bundle)?;
    decoder(bundle, dir.as_deref(), draft)
}

impl Loaded {
    /// Token ids for a user prompt with an optional system message.
    pub fn prompt_ids(&self, prompt: &str, system: Option<&str>, raw: bool) -> Result<Vec<u32>> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message::new("system", s));
        }
        messages.push(Message::new("user", prompt));
        Ok(conversation_ids(
            &self.tokenizer,
            self.template.as_ref(),
            &messages,
            raw,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_shipped_drafter_gives_a_warning_naming_where_it_looked() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("models/drafters/x");
        let w = find_drafter(std::slice::from_ref(&missing)).unwrap_err();
        assert!(w.contains("not found"), "{w}");
        assert!(w.contains(&missing.display().to_string()), "{w}");
        assert!(w.contains("--no-draft"), "{w}");
        std::fs::create_dir_all(&missing).unwrap();
        std::fs::write(missing.join("config.json"), "{}").unwrap();
        assert_eq!(
            find_drafter(&[d.path().join("nope"), missing.clone()]),
            Ok(missing)
        );
    }
}
