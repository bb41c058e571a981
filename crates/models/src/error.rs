//! Errors raised while finding, reading and validating models.

use std::path::PathBuf;

use dflash_runtime::RuntimeError;

/// Why a model could not be loaded or used. Messages name the file, key or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file (bad magic {magic:#010x}; expected \"GGUF\")")]
    NotGguf { path: PathBuf, magic: u32 },
    #[error("{path}: GGUF version {version} is not supported (versions 2 and 3 are)")]
    GgufVersion { path: PathBuf, version: u32 },
    #[error("{path} is truncated or corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("{path}: tensor `{name}` lies outside the file (bytes {start}..{end} of {file_len})")]
    TensorOutOfBounds {
        path: PathBuf,
        name: String,
        start: u64,
        end: u64,
        file_len: u64,
    },
    #[error("model metadata `{key}` is missing")]
    MissingMetadata { key: String },
    #[error("model metadata `{key}` is invalid: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("tensor `{name}` is missing from the model")]
    MissingTensor { name: String },
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor `{name}` has type {dtype}, which dflash-rs does not support (supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("architecture `{arch}` is not supported (supported: {supported})")]
    UnsupportedArchitecture { arch: String, supported: String },
    #[error("{0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("the default model could not be obtained: {0}")]
    Download(String),
    #[error("incompatible drafter: {0}")]
    IncompatibleDrafter(String),
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
