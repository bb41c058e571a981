//! The CPU backend: the reference implementation of every op.
//!
//! Activation tensors are f32; weights are read in their stored format by SIMD kernels chosen
//! at run time (target projections with int8 activations, see `policy` and `int8`); work is split over a worker pool. Every op computes each token independently of the
//! other tokens in the batch, so a row's results do not depend on what it is batched with.

pub mod argmax_screen;
mod attention_tasks;
mod backend;
pub mod gdn;
mod huge;
pub mod int8;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod peaks;
pub mod policy;
pub mod pool;
pub mod tensor;
mod weight;

pub use backend::{CpuBackend, CpuStep};
pub use gdn::CpuGdn;
pub use kv::{CpuKv, KvType};
pub use matmul::Isa;
pub use policy::{CpuPath, MatmulMode};
pub use tensor::CpuTensor;
pub use weight::{on_huge_pages, CpuWeight, Int8Weight};
