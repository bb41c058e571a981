//! SmolLM2-135M-Instruct (GGUF Q4_1) on the GPU against transformers: the golden fixture's
//! greedy tokens teacher-forced through the CUDA backend (each prompt as prompt rows, so on the
//! tensor-core prefill kernels from sm_80; then one decode step per token), its top-5 logits
//! compared at every checked step, on both numeric paths:
//!
//! - the default, int8 activations for the target's projections (`Int8Policy::All`, the CPU's
//!   rule and codes): held to the int8 path's end-to-end bound, as the CPU is
//!   (models/tests/golden_smollm2.rs);
//! - two-term int8 activations (`DFLASH_CUDA_INT8=x2`, the CPU's `int8x2` codes): held to the
//!   two-term path's bound;
//! - f32 activations (`DFLASH_CUDA_INT8=0`): held to the GPU f32 path's bound;
//! - an f16 KV cache (`--kv-cache f16`), on the f32 and the default path: held to that path's
//!   bound plus the f16 cache's
//!
//! (all stated and derived in `dflash_models::bounds`). Every path but the f16 ones pins an f32
//! KV cache.
//!
//! A greedy token may differ from the fixture's only where the fixture's top-1/top-2 margin is
//! below twice the path's bound. The model comes from the cache (`ensure_default_model`; on
//! a machine without network, put the checked file in `$DFLASH_CACHE_DIR`).
//!
//! Opens the GPU first and prints "skipped: no CUDA device (<reason>)" without one.
#![cfg(feature = "cuda")]

#[path = "../../models/tests/golden/mod.rs"]
mod golden;

use std::sync::Arc;

use dflash_models::bounds::{
    F16_KV_LOGIT_BOUND, GPU_F32_LOGIT_BOUND, GPU_INT8X2_LOGIT_BOUND, INT8_LOGIT_BOUND,
};
use dflash_models::default_model::{ensure_default_model, Silent};
use dflash_models::load_model;
use dflash_runtime::cuda::{CudaBackend, CudaOptions, Int8Policy};
use dflash_runtime::KvType;
use golden::walk;

fn check(int8: Int8Policy, kv_type: KvType, bound: f32) {
    let opts = CudaOptions {
        int8,
        kv_type,
        ..CudaOptions::from_env().expect("CUDA options")
    };
    let gpu = match CudaBackend::with_options(opts) {
        Ok(b) => Arc::new(b),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return;
        }
    };
    let path = ensure_default_model(&Silent).expect(
        "the default model must be obtainable: downloaded, or a copy in $DFLASH_CACHE_DIR \
         (tools/gpu_check.sh: GPU_CHECK_MODEL=<file>)",
    );
    let mut m = load_model(gpu, &path).unwrap();
    let int8_projections = m
        .model
        .matmul_paths()
        .iter()
        .filter(|p| p.path.activations != dflash_runtime::Activations::F32)
        .count();
    assert_eq!(
        int8_projections > 0,
        int8.takes(),
        "the projections' activation type follows the policy"
    );
    let w = walk(&mut m, |a, b| (a - b).abs() <= bound);
    println!("{int8:?}, KV cache {kv_type}: {}", w.flips_within(bound));
}

#[test]
fn int8_default_path_stays_within_the_int8_bound_of_transformers() {
    assert_eq!(CudaOptions::default().int8, Int8Policy::All);
    check(Int8Policy::All, KvType::F32, INT8_LOGIT_BOUND);
}

#[test]
fn two_term_int8_path_stays_within_its_bound_of_transformers() {
    check(Int8Policy::TwoTerms, KvType::F32, GPU_INT8X2_LOGIT_BOUND);
}

#[test]
fn f32_path_stays_within_its_bound_of_transformers() {
    check(Int8Policy::Off, KvType::F32, GPU_F32_LOGIT_BOUND);
}

#[test]
fn f16_kv_cache_stays_within_its_bound_of_transformers() {
    check(
        Int8Policy::Off,
        KvType::F16,
        GPU_F32_LOGIT_BOUND + F16_KV_LOGIT_BOUND,
    );
    check(
        Int8Policy::All,
        KvType::F16,
        INT8_LOGIT_BOUND + F16_KV_LOGIT_BOUND,
    );
}
