//! Helpers shared by the CUDA test files: the GPU (every format's kernels preloaded, int8
//! activations for every eligible projection) or a
//! printed skip, the CPU reference backend, seeded random inputs and weights, bit views.
#![allow(dead_code)] // each test file uses its own subset

use std::sync::OnceLock;

use dflash_runtime::backend::AttnShape;
use dflash_runtime::cpu::{CpuBackend, Isa, KvType, MatmulMode};
use dflash_runtime::cuda::{CudaBackend, CudaOptions, Int8Policy};
use dflash_runtime::{DType, HostWeight, WeightBytes};
use rand::{Rng, SeedableRng};

/// The int8 activations the tests run: `DFLASH_CUDA_INT8=x2` runs them with two-term
/// activations, anything else with one term (`0` too: the tests exist to run the int8 kernels).
pub fn int8_policy() -> Int8Policy {
    match CudaOptions::from_env().map(|o| o.int8) {
        Ok(Int8Policy::TwoTerms) => Int8Policy::TwoTerms,
        _ => Int8Policy::All,
    }
}

/// The GPU, with int8 activations for every eligible projection ([`int8_policy`]), so the
/// tests' small shapes run the int8 kernels; other roles (`Draft`, `Vocab`) keep f32. Its KV
/// cache holds f32, as the CPU reference's ([`cpu`]).
pub fn gpu() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    gpu_with(&GPU, KvType::F32)
}

/// [`gpu`] with an f16 KV cache (compare with [`cpu_f16`]).
pub fn gpu_f16() -> Option<&'static CudaBackend> {
    static GPU: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    gpu_with(&GPU, KvType::F16)
}

/// The GPU for a KV cache type: [`gpu`] or [`gpu_f16`].
pub fn gpu_kv(kv: KvType) -> Option<&'static CudaBackend> {
    match kv {
        KvType::F32 => gpu(),
        KvType::F16 => gpu_f16(),
    }
}

/// Attention of `n_heads` query heads over `n_kv_heads` KV heads of `head_dim`, scaled by
/// 1/sqrt(head_dim).
pub fn attn_shape(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttnShape {
    AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    }
}

/// Runs `f` on the GPU once per KV cache type (f32, then f16), printing which; does nothing
/// after [`gpu`]'s skip line where there is no GPU.
pub fn on_each_kv_type(f: impl Fn(&'static CudaBackend, KvType)) {
    for kv in [KvType::F32, KvType::F16] {
        let Some(g) = gpu_kv(kv) else { return };
        println!("KV cache {kv}");
        f(g, kv);
    }
}

fn gpu_with(
    cell: &'static OnceLock<Result<CudaBackend, String>>,
    kv: KvType,
) -> Option<&'static CudaBackend> {
    let open = || {
        let opts = CudaOptions {
            int8: int8_policy(),
            kv_type: kv,
            ..CudaOptions::from_env()?
        };
        let b = CudaBackend::with_options(opts)?;
        // Every format's kernels at once (in parallel) rather than one by one on first use.
        b.preload(&DType::ALL)?;
        Ok::<_, dflash_runtime::RuntimeError>(b)
    };
    match cell.get_or_init(|| open().map_err(|e| e.to_string())) {
        Ok(b) => Some(b),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

pub fn cpu() -> &'static CpuBackend {
    static CPU: OnceLock<CpuBackend> = OnceLock::new();
    // The f32 reference path: the GPU multiplies with f32 activations too, and holds an f32
    // KV cache.
    CPU.get_or_init(|| {
        CpuBackend::with_options(2, Isa::detect(), MatmulMode::Reference).with_kv_type(KvType::F32)
    })
}

/// [`cpu`] with an f16 KV cache: values rounded as the GPU's f16 cache rounds them.
pub fn cpu_f16() -> &'static CpuBackend {
    static CPU: OnceLock<CpuBackend> = OnceLock::new();
    CPU.get_or_init(|| {
        CpuBackend::with_options(2, Isa::detect(), MatmulMode::Reference).with_kv_type(KvType::F16)
    })
}

/// The CPU reference for a KV cache type: [`cpu`] or [`cpu_f16`].
pub fn cpu_kv(kv: KvType) -> &'static CpuBackend {
    match kv {
        KvType::F32 => cpu(),
        KvType::F16 => cpu_f16(),
    }
}

pub fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

pub fn random_vec(n: usize, lo: f32, hi: f32, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

/// Random weights of `dtype`: random codes, finite moderate scales.
pub fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> HostWeight {
    let mut r = rng(seed);
    let row_bytes = dtype.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match dtype {
        DType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                c.copy_from_slice(&r.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        DType::F16 => {
            for c in bytes.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(r.random_range(-1.0f32..1.0)));
            }
        }
        DType::BF16 => {
            for c in bytes.chunks_exact_mut(2) {
                let b = half::bf16::from_f32(r.random_range(-1.0f32..1.0));
                c.copy_from_slice(&b.to_bits().to_le_bytes());
            }
        }
        _ => {
            r.fill(&mut bytes[..]);
            let scales: &[usize] = match dtype {
                DType::Q4_0 | DType::Q8_0 => &[0],
                DType::Q4_1 | DType::Q4K => &[0, 2],
                DType::Q6K => &[208],
                _ => unreachable!(),
            };
            for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
                for &o in scales {
                    blk[o..o + 2].copy_from_slice(&f16(r.random_range(-0.05f32..0.05)));
                }
            }
        }
    }
    HostWeight::new(
        format!("w_{dtype}"),
        dtype,
        rows,
        cols,
        WeightBytes::from_vec(bytes),
    )
    .expect("consistent shape")
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
