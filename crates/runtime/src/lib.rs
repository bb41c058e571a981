//! dflash-runtime: what a device can do.
//!
//! Inference-only tensors, the weight formats we read directly (f32, f16, bf16 and the GGUF
//! block formats), the [`Backend`] trait that model code is written against, and the CPU
//! backend, which is the reference every other backend is tested against.

pub mod backend;
pub mod choice;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod kv_type;
pub mod quant;
pub mod weight;

pub use backend::{
    Activations, Backend, GdnShape, Rope, RowSpan, TokenMeta, WeightPath, WeightRole,
};
pub use dtype::DType;
pub use error::RuntimeError;
pub use kv_type::KvType;
pub use weight::{HostWeight, WeightBytes};
