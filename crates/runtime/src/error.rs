//! Errors raised by the runtime: shape and format mismatches, unsupported types, devices.

use crate::dtype::DType;

/// Everything the runtime can refuse.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("tensor `{name}`: {cols} columns is not a multiple of the {dtype} block size {block}")]
    RaggedBlocks {
        name: String,
        dtype: DType,
        cols: usize,
        block: usize,
    },
    #[error(
        "tensor `{name}`: expected {expected} bytes for {dtype} [{rows} x {cols}], found {found}"
    )]
    ByteLength {
        name: String,
        dtype: DType,
        rows: usize,
        cols: usize,
        expected: usize,
        found: usize,
    },
    #[error("tensor `{name}`: {dtype} weights are not supported by the {backend} backend")]
    UnsupportedWeight {
        name: String,
        dtype: DType,
        backend: &'static str,
    },
    #[error("recurrent state: {0}")]
    State(String),
    #[error("device error: {0}")]
    Device(String),
}
