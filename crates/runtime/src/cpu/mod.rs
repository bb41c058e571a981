//! The CPU backend: the reference implementation of every op.
//!
//! Activations are f32; weights are read in their stored format by SIMD kernels chosen at run
//! time; work is split over a worker pool. Every op computes each token independently of the
//! other tokens in the batch, so a row's results do not depend on what it is batched with.

mod backend;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod tensor;

pub use backend::{CpuBackend, CpuStep};
pub use kv::CpuKv;
pub use matmul::Isa;
pub use tensor::CpuTensor;
