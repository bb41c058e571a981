//! Command-line arguments shared by the subcommands.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use dflash_engine::{SamplingParams, SpecMode};

/// Which model to run and where.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A GGUF file or a Hugging Face model directory (default: SmolLM2-135M-Instruct Q4_1,
    /// downloaded to the cache on first use).
    #[arg(short, long, env = "DFLASH_MODEL")]
    pub model: Option<PathBuf>,
    /// Worker threads for the CPU backend (0: one per core; more than the cores is capped).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
    /// Device to run on: `cpu`, or `cuda` / `cuda:N` (default: cuda when available, else cpu).
    #[arg(long)]
    pub device: Option<String>,
    /// How the KV cache holds keys and values: f16 (half the bytes attention reads and half the
    /// memory a position takes; logits within 0.05 of f32's on the default model) or f32.
    /// Default: f16 on the CPU, f32 on a GPU.
    #[arg(long, value_enum, env = "DFLASH_KV_CACHE")]
    pub kv_cache: Option<KvCache>,
}

/// `--kv-cache` values.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCache {
    F16,
    F32,
}

impl From<KvCache> for dflash_runtime::KvType {
    fn from(k: KvCache) -> Self {
        match k {
            KvCache::F16 => dflash_runtime::KvType::F16,
            KvCache::F32 => dflash_runtime::KvType::F32,
        }
    }
}

impl ModelArgs {
    /// `--threads`, capped at the cores this process may use: more threads than cores only
    /// adds contention to a spinning pool (and thousands of them exhausted the machine).
    pub fn cpu_threads(&self) -> usize {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.threads > cores {
            tracing::warn!(
                "--threads {} is more than the {cores} cores available; using {cores}",
                self.threads
            );
            cores
        } else {
            self.threads
        }
    }
}

/// Speculative decoding options.
#[derive(Args, Clone, Debug)]
pub struct DraftArgs {
    /// A DFlash drafter directory (config.json + safetensors). The default model uses the
    /// shipped drafter unless --no-draft is given.
    #[arg(long, env = "DFLASH_DRAFT", conflicts_with = "no_draft")]
    pub draft: Option<PathBuf>,
    /// Plain autoregressive decoding, no drafter.
    #[arg(long)]
    pub no_draft: bool,
    /// Draft block size (at most the drafter's trained block size; default: at most 2 on the
    /// CPU, at most 4 on a GPU — the best measured with the shipped drafter).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Draft over the N most frequent target tokens only (the ranking shipped beside the
    /// drafter as draft_vocab.safetensors); 0: the full vocabulary. Default: 4096 on the CPU
    /// when the drafter ships a ranking, the full vocabulary on a GPU. Output is unchanged:
    /// the target verifies every draft.
    #[arg(long, value_name = "N")]
    pub draft_vocab: Option<usize>,
    /// How the drafter's layer weights are held: as stored (bf16) or re-encoded at load as
    /// Q8_0 (about half the bytes a draft step reads), Q4_1 or Q4_0 (about a quarter). Default:
    /// Q4_1 on the CPU, as stored on a GPU. Output is unchanged either way: the target
    /// verifies every draft.
    #[arg(long, value_enum)]
    pub draft_weights: Option<DraftWeights>,
    /// How a batch commits accepted tokens: each row its own count, or all rows the smallest.
    #[arg(long, value_enum, default_value_t = BatchAccept::PerRow)]
    pub batch_accept: BatchAccept,
    /// `auto`: greedy decoding drafts only while drafting is measured to be faster than plain
    /// steps (default for `generate`); `always`: every round drafts (default for `bench` and
    /// `eval`, which measure the drafter).
    #[arg(long, value_enum)]
    pub speculation: Option<Speculation>,
}

/// `--draft-weights` values.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftWeights {
    Stored,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q4_0")]
    Q4_0,
}

impl DraftWeights {
    /// The format the drafter's layer weights are re-encoded as (`None`: as stored).
    pub fn dtype(self) -> Option<dflash_runtime::DType> {
        match self {
            DraftWeights::Stored => None,
            DraftWeights::Q8_0 => Some(dflash_runtime::DType::Q8_0),
            DraftWeights::Q4_1 => Some(dflash_runtime::DType::Q4_1),
            DraftWeights::Q4_0 => Some(dflash_runtime::DType::Q4_0),
        }
    }
}

/// `--speculation` values.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speculation {
    Auto,
    Always,
}

impl Speculation {
    pub fn mode(self) -> SpecMode {
        match self {
            Speculation::Auto => SpecMode::Auto,
            Speculation::Always => SpecMode::Always,
        }
    }
}

/// `--batch-accept` values.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchAccept {
    PerRow,
    Clamp,
}

/// How tokens are chosen.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1: off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub min_p: f32,
    /// Penalise tokens already present (1: off; HF semantics).
    #[arg(
        long,
        alias = "repeat-penalty",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repetition_penalty: f32,
    /// Subtract this times a token's count so far from its logit (0: off; OpenAI semantics).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
    /// Subtract this from the logit of every token seen so far (0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    /// Random seed; the same seed gives the same output.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> anyhow::Result<SamplingParams> {
        let p = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            seed: self.seed,
            logprobs: None,
            keep_logits: false,
        };
        p.validate()
            .map_err(|e| anyhow::anyhow!("invalid sampling options: {e}"))?;
        Ok(p)
    }
}

/// Output formats of `generate`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// The answer on stdout, statistics on stderr.
    Text,
    /// One JSON object: text, tokens, stats.
    Json,
    /// One JSON object per line (per input row with --batch).
    Jsonl,
}
