//! The CUDA backend (feature `cuda`): the [`Backend`](crate::Backend) op set on an NVIDIA GPU.
//!
//! - **Loading.** The driver, NVRTC and (optionally) cuBLAS are loaded at run time through
//!   cudarc's dynamic loading, so building needs no CUDA toolkit. [`CudaBackend::new`] returns
//!   [`RuntimeError::Device`](crate::RuntimeError::Device) naming what is missing (driver,
//!   GPU, NVRTC, cuBLAS) and how to fix it.
//! - **Kernels** are the `.cu` files of `crates/runtime/kernels`, compiled at first use by
//!   NVRTC for the GPU's compute capability (sm_90 on Hopper) and cached on disk (see
//!   [`compile`]).
//! - **Numbers.** Activations are f32; weights stay in their stored format (F32, F16, BF16,
//!   Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) and are decoded in the kernels with the CPU reference's
//!   arithmetic (same fused multiply-adds), so embeddings are bit-identical to the CPU's, and
//!   so is RMS norm (same summation tree). Matmul and attention use their own fixed orders
//!   (close to the CPU, not equal).
//! - **Batch invariance.** Every op computes each token on its own with an order that does
//!   not depend on the batch: a matmul output is owned by one warp whose lanes walk fixed
//!   32-value groups, for any number of rows of x (M = 1 decode, M = 2..16 verify, and
//!   prefill as blocks of 16 rows of the same kernel); attention tiles keys at fixed offsets
//!   from each token's `kv_start`. So verify equals decode bit for bit, as the lossless
//!   contract needs. (The optional cuBLAS prefill path, `DFLASH_CUDA_GEMM=cublas`, trades
//!   that for speed on large M.)
//! - **KV cache**: per row, one allocation holding every layer's K and V, position-major;
//!   the kernels find rows through a device table (see [`kv`]).
//! - **Execution**: one stream, in order; cudarc's event tracking is off (it would record
//!   events around every launch for multi-stream safety that one stream does not need).
//!   Ops that return data to the host (`to_host`, `argmax_rows`) wait for the stream.
//!   Buffers are reused by capacity (`reshape`, metadata pool, scratch), so a steady decode
//!   loop does not allocate device memory.

mod backend;
pub mod compile;
mod device;
pub mod kv;
mod tensor;

pub use backend::CudaBackend;
pub use device::{CudaOptions, PrefillGemm};
pub use kv::CudaKv;
pub use tensor::{CudaMeta, CudaTensor, CudaWeight};
