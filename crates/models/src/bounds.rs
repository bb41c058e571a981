//! How far a numeric path's logits may stray from transformers' (the exact f32 computation),
//! end to end through the default model: the bounds the golden tests hold each path to
//! (models/tests/golden_smollm2.rs on the CPU, engine/tests/cuda_golden_smollm2.rs on the GPU,
//! teacher-forced over the fixture's 320 steps, top-5 logits; the logits span about 10 to 30),
//! and the margin within which `gpu_parity` lets two backends' greedy tokens part.

use dflash_runtime::Activations;

/// Int8 activations for the target's projections (the default on the CPU and the GPU; per
/// 32-value block, the same codes on both). Each product moves by at most its rounding bound
/// (`dflash_runtime::cpu::int8::contract::deviation_bound`, tested per product); through 30
/// layers the fixture's top-5 logits moved by at most 0.62 on the CPU (measured). Pinned at 1.0.
pub const INT8_LOGIT_BOUND: f32 = 1.0;

/// Two-term int8 activations (the CPU's `DFLASH_MATMUL=int8x2`: the codes of x and of its
/// residual per 32-value block). Each product moves by at most its rounding bound
/// (`dflash_runtime::cpu::int8::contract::deviation_bound_x2`, tested per product); through 30
/// layers the fixture's top-5 logits moved by at most 0.0039 on the CPU (measured; the one-term
/// path 0.62), and no greedy token of the fixture's 320 differs from transformers'. Pinned at
/// 0.01.
pub const INT8X2_LOGIT_BOUND: f32 = 0.01;

/// An f16 KV cache (the CPU's default, `--kv-cache f16`): keys and values are rounded to f16
/// once, when written (relative error at most 2^-11), and read back exactly. On the f32 products
/// (`DFLASH_MATMUL=reference`) the fixture's top-5 logits moved by at most 0.0186 (measured; an
/// f32 cache 3.2e-5) and no greedy token of the fixture's 320 differs from transformers'. Pinned
/// at 0.05; a path with an f16 cache is held to its own bound plus this one.
pub const F16_KV_LOGIT_BOUND: f32 = 0.05;

/// f32 activations on the GPU: products and attention add in their own fixed orders (the CPU's
/// f32 path stays within 5e-4 of transformers), and prompt rows take TF32 tensor cores (per
/// product at most (2^-10 + K 2^-22) of Σ|x w|, runtime/kernels/matmul_tc.cu). CPU and GPU f32
/// logits differed by at most 0.036 over 24 prompts × 64 free-running tokens on the H200
/// (docs/benchmarks/2026-12-02-h200-verify-products.md). Pinned at 0.05.
pub const GPU_F32_LOGIT_BOUND: f32 = 0.05;

/// Two-term int8 activations on the GPU: the products land within the CPU two-term path's
/// bound of f32 ([`INT8X2_LOGIT_BOUND`]), and everything else (attention, the TF32 output head,
/// prompt rows) adds as on the GPU f32 path. Measured on the H200: a fixture logit 0.014 from
/// transformers' at the first step checked (where a run against the CPU's 0.01 stopped; the
/// other steps are not yet measured against this bound), and CPU and GPU two-term logits
/// within 0.040 of each other over 24 prompts × 64 tokens
/// (docs/benchmarks/2026-12-04-h200-int8x2.md). Pinned at the sum of the two bounds, 0.06.
pub const GPU_INT8X2_LOGIT_BOUND: f32 = GPU_F32_LOGIT_BOUND + INT8X2_LOGIT_BOUND;

/// The bound of the path whose projections take `activations`, on the GPU (the looser side of
/// a CPU–GPU comparison).
pub fn gpu_logit_bound(activations: Activations) -> f32 {
    match activations {
        Activations::Int8 => INT8_LOGIT_BOUND,
        Activations::Int8x2 => GPU_INT8X2_LOGIT_BOUND,
        Activations::F32 => GPU_F32_LOGIT_BOUND,
    }
}
