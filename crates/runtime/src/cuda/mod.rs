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
//!   (close to the CPU, not equal). The target's Q4_0/Q4_1/Q8_0 projections multiply
//!   int8-quantized activations instead, as the CPU does ([`Int8Policy`]: by default every one
//!   the CPU quantizes for; `DFLASH_CUDA_INT8=0` keeps f32): x is quantized per 32-value block exactly as on the CPU (same codes and
//!   scales), then `mmq_*` kernels take exact integer dot products (dp4a) per 32-value group;
//!   from 5 rows of x (verify blocks of 5 to 16, batched decode) `mmqt_*` take the same integer sums on tensor
//!   cores (`mma.m16n8k32.s8`) and add them in the dp4a kernels' float order, so the bits
//!   are the same for every M.
//! - **Batch invariance.** Every op computes each token on its own with an order that does
//!   not depend on the batch: a matmul output is owned by one warp whose lanes walk fixed
//!   32-value groups, for any number of rows of x (M = 1 decode, M = 2..16 verify, and
//!   prefill as blocks of 16 rows of the same kernel, 8 for two-term int8 products on tensor
//!   cores); attention tiles keys at fixed offsets
//!   from each token's `kv_start`. So verify equals decode bit for bit, as the lossless
//!   contract needs. (The optional cuBLAS prefill path, `DFLASH_CUDA_GEMM=cublas`, trades
//!   that for speed on large M.)
//! - **KV cache**: per row, one allocation holding every layer's K and V, position-major;
//!   the kernels find rows through a device table (see [`kv`]).
//! - **Execution**: one stream, in order; cudarc's event tracking is off (it would record
//!   events around every launch for multi-stream safety that one stream does not need).
//!   Ops that return data to the host (`to_host`, `argmax_rows`, token choice) wait for the
//!   stream.
//!   Buffers are reused by capacity (`reshape`, metadata pool, scratch), so a steady decode
//!   loop does not allocate device memory.

//!
//! # Kernel shapes
//!
//! - **matmul** (`kernels/matmul.cu`): blocks of 4 warps; a warp owns R weight rows and MT
//!   rows of x; lane 4j + s takes quarter s of group j of every run of 8 consecutive 32-value
//!   groups (coalesced loads, all lanes busy from K = 256), decodes it once and multiplies it
//!   with the MT rows. Per output: lane partial sums with fma in group order, then a fixed
//!   xor-butterfly, whatever M, MT, R or the grid. Tiles: M <= 8 takes the smallest of MT =
//!   1, 2, 4, 8 that holds it; 9..=16 rows run as two tiles of 8 (more blocks for small N);
//!   M > 16 as tiles of 16 (grid.y). **Large M uses that same kernel by default** (full batch
//!   invariance, like the CPU backend); the cuBLAS path (dequantize a panel of weight rows to
//!   f32, SGEMM with pedantic math, i.e. no TF32) is opt-in because it makes prompt rows
//!   depend on the chunk size.
//! - **attention** (`kernels/attention.cu`, `cuda/attention.rs`): a block per (token, KV
//!   head, key split), the GQA group's query heads sharing each K/V load; keys in tiles of 32
//!   at fixed offsets from `kv_start`, tile t of a split to slot t mod 8, online softmax per
//!   slot (a lane scores one key; lanes then own head dimensions for the value sum), slots s
//!   and s + 4 merged, then the four pairs in order, then the splits in split order (a merge
//!   launch, or for prompt rows the split kernel's last block). Launches of up to 4 tokens
//!   give a block 8 warps (a slot each), larger ones 4 (two slots each): same bits. Any
//!   context length, head_dim <= 256.
//! - **RMS norm**: sixteen lanes per group, reproducing the CPU's 16-lane sum and halving tree.
//! - element-wise ops, RoPE, gathers and KV copies: simple grid-stride kernels.
//! - **token choice** (`kernels/sample.cu`, `cuda/sample.rs`): argmax in two stages (blocks
//!   of 4,096 columns, then a merge per row); sampling, drafts and DFlash verification one
//!   block per logits row, reproducing the engine's host definition (see the file's header
//!   for the numbers).
//! - Gated DeltaNet (`kernels/gdn.cu`, see [`gdn`](self::gdn)): causal conv, one thread per
//!   channel walking its row's tokens; the gated delta rule, one block per (row, v head),
//!   a thread per state column (k_dim values in registers) walking the tokens in order.
//!
//! # Environment
//!
//! `DFLASH_CUDA_DEVICE` (ordinal, default 0); `DFLASH_CUDA_GEMM` (`tensor` default, `kernel`,
//! `cublas` or `cublas:<min rows>`); `DFLASH_CUDA_FUSE_ROPE=0` (RoPE and the KV write as their
//! own launch, not in the q/k/v products' epilogue); `DFLASH_CUDA_FUSE_MERGE` (`auto` default
//! = prompt launches of 17+ tokens, a token count, or `0`: when the attention merges its splits
//! inside the split kernel, same bits); `DFLASH_CUDA_ATT_WIDE` (`auto` default = launches of up
//! to 4 tokens, a token count, or `0`: which attention launches give a split block a warp per
//! slot, same bits); `DFLASH_CUDA_INT8` (`1` default, also `auto`; `x2`:
//! two-term int8 activations, the CPU's `int8x2`; `0`: f32 activations for the target's
//! projections too, [`Int8Policy`]);
//! `DFLASH_CUDA_INT8_MMA` (`auto` default = from 5 rows of x, a row count, or `0`: when int8
//! products run on integer tensor cores, same bits); `DFLASH_CUDA_INT8_MMA_WIDTH` (`auto`
//! default, `4`, `2` or `1`: column tiles of 8 per block of those kernels, same bits);
//! `DFLASH_CUDA_FLOAT_MMA=0` (the output head of Q4_0/Q4_1/Q8_0 weights on the CUDA-core
//! kernels instead of TF32 tensor cores with x split in two terms; other bits, still one
//! kernel for every M);
//! `DFLASH_CUDA_ARCH`
//! (compile for another
//! `sm_XY`);
//! `DFLASH_CUDA_MM_TILE` (force one matmul tile, for debugging); `DFLASH_CUDA_INCLUDE`,
//! `CUDA_HOME`, `CUDA_PATH` (NVRTC include folders); `DFLASH_CACHE_DIR` /
//! `XDG_CACHE_HOME` / `HOME` (kernel cache root), `DFLASH_CUDA_NO_CACHE=1`.

mod attention;
mod backend;
pub mod compile;
mod device;
mod gdn;
mod graph;
mod int8;
mod int8_x;
pub mod kv;
mod l2_ahead;
pub mod pack;
mod profile;
mod qkv_rope;
pub mod resources;
mod rope_kv;
mod sample;
mod tensor;

pub use attention::FUSE_MERGE_MIN_ROWS;
pub use backend::CudaBackend;
pub use device::{CudaOptions, PrefillGemm};
pub use gdn::CudaGdn;
pub use int8::Int8Policy;
pub use kv::CudaKv;
pub use profile::{KernelClassTime, ProfileKeys};
pub use tensor::{CudaMeta, CudaStep, CudaTensor, CudaWeight};
