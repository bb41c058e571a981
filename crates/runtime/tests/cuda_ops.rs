//! The CUDA backend against the CPU backend, op by op, on random inputs; and the batch
//! invariance the lossless contract needs (a row's matmul and attention results are
//! bit-identical whatever it is batched with).
//!
//! Every test first opens the GPU and prints "skipped: no CUDA device (<reason>)" and returns
//! when there is none, so `cargo test --features cuda` passes on machines without one.
//! `kernels_compile_with_nvrtc` needs only NVRTC (no GPU).
#![cfg(feature = "cuda")]

mod common;

use common::{bits, cpu, cpu_kv, gpu, gpu_f16, on_each_kv_type, random_vec, random_weight, rng};

use dflash_runtime::backend::{Activations, AttnShape, RopeStyle};
use dflash_runtime::cpu::int8::quantize::{QuantRows, Terms};
use dflash_runtime::cpu::int8::reference as int8_reference;
use dflash_runtime::cpu::{CpuBackend, CpuWeight};
use dflash_runtime::cuda::{compile, resources, CudaBackend, CudaOptions, Int8Policy, PrefillGemm};
use dflash_runtime::{Backend, DType, HostWeight, KvType, RowSpan, TokenMeta, WeightRole};
use rand::Rng;

/// Asserts |a - b| <= abs + rel * scale[i] element-wise.
fn assert_close(what: &str, got: &[f32], want: &[f32], scale: &[f32], rel: f32, abs: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0f32);
    for i in 0..got.len() {
        let err = (got[i] - want[i]).abs();
        let tol = abs + rel * scale[i];
        if err.is_nan() || err > tol {
            panic!(
                "{what}: element {i}: gpu {} vs cpu {} (error {err}, tolerance {tol})",
                got[i], want[i]
            );
        }
        if err > worst.1 {
            worst = (i, err);
        }
    }
    println!("{what}: max |error| {:.3e} at {}", worst.1, worst.0);
}

fn magnitudes(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| x.abs().max(1.0)).collect()
}

#[test]
fn missing_pieces_are_errors_not_panics() {
    // On a machine without a GPU this must come back as an error with a reason; with one,
    // creation succeeds. Either way it must not panic.
    match CudaBackend::new() {
        Ok(b) => println!(
            "CUDA device: {} (compute {:?}, kernels {})",
            b.device_name(),
            b.compute_capability(),
            b.kernel_target()
        ),
        Err(e) => {
            let msg = e.to_string();
            println!("skipped: no CUDA device ({msg})");
            assert!(
                msg.len() > 20,
                "the error should say what is missing: {msg}"
            );
        }
    }
}

#[test]
fn kernels_compile_with_nvrtc() {
    if !compile::nvrtc_available() {
        println!("skipped: NVRTC not found ({})", compile::NVRTC_HINT);
        return;
    }
    let (major, minor) = compile::nvrtc_version().expect("NVRTC version");
    let archs = compile::supported_archs().expect("NVRTC architectures");
    println!("NVRTC {major}.{minor}; real architectures {archs:?}");
    println!("include dirs: {:?}", compile::include_dirs());
    for arch in [90u32] {
        let started = std::time::Instant::now();
        let sizes = compile::compile_all(arch).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
        for (name, size) in &sizes {
            println!("sm_{arch}: {name}.cu -> {size} bytes of CUBIN");
        }
        println!(
            "sm_{arch}: all kernels compiled in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        // ptxas's report reads for every kernel of a module (cuda_kernel_resources).
        let att = resources::module_resources(compile::Module::Attention(KvType::F32), arch)
            .unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
        for k in &att {
            assert!(
                (1..=255).contains(&k.registers),
                "{}: {} registers",
                k.name,
                k.registers
            );
        }
        for name in [
            "attention_merge",
            "attention_merge_q8",
            "attention_split_2_3",
        ] {
            assert!(att.iter().any(|k| k.name == name), "no {name} in {att:?}");
        }
        let split = att
            .iter()
            .find(|k| k.name == "attention_split_2_3")
            .unwrap();
        assert!(
            split.shared > 0,
            "{split:?}: the split kernel stages q in shared memory"
        );
        // The PTX fallback must compile too.
        let t = compile::Target { arch, cubin: false };
        for m in compile::Module::all() {
            let img = compile::compile(m, t).unwrap_or_else(|e| panic!("compute_{arch}: {e}"));
            assert!(!img.is_empty());
        }
    }
}

#[test]
fn upload_reshape_and_copies() {
    let Some(g) = gpu() else { return };
    let data = random_vec(6 * 7, -3.0, 3.0, 1);
    let t = g.upload(&data, 6, 7);
    assert_eq!(g.shape(&t), (6, 7));
    assert_eq!(bits(&g.to_host(&t)), bits(&data));
    let mut out = vec![9.0; 3];
    g.copy_to_host(&t, &mut out);
    assert_eq!(bits(&out), bits(&data));

    let mut z = g.tensor(10, 10);
    assert_eq!(g.to_host(&z), vec![0.0; 100]);
    let cap = z.capacity();
    g.reshape(&mut z, 5, 4);
    assert_eq!(g.shape(&z), (5, 4));
    assert_eq!(z.capacity(), cap, "shrinking must keep the buffer");
    g.reshape(&mut z, 10, 10);
    assert_eq!(
        z.capacity(),
        cap,
        "growing within capacity must keep the buffer"
    );
    g.reshape(&mut z, 20, 20);
    assert!(z.capacity() >= 400);
    let e = g.tensor(0, 16);
    assert_eq!(g.to_host(&e), Vec::<f32>::new());
}

#[test]
fn embed_every_dtype_bit_exact() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let cols = if dtype.block_len() == 256 { 512 } else { 96 };
        let w = random_weight(dtype, 50, cols, 100 + i as u64);
        let ids: Vec<u32> = vec![0, 49, 7, 7, 23, 1];
        let (wg, wc) = (
            g.upload_weight(&w, WeightRole::Embedding).unwrap(),
            c.upload_weight(&w, WeightRole::Embedding).unwrap(),
        );
        let mut og = g.tensor(0, cols);
        let mut oc = c.tensor(0, cols);
        g.embed(&wg, &ids, &mut og);
        c.embed(&wc, &ids, &mut oc);
        assert_eq!(g.shape(&og), (ids.len(), cols));
        assert_eq!(
            bits(&g.to_host(&og)),
            bits(&c.to_host(&oc)),
            "embed {dtype} differs from the CPU"
        );
    }
    // Plain float rows that are not whole groups.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let w = random_weight(dtype, 9, 40, 7);
        let ids = [3u32, 8, 0];
        let mut og = g.tensor(0, 0);
        let mut oc = cpu().tensor(0, 0);
        g.embed(
            &g.upload_weight(&w, WeightRole::Embedding).unwrap(),
            &ids,
            &mut og,
        );
        c.embed(&CpuWeight::f32(w.clone()), &ids, &mut oc);
        assert_eq!(
            bits(&g.to_host(&og)),
            bits(&c.to_host(&oc)),
            "embed {dtype} x40"
        );
    }
}

/// Σ_k |w[n][k] x[m][k]| for every output: the scale rounding errors are measured against.
fn product_magnitudes(w: &HostWeight, x: &[f32], m: usize) -> Vec<f32> {
    let wf = w.to_f32();
    let k = w.cols;
    let mut out = vec![0f32; m * w.rows];
    for i in 0..m {
        for j in 0..w.rows {
            let s: f64 = (0..k)
                .map(|kk| (wf[j * k + kk] as f64 * x[i * k + kk] as f64).abs())
                .sum();
            out[i * w.rows + j] = s as f32;
        }
    }
    out
}

/// Keeps the first (largest) batch's outputs in `full`; a later, smaller batch's must equal
/// its leading rows bit for bit.
fn first_or_same_rows(full: &mut Vec<f32>, got: Vec<f32>, what: &str) {
    if full.is_empty() {
        *full = got;
    } else {
        assert_eq!(
            bits(&got),
            bits(&full[..got.len()]),
            "{what}: rows differ from the same rows of the first, larger batch"
        );
    }
}

/// Each of `rows` of `x` (rows of `w.cols` values) multiplied alone (decode) gives the bits of
/// the same row in `batch`, the product of many rows.
fn assert_rows_alone_equal(
    g: &CudaBackend,
    w: &<CudaBackend as Backend>::Weight,
    x: &[f32],
    batch: &[f32],
    rows: &[usize],
    what: &str,
) {
    let (k, n) = (w.cols, w.rows);
    for &r in rows {
        let mut o = g.tensor(0, 0);
        g.matmul(&g.upload(&x[r * k..(r + 1) * k], 1, k), w, &mut o);
        assert_eq!(
            bits(&g.to_host(&o)),
            bits(&batch[r * n..(r + 1) * n]),
            "{what}: row {r} alone differs from row {r} of the batch"
        );
    }
}

/// 100 random activation rows of `k` values, with an all-zero block (scale 0) in row 3 and a
/// block of exact ties (x * 127 / amax = j + 0.5) in row 4.
fn activation_rows(k: usize, seed: u64) -> Vec<f32> {
    let mut x = random_vec(100 * k, -2.0, 2.0, seed);
    x[3 * k + 64..3 * k + 96].fill(0.0);
    for j in 0..32 {
        x[4 * k + j] = if j == 0 { 127.0 } else { j as f32 - 0.5 } / 64.0;
    }
    x
}

#[test]
fn matmul_every_dtype_matches_cpu_and_is_batch_invariant() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let ms = [1usize, 2, 5, 16, 100];
    // Projections of the int8 formats take the int8 kernels; drafter weights the f32 ones on
    // CUDA cores, the output head the f32 ones on TF32 tensor cores (x split in two terms).
    let cases = DType::ALL.into_iter().enumerate().flat_map(|(di, d)| {
        let roles: &[WeightRole] = if matches!(d, DType::Q4_0 | DType::Q4_1 | DType::Q8_0) {
            &[WeightRole::Projection, WeightRole::Draft, WeightRole::Vocab]
        } else {
            &[WeightRole::Projection]
        };
        roles.iter().map(move |&r| (di, d, r))
    });
    for (di, dtype, role) in cases {
        // More than 32 groups (two staging chunks, the second partial) and an odd row count.
        let k = if dtype.block_len() == 256 { 1280 } else { 1088 };
        let n = 67;
        let w = random_weight(dtype, n, k, 200 + di as u64);
        let wg = g.upload_weight(&w, role).unwrap();
        let terms = common::int8_policy().terms();
        let int8 =
            g.weight_path(&wg).activations == [Activations::Int8, Activations::Int8x2][terms - 1];
        assert_eq!(
            int8,
            role == WeightRole::Projection
                && matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0),
            "{dtype} as {role:?}: int8 activations exactly for projections in Q4_0, Q4_1, Q8_0"
        );
        let x_all = activation_rows(k, 300 + di as u64);
        let mag = product_magnitudes(&w, &x_all, 100);
        let mut full = Vec::new();
        for &m in ms.iter().rev() {
            let x = &x_all[..m * k];
            let xg = g.upload(x, m, k);
            let mut og = g.tensor(0, 0);
            g.matmul(&xg, &wg, &mut og);
            assert_eq!(g.shape(&og), (m, n));
            let got = g.to_host(&og);
            // Int8 products against the CPU's int8 reference (same codes and integer block
            // dots; only the float accumulation order differs), the rest against f32.
            let want = if int8 {
                let terms = [Terms::One, Terms::Two][terms - 1];
                let mut q = QuantRows::default();
                q.quantize_terms(x, m, k, terms, &mut Vec::new());
                let mut out = vec![0f32; m * n];
                int8_reference::matmul_terms(&w, &q, terms, &mut out);
                out
            } else {
                let xc = c.upload(x, m, k);
                let mut oc = c.tensor(0, 0);
                c.matmul(&xc, &CpuWeight::f32(w.clone()), &mut oc);
                c.to_host(&oc)
            };
            assert_close(
                &format!("matmul {dtype} M={m}"),
                &got,
                &want,
                &mag[..m * n],
                2e-6,
                1e-6,
            );
            if m == 5 {
                // The add epilogue: bit-identical to the product then `add`.
                let base = random_vec(m * n, -3.0, 3.0, 17);
                let mut fused = g.upload(&base, m, n);
                let mut scratch = g.tensor(0, 0);
                g.matmul_add(&xg, &wg, &mut fused, &mut scratch);
                let mut sep = g.upload(&base, m, n);
                g.add(&mut sep, &og);
                assert_eq!(
                    bits(&g.to_host(&fused)),
                    bits(&g.to_host(&sep)),
                    "matmul_add {dtype} as {role:?}"
                );
            }
            first_or_same_rows(&mut full, got, &format!("matmul {dtype} M={m}"));
        }
        // Single rows (decode) against the same rows inside the M=100 batch (prefill chunks
        // of 16: rows 15, 16 and 99 sit at chunk edges).
        let what = format!("matmul {dtype} as {role:?}");
        assert_rows_alone_equal(g, &wg, &x_all, &full, &[0, 7, 15, 16, 31, 50, 99], &what);
    }
}

/// Two-term int8 activations (`Int8Policy::TwoTerms`, the CPU's `int8x2`): the products of
/// Q4_0, Q4_1 and Q8_0 projections match the CPU's two-term int8 reference (same codes of x and
/// of its residual, the two products added; only the float accumulation order differs), land
/// far closer to the f32 product than one term, and give a row the same bits at every M: the
/// dp4a tiles (1..4 rows), the integer tensor cores (5 and up, 8 rows of x a block) and single
/// rows alike.
#[test]
fn matmul_two_term_int8_matches_cpu_and_is_batch_invariant() {
    if gpu().is_none() {
        return;
    }
    let open = |int8| {
        CudaBackend::with_options(CudaOptions {
            int8,
            ..CudaOptions::from_env().unwrap()
        })
        .unwrap()
    };
    let (g, one) = (&open(Int8Policy::TwoTerms), &open(Int8Policy::All));
    let c = cpu();
    let (k, n) = (1088usize, 67usize);
    for (di, dtype) in [DType::Q4_0, DType::Q4_1, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        let w = random_weight(dtype, n, k, 400 + di as u64);
        let wg = g.upload_weight(&w, WeightRole::Projection).unwrap();
        let w1 = one.upload_weight(&w, WeightRole::Projection).unwrap();
        assert_eq!(g.weight_path(&wg).activations, Activations::Int8x2);
        let x_all = activation_rows(k, 500 + di as u64);
        let mag = product_magnitudes(&w, &x_all, 100);
        let mut full = Vec::new();
        for &m in [100usize, 1, 2, 3, 4, 5, 8, 9, 16, 17].iter() {
            let x = &x_all[..m * k];
            let product = |b: &CudaBackend, w: &_| {
                let mut o = b.tensor(0, 0);
                b.matmul(&b.upload(x, m, k), w, &mut o);
                b.to_host(&o)
            };
            let got = product(g, &wg);
            let mut q = QuantRows::default();
            q.quantize_terms(x, m, k, Terms::Two, &mut Vec::new());
            let mut want = vec![0f32; m * n];
            int8_reference::matmul_terms(&w, &q, Terms::Two, &mut want);
            let what = format!("two-term matmul {dtype} M={m}");
            assert_close(&what, &got, &want, &mag[..m * n], 2e-6, 1e-6);
            // Against the f32 product: the worst error, relative to Σ|w x|, far below one
            // term's (the residual's step is 1/254 of x's or less).
            let xc = c.upload(x, m, k);
            let mut oc = c.tensor(0, 0);
            c.matmul(&xc, &CpuWeight::f32(w.clone()), &mut oc);
            let exact = c.to_host(&oc);
            let worst = |v: &[f32]| {
                v.iter()
                    .zip(&exact)
                    .zip(&mag)
                    .map(|((a, b), s)| (a - b).abs() / s.max(1e-30))
                    .fold(0f32, f32::max)
            };
            let (e2, e1) = (worst(&got), worst(&product(one, &w1)));
            println!("{what}: worst error / Σ|wx|: two terms {e2:.2e}, one term {e1:.2e}");
            assert!(e2 * 20.0 < e1, "{what}: two terms {e2:e} vs one {e1:e}");
            first_or_same_rows(&mut full, got, &what);
        }
        let what = format!("two-term matmul {dtype}");
        assert_rows_alone_equal(g, &wg, &x_all, &full, &[0, 7, 8, 15, 16, 99], &what);
    }
}

/// The numeric path of each weight: int8 activations for the target's projections in Q4_0,
/// Q4_1 and Q8_0 (as on the CPU), f32 for the vocabulary projection, drafter weights and
/// other formats; the vocabulary projection of those three formats on TF32 tensor cores
/// (sm_80 and later).
#[test]
fn weight_paths_follow_role_and_format() {
    let Some(g) = gpu() else { return };
    for dtype in DType::ALL {
        let w = random_weight(dtype, 16, 256, 11);
        for role in [WeightRole::Projection, WeightRole::Vocab, WeightRole::Draft] {
            let path = g.weight_path(&g.upload_weight(&w, role).unwrap());
            let int8 = role == WeightRole::Projection
                && matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
            assert_eq!(path.format, dtype);
            assert_eq!(
                path.activations,
                if !int8 {
                    Activations::F32
                } else if common::int8_policy() == Int8Policy::TwoTerms {
                    Activations::Int8x2
                } else {
                    Activations::Int8
                },
                "{dtype} as {role:?}"
            );
            let packed = matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
            if int8 {
                assert!(path.kernel.starts_with("cuda dp4a"), "{}", path.kernel);
            } else if role == WeightRole::Vocab && packed && g.compute_capability().0 >= 8 {
                assert_eq!(path.kernel, "cuda tf32x2 mma", "{dtype} as {role:?}");
            } else {
                assert_eq!(path.kernel, "cuda", "{dtype} as {role:?}");
            }
        }
    }
}

#[test]
fn matmul_many_equals_separate_products() {
    let Some(g) = gpu() else { return };
    let k = 256;
    let ws: Vec<HostWeight> = [(DType::Q4_1, 96), (DType::Q8_0, 32), (DType::F16, 32)]
        .into_iter()
        .enumerate()
        .map(|(i, (d, n))| random_weight(d, n, k, 400 + i as u64))
        .collect();
    let wg: Vec<_> = ws
        .iter()
        .map(|w| g.upload_weight(w, WeightRole::Projection).unwrap())
        .collect();
    let x = g.upload(&random_vec(3 * k, -1.0, 1.0, 5), 3, k);
    let mut outs: Vec<_> = (0..3).map(|_| g.tensor(0, 0)).collect();
    {
        let refs: Vec<_> = wg.iter().collect();
        let mut out_refs: Vec<_> = outs.iter_mut().collect();
        g.matmul_many(&x, &refs, &mut out_refs);
    }
    for (w, o) in wg.iter().zip(&outs) {
        let mut single = g.tensor(0, 0);
        g.matmul(&x, w, &mut single);
        assert_eq!(bits(&g.to_host(o)), bits(&g.to_host(&single)));
    }
}

#[test]
fn matmul_many_past_one_launch_equals_separate_products() {
    // A DFlash drafter's context write: k and v of every layer from the same rows, more
    // products than one launch holds (bf16 on the f32 kernels, Q4_1 on the int8 ones).
    let Some(g) = gpu() else { return };
    let k = 576;
    for dtype in [DType::BF16, DType::Q4_1] {
        let wg: Vec<_> = (0..8)
            .map(|i| random_weight(dtype, 192, k, 500 + i as u64))
            .map(|w| g.upload_weight(&w, WeightRole::Projection).unwrap())
            .collect();
        for m in [1, 4, 16] {
            let x = g.upload(&random_vec(m * k, -1.0, 1.0, 6 + m as u64), m, k);
            let mut outs: Vec<_> = (0..wg.len()).map(|_| g.tensor(0, 0)).collect();
            {
                let refs: Vec<_> = wg.iter().collect();
                let mut out_refs: Vec<_> = outs.iter_mut().collect();
                g.matmul_many(&x, &refs, &mut out_refs);
            }
            for (i, (w, o)) in wg.iter().zip(&outs).enumerate() {
                let mut single = g.tensor(0, 0);
                g.matmul(&x, w, &mut single);
                assert_eq!(
                    bits(&g.to_host(o)),
                    bits(&g.to_host(&single)),
                    "{dtype} M={m} product {i}"
                );
            }
        }
    }
}

/// Spans of a step made of runs of `(rows, prompt)`, one row (sequence) per run.
fn step_spans(runs: &[(usize, bool)]) -> Vec<RowSpan> {
    let mut first = 0;
    runs.iter()
        .enumerate()
        .map(|(i, &(count, prompt))| {
            let s = RowSpan {
                row: i as u32,
                first: first as u32,
                count: count as u32,
                chunked: false,
                prompt,
            };
            first += count;
            s
        })
        .collect()
}

/// The GPU when its prompt rows take the tensor-core kernels (compute capability 8.0 and up).
fn tensor_gpu() -> Option<&'static CudaBackend> {
    let g = gpu()?;
    if g.prefill_gemm() != PrefillGemm::Tensor {
        println!(
            "skipped: no tensor-core prefill path on {} (compute capability {:?})",
            g.device_name(),
            g.compute_capability()
        );
        return None;
    }
    Some(g)
}

/// `out = x · wᵀ` of rows laid out by `spans` through `step_matmul_many`.
fn step_product(
    g: &CudaBackend,
    x: &[f32],
    m: usize,
    w: &dflash_runtime::cuda::CudaWeight,
    spans: &[RowSpan],
) -> Vec<f32> {
    let xg = g.upload(x, m, x.len() / m);
    let mut og = g.tensor(0, 0);
    g.step_matmul_many(&xg, &[w], &mut [&mut og], spans);
    g.to_host(&og)
}

/// Prompt rows on tensor cores (TF32 operands, f32 accumulation) against the CPU's f32
/// reference product, for every format, the default model's shapes and a K that is not a
/// whole number of the kernel's 64-value K tiles, at M = 17, 64, 100 and 512; and a row's bits
/// do not depend on M, on its place in the tile or on the rows around it, while decode rows
/// of the same step keep the CUDA-core kernel's bits.
///
/// Tolerance: each operand is rounded to TF32 (unit roundoff 2^-11), so a product is off by
/// at most 2^-10 (+2^-22) of its size; the f32 accumulations (the GPU's and the CPU's) add
/// at most K·2^-23 each. So |gpu - cpu| <= (2^-10 + K·2^-22) · Σ_k |x_k w_k| + 1e-6.
#[test]
fn tensor_core_prefill_matches_cpu_and_is_row_invariant() {
    let Some(g) = tensor_gpu() else { return };
    let c = cpu();
    for (di, dtype) in DType::ALL.into_iter().enumerate() {
        // K-quant rows are whole 256-value super-blocks, always whole K tiles.
        let odd_k = if dtype.block_len() == 256 { 1280 } else { 1120 };
        // SmolLM2-135M: q/o (576 x 576), k/v (192 x 576), gate/up (1536 x 576), down
        // (576 x 1536); and 67 rows (not whole 32-row tiles) of the odd K.
        let shapes: [(usize, usize); 5] = [
            (576, 576),
            (192, 576),
            (1536, 576),
            (576, 1536),
            (67, odd_k),
        ];
        for (si, &(n, k)) in shapes.iter().enumerate() {
            // K-quant rows must be whole super-blocks: K = 576 becomes 768 for them.
            let k = k.next_multiple_of(dtype.block_len());
            let seed = 1000 + 10 * di as u64 + si as u64;
            let w = random_weight(dtype, n, k, seed);
            let wg = g.upload_weight(&w, WeightRole::Projection).unwrap();
            let x_all = random_vec(512 * k, -2.0, 2.0, seed + 500);
            let what = format!("tensor-core {dtype} {n}x{k}");

            let full = step_product(g, &x_all, 512, &wg, &step_spans(&[(512, true)]));
            let mut oc = c.tensor(0, 0);
            c.matmul(
                &c.upload(&x_all, 512, k),
                &CpuWeight::f32(w.clone()),
                &mut oc,
            );
            let rel = 2f32.powi(-10) + k as f32 * 2f32.powi(-22);
            assert_close(
                &format!("{what} M=512"),
                &full,
                &c.to_host(&oc),
                &product_magnitudes(&w, &x_all, 512),
                rel,
                1e-6,
            );

            for m in [17usize, 64, 100] {
                let got = step_product(g, &x_all[..m * k], m, &wg, &step_spans(&[(m, true)]));
                assert_eq!(
                    bits(&got),
                    bits(&full[..m * n]),
                    "{what}: rows at M={m} differ from the same rows at M=512"
                );
            }
            if si > 0 && si + 1 < shapes.len() {
                continue;
            }
            // A step of 5 decode rows (x rows 200..205), then two prompt pieces: x rows 99
            // down to 40 and 39 down to 0 (every row at another place in its tile, among
            // other rows), then 3 decode rows (x rows 300..303).
            let mut x = Vec::new();
            let order: Vec<usize> = (200..205).chain((0..100).rev()).chain(300..303).collect();
            for &r in &order {
                x.extend_from_slice(&x_all[r * k..(r + 1) * k]);
            }
            let spans = step_spans(&[(5, false), (60, true), (40, true), (3, false)]);
            let got = step_product(g, &x, order.len(), &wg, &spans);
            let xg = g.upload(&x, order.len(), k);
            let mut plain = g.tensor(0, 0);
            g.matmul(&xg, &wg, &mut plain);
            let plain = g.to_host(&plain);
            for (i, &r) in order.iter().enumerate() {
                let row = &got[i * n..(i + 1) * n];
                if (5..105).contains(&i) {
                    assert_eq!(
                        bits(row),
                        bits(&full[r * n..(r + 1) * n]),
                        "{what}: prompt row {r} at step row {i} differs from its M=512 result"
                    );
                } else {
                    assert_eq!(
                        bits(row),
                        bits(&plain[i * n..(i + 1) * n]),
                        "{what}: decode row {i} of a mixed step left the CUDA-core kernel"
                    );
                }
            }
        }
    }
}

/// The fused tensor-core epilogues (residual add, SwiGLU) and the multi-product launch equal,
/// bit for bit, the tensor-core product followed by the separate op, in a step that mixes
/// decode and prompt rows; at the default model's shapes and at shapes with partial tiles
/// everywhere (K = 1120 and 96: a last K tile of 32; N = 67 and 96; 90 prompt rows). Small
/// enough for the memcheck pass, which so covers every bound of the kernels.
#[test]
fn tensor_core_prefill_epilogues_equal_separate_ops() {
    let Some(g) = tensor_gpu() else { return };
    let m = 100;
    let spans = step_spans(&[(3, false), (90, true), (7, false)]);
    let cases = [
        (DType::Q4_1, 576, 1536, 192),
        (DType::Q6K, 512, 1536, 192),
        (DType::BF16, 576, 1536, 192),
        (DType::Q4_1, 1120, 96, 67),
        (DType::BF16, 1120, 96, 67),
    ];
    for (di, &(dtype, h, f, kv)) in cases.iter().enumerate() {
        let seed = 2000 + 10 * di as u64;
        let up = |w: HostWeight| g.upload_weight(&w, WeightRole::Projection).unwrap();
        let (wq, wk, wv) = (
            up(random_weight(dtype, h, h, seed)),
            up(random_weight(dtype, kv, h, seed + 1)),
            up(random_weight(dtype, kv, h, seed + 2)),
        );
        let (wg, wu, wd) = (
            up(random_weight(dtype, f, h, seed + 3)),
            up(random_weight(dtype, f, h, seed + 4)),
            up(random_weight(dtype, h, f, seed + 5)),
        );
        let wk8 = up(random_weight(DType::Q8_0, kv, h, seed + 6));
        let x = g.upload(&random_vec(m * h, -2.0, 2.0, seed + 7), m, h);
        let xf = g.upload(&random_vec(m * f, -2.0, 2.0, seed + 8), m, f);
        let base = random_vec(m * h, -1.0, 1.0, seed + 9);
        let alone = |x: &dflash_runtime::cuda::CudaTensor, w| {
            let mut o = g.tensor(0, 0);
            g.step_matmul_many(x, &[w], &mut [&mut o], &spans);
            g.to_host(&o)
        };

        // q/k/v in one launch per run of rows, and a mixed-format set one by one.
        let (mut q, mut k, mut v) = (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
        g.step_matmul_many(&x, &[&wq, &wk, &wv], &mut [&mut q, &mut k, &mut v], &spans);
        for (o, w, name) in [(&q, &wq, "q"), (&k, &wk, "k"), (&v, &wv, "v")] {
            assert_eq!(
                bits(&g.to_host(o)),
                bits(&alone(&x, w)),
                "{dtype}: {name} of the fused q/k/v launch"
            );
        }
        g.step_matmul_many(&x, &[&wq, &wk8], &mut [&mut q, &mut k], &spans);
        assert_eq!(
            bits(&g.to_host(&q)),
            bits(&alone(&x, &wq)),
            "{dtype}: mixed q"
        );
        assert_eq!(
            bits(&g.to_host(&k)),
            bits(&alone(&x, &wk8)),
            "{dtype}: mixed k"
        );

        // SwiGLU: silu(x·gᵀ) * (x·uᵀ).
        let (mut out, mut scratch) = (g.tensor(0, 0), g.tensor(0, 0));
        g.step_matmul_swiglu(&x, &wg, &wu, &mut out, &mut scratch, &spans);
        let mut gate = g.upload(&alone(&x, &wg), m, f);
        g.silu_mul(&mut gate, &g.upload(&alone(&x, &wu), m, f));
        assert_eq!(
            bits(&g.to_host(&out)),
            bits(&g.to_host(&gate)),
            "{dtype}: fused SwiGLU"
        );

        // Residual add: out = base + xf·dᵀ.
        let mut res = g.upload(&base, m, h);
        g.step_matmul_add(&xf, &wd, &mut res, &mut scratch, &spans);
        let mut want = g.upload(&base, m, h);
        g.add(&mut want, &g.upload(&alone(&xf, &wd), m, h));
        assert_eq!(
            bits(&g.to_host(&res)),
            bits(&g.to_host(&want)),
            "{dtype}: fused residual add"
        );
    }
}

#[test]
fn cublas_prefill_path_matches_cpu() {
    if gpu().is_none() {
        return;
    }
    // Int8-path weights too: the cuBLAS path dequantizes them from their device layout.
    let opts = CudaOptions {
        prefill_gemm: PrefillGemm::Cublas { min_rows: 17 },
        int8: Int8Policy::All,
        ..CudaOptions::default()
    };
    let g = match CudaBackend::with_options(opts) {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: cuBLAS path unavailable ({e})");
            return;
        }
    };
    let c = cpu();
    for (di, dtype) in [DType::Q4_1, DType::Q6K, DType::BF16]
        .into_iter()
        .enumerate()
    {
        let k = 512;
        let (n, m) = (70, 40);
        let w = random_weight(dtype, n, k, 500 + di as u64);
        let x = random_vec(m * k, -2.0, 2.0, 600 + di as u64);
        let mut og = g.tensor(0, 0);
        g.matmul(
            &g.upload(&x, m, k),
            &g.upload_weight(&w, WeightRole::Projection).unwrap(),
            &mut og,
        );
        let mut oc = c.tensor(0, 0);
        c.matmul(&c.upload(&x, m, k), &CpuWeight::f32(w.clone()), &mut oc);
        assert_close(
            &format!("cuBLAS matmul {dtype} M={m}"),
            &g.to_host(&og),
            &c.to_host(&oc),
            &product_magnitudes(&w, &x, m),
            2e-6,
            1e-6,
        );
    }
}

#[test]
fn rms_norm_is_bit_identical_to_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    // (rows, cols, weight dim): whole-row groups, head-sized groups, odd sizes, a row of one.
    for (case, &(rows, cols, dim)) in [
        (7, 576, 576),
        (5, 6 * 64, 64),
        (3, 3 * 40, 40),
        (33, 17, 17),
    ]
    .iter()
    .enumerate()
    {
        let x = random_vec(rows * cols, -4.0, 4.0, 700 + case as u64);
        let w = random_vec(dim, -1.0, 1.0, 800 + case as u64);
        for zero_centred in [false, true] {
            let (wg, wc) = (g.upload(&w, 1, dim), c.upload(&w, 1, dim));
            // Out of place.
            let mut xg = g.upload(&x, rows, cols);
            let mut xc = c.upload(&x, rows, cols);
            let mut og = g.tensor(0, 0);
            let mut oc = c.tensor(0, 0);
            g.rms_norm(&mut xg, &wg, 1e-5, zero_centred, Some(&mut og));
            c.rms_norm(&mut xc, &wc, 1e-5, zero_centred, Some(&mut oc));
            let want = c.to_host(&oc);
            let got = g.to_host(&og);
            assert_close("rms_norm", &got, &want, &magnitudes(&want), 1e-6, 0.0);
            assert_eq!(
                bits(&got),
                bits(&want),
                "rms_norm ({rows}x{cols}, dim {dim}, zero_centred {zero_centred}) is not bit-identical"
            );
            assert_eq!(bits(&g.to_host(&xg)), bits(&x), "input changed");
            // In place.
            g.rms_norm(&mut xg, &wg, 1e-5, zero_centred, None);
            assert_eq!(bits(&g.to_host(&xg)), bits(&want), "in-place rms_norm");
        }
    }
}

#[test]
fn rope_both_styles_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut r = rng(9);
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for (head_dim, rot) in [(64usize, 64usize), (64, 32), (128, 128)] {
            let heads = 5;
            let t = 9;
            let half = rot / 2;
            let inv: Vec<f32> = (0..half)
                .map(|i| 10000f32.powf(-((2 * i) as f32) / rot as f32))
                .collect();
            let meta: Vec<TokenMeta> = (0..t)
                .map(|i| TokenMeta::causal(i as u32 % 2, r.random_range(0..6000)))
                .collect();
            let x = random_vec(t * heads * head_dim, -2.0, 2.0, 900 + head_dim as u64);
            let mut xg = g.upload(&x, t, heads * head_dim);
            let mut xc = c.upload(&x, t, heads * head_dim);
            g.rope(
                &mut xg,
                &g.upload_meta(&meta),
                &g.upload(&inv, 1, half),
                head_dim,
                style,
            );
            c.rope(
                &mut xc,
                &c.upload_meta(&meta),
                &c.upload(&inv, 1, half),
                head_dim,
                style,
            );
            let want = c.to_host(&xc);
            assert_close(
                &format!("rope {style:?} hd {head_dim} rot {rot}"),
                &g.to_host(&xg),
                &want,
                &magnitudes(&want),
                1e-6,
                0.0,
            );
        }
    }
}

#[test]
fn elementwise_ops_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let (rows, cols) = (13, 300);
    let a = random_vec(rows * cols, -8.0, 8.0, 11);
    let b = random_vec(rows * cols, -2.0, 2.0, 12);
    let bias = random_vec(cols, -1.0, 1.0, 13);

    let mut xg = g.upload(&a, rows, cols);
    let mut xc = c.upload(&a, rows, cols);
    g.add(&mut xg, &g.upload(&b, rows, cols));
    c.add(&mut xc, &c.upload(&b, rows, cols));
    assert_eq!(bits(&g.to_host(&xg)), bits(&c.to_host(&xc)), "add");

    g.add_bias(&mut xg, &g.upload(&bias, 1, cols));
    c.add_bias(&mut xc, &c.upload(&bias, 1, cols));
    assert_eq!(bits(&g.to_host(&xg)), bits(&c.to_host(&xc)), "add_bias");

    let mut gg = g.upload(&a, rows, cols);
    let mut gc = c.upload(&a, rows, cols);
    g.silu_mul(&mut gg, &g.upload(&b, rows, cols));
    c.silu_mul(&mut gc, &c.upload(&b, rows, cols));
    let want = c.to_host(&gc);
    assert_close(
        "silu_mul",
        &g.to_host(&gg),
        &want,
        &magnitudes(&want),
        4e-7,
        0.0,
    );

    let sel = [12u32, 0, 5, 5, 7];
    let mut og = g.tensor(0, 0);
    let mut oc = c.tensor(0, 0);
    g.gather_rows(&xg, &sel, &mut og);
    c.gather_rows(&xc, &sel, &mut oc);
    assert_eq!(g.shape(&og), (sel.len(), cols));
    assert_eq!(bits(&g.to_host(&og)), bits(&c.to_host(&oc)), "gather_rows");

    let src = random_vec(rows * 40, -1.0, 1.0, 14);
    let (sg, sc) = (g.upload(&src, rows, 40), c.upload(&src, rows, 40));
    let mut dg = g.upload(&a, rows, cols);
    let mut dc = c.upload(&a, rows, cols);
    for col in [0, 77, cols - 40] {
        g.copy_columns(&sg, &mut dg, col);
        c.copy_columns(&sc, &mut dc, col);
    }
    assert_eq!(bits(&g.to_host(&dg)), bits(&c.to_host(&dc)), "copy_columns");
}

#[test]
fn scale_and_grouped_conv_are_bit_identical_to_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let (cols, group, taps) = (96, 16, 3);
    let groups = cols / group;
    // Two rows' blocks of 5 and 4 tokens (row 1 first), then a lone token of row 2.
    let meta: Vec<TokenMeta> = (0..5)
        .map(|i| TokenMeta::causal(1, 40 + i))
        .chain((0..4).map(|i| TokenMeta::causal(0, 7 + i)))
        .chain(std::iter::once(TokenMeta::causal(2, 3)))
        .collect();
    let t = meta.len();
    let x = random_vec(t * cols, -3.0, 3.0, 21);
    let base = random_vec(taps * cols, -1.0, 1.0, 22);
    let dyn_cols = 2 * taps * groups;
    let dynamic = random_vec(t * dyn_cols, -0.5, 0.5, 23);
    let (mg, mc) = (g.upload_meta(&meta), c.upload_meta(&meta));
    for col in [0, taps * groups] {
        let mut og = g.tensor(0, 0);
        let mut oc = c.tensor(0, 0);
        g.grouped_conv(
            &g.upload(&x, t, cols),
            &g.upload(&base, taps, cols),
            &g.upload(&dynamic, t, dyn_cols),
            col,
            group,
            &mg,
            &mut og,
        );
        c.grouped_conv(
            &c.upload(&x, t, cols),
            &c.upload(&base, taps, cols),
            &c.upload(&dynamic, t, dyn_cols),
            col,
            group,
            &mc,
            &mut oc,
        );
        assert_eq!(g.shape(&og), (t, cols));
        assert_eq!(bits(&g.to_host(&og)), bits(&c.to_host(&oc)), "grouped_conv");
    }
    let mut xg = g.upload(&x, t, cols);
    let mut xc = c.upload(&x, t, cols);
    g.scale(&mut xg, 1.7);
    c.scale(&mut xc, 1.7);
    assert_eq!(bits(&g.to_host(&xg)), bits(&c.to_host(&xc)), "scale");
}

#[test]
fn argmax_takes_first_maximum_and_skips_nan() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let cols = 10_000;
    let mut rows: Vec<Vec<f32>> = vec![
        {
            let mut v = vec![0.0; cols];
            v[1] = 3.0;
            v[2] = 3.0;
            v[3] = 2.0;
            v
        },
        {
            let mut v = vec![0.1; cols];
            v[0] = f32::NAN;
            v[1] = 0.5;
            v
        },
        vec![f32::NEG_INFINITY; cols],
        vec![f32::NAN; cols],
        random_vec(cols, -1.0, 1.0, 15),
    ];
    // Ties far apart (different threads of the kernel): the first one wins.
    let mut v = random_vec(cols, -1.0, 1.0, 16);
    for i in [9_999, 4_000, 257, 256, 3_001] {
        v[i] = 7.0;
    }
    rows.push(v);
    let mut v = vec![f32::NAN; cols];
    v[cols - 1] = -5.0;
    rows.push(v);
    let flat: Vec<f32> = rows.concat();
    let got = g.argmax_rows(&g.upload(&flat, rows.len(), cols));
    let want = c.argmax_rows(&c.upload(&flat, rows.len(), cols));
    assert_eq!(got, want);
    assert_eq!(got[0], 1);
    assert_eq!(got[1], 1);
    assert_eq!(got[2], 0);
    assert_eq!(got[5], 256);
    assert_eq!(got[6], (cols - 1) as u32);
}

/// The host's definition of `Backend::top_k_rows`: value descending as `f32::total_cmp` ranks
/// values, NaN as -inf, ties to the lower index.
fn top_k_reference(row: &[f32], k: usize) -> Vec<u32> {
    let key = |i: usize| {
        if row[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            row[i]
        }
    };
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx[..k].iter().map(|&i| i as u32).collect()
}

#[test]
fn top_k_rows_ranks_like_the_host() {
    let Some(g) = gpu() else { return };
    for (cols, k) in [(49_152, 16), (3_000, 64), (40, 40)] {
        let mut rows: Vec<Vec<f32>> = vec![
            random_vec(cols, -8.0, 8.0, 21),
            // ties far apart (different threads), around a few larger values
            {
                let mut v = random_vec(cols, -1.0, 1.0, 22);
                for (n, i) in [cols - 1, 0, cols / 2, 1_025 % cols, 31]
                    .into_iter()
                    .enumerate()
                {
                    v[i] = if n % 2 == 0 { 4.0 } else { 5.0 };
                }
                v
            },
            // NaN ranked as -inf, +0 above -0, -inf ties by index
            {
                let mut v = vec![f32::NEG_INFINITY; cols];
                for i in (0..cols).step_by(7) {
                    v[i] = f32::NAN;
                }
                for i in (3..cols).step_by(11) {
                    v[i] = -0.0;
                }
                for i in (5..cols).step_by(13) {
                    v[i] = 0.0;
                }
                v
            },
            vec![f32::NAN; cols],
        ];
        rows.push(random_vec(cols, -1e-3, 1e-3, 23));
        let flat: Vec<f32> = rows.concat();
        let (ids, vals) = g
            .top_k_rows(&g.upload(&flat, rows.len(), cols), k)
            .expect("the CUDA backend ranks on the device");
        assert_eq!(ids.len(), rows.len() * k);
        for (r, row) in rows.iter().enumerate() {
            let want = top_k_reference(row, k);
            assert_eq!(
                &ids[r * k..(r + 1) * k],
                &want[..],
                "row {r} of {cols} columns, k {k}"
            );
            let raw: Vec<f32> = want.iter().map(|&i| row[i as usize]).collect();
            assert_eq!(
                bits(&vals[r * k..(r + 1) * k]),
                bits(&raw),
                "raw values of row {r}"
            );
        }
    }
    let c = cpu();
    assert!(c.top_k_rows(&c.upload(&[1.0, 2.0], 1, 2), 1).is_none());
}

/// New caches of `layers` layers on both backends, rows `lens` (row r holds lens[r]
/// positions) filled with the same random K and V.
fn filled_kv(
    g: &CudaBackend,
    c: &CpuBackend,
    layers: usize,
    n_kv_heads: usize,
    head_dim: usize,
    lens: &[usize],
    seed: u64,
) -> (<CudaBackend as Backend>::Kv, <CpuBackend as Backend>::Kv) {
    let kv_dim = n_kv_heads * head_dim;
    let mut kvg = g.kv_new(layers, n_kv_heads, head_dim);
    let mut kvc = c.kv_new(layers, n_kv_heads, head_dim);
    for (row, &len) in lens.iter().enumerate() {
        g.kv_reserve(&mut kvg, row, len, 0);
        c.kv_reserve(&mut kvc, row, len, 0);
        let meta: Vec<TokenMeta> = (0..len)
            .map(|p| TokenMeta::causal(row as u32, p as u32))
            .collect();
        let (mg, mc) = (g.upload_meta(&meta), c.upload_meta(&meta));
        for layer in 0..layers {
            let s = seed + 1000 * row as u64 + 10 * layer as u64;
            let k = random_vec(len * kv_dim, -1.0, 1.0, s);
            let v = random_vec(len * kv_dim, -1.0, 1.0, s + 1);
            g.kv_write(
                &mut kvg,
                layer,
                &g.upload(&k, len, kv_dim),
                &g.upload(&v, len, kv_dim),
                &mg,
            );
            c.kv_write(
                &mut kvc,
                layer,
                &c.upload(&k, len, kv_dim),
                &c.upload(&v, len, kv_dim),
                &mc,
            );
        }
    }
    (kvg, kvc)
}

#[test]
fn attention_ragged_rows_and_masks_match_cpu_and_are_batch_invariant() {
    on_each_kv_type(attention_ragged_rows_and_masks_match_cpu_and_are_batch_invariant_on);
}

fn attention_ragged_rows_and_masks_match_cpu_and_are_batch_invariant_on(
    g: &CudaBackend,
    kv: KvType,
) {
    let c = cpu_kv(kv);
    let (layers, n_heads, n_kv_heads, head_dim) = (2, 6, 2, 64);
    let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
    let lens = [5usize, 300, 37, 1];
    let (kvg, kvc) = filled_kv(g, c, layers, n_kv_heads, head_dim, &lens, 40);

    let tm = |row: u32, pos: u32, s: u32, e: u32| TokenMeta {
        row,
        pos,
        kv_start: s,
        kv_end: e,
    };
    let meta = vec![
        TokenMeta::causal(0, 4),
        TokenMeta::causal(1, 0),
        TokenMeta::causal(1, 299),
        tm(1, 290, 284, 300), // a block of 16 attending to itself bidirectionally
        tm(1, 284, 284, 300),
        tm(1, 200, 72, 201), // sliding window
        TokenMeta::causal(2, 36),
        tm(2, 10, 0, 37),
        tm(3, 0, 0, 1),
        tm(2, 3, 3, 3), // nothing visible: zeros
        TokenMeta::causal(1, 129),
    ];
    let t = meta.len();
    let q = random_vec(t * n_heads * head_dim, -2.0, 2.0, 77);
    for layer in 0..layers {
        let mut og = g.tensor(0, 0);
        let mut oc = c.tensor(0, 0);
        g.attention(
            &g.upload(&q, t, n_heads * head_dim),
            &kvg,
            layer,
            &g.upload_meta(&meta),
            shape,
            &mut og,
        );
        c.attention(
            &c.upload(&q, t, n_heads * head_dim),
            &kvc,
            layer,
            &c.upload_meta(&meta),
            shape,
            &mut oc,
        );
        let got = g.to_host(&og);
        let want = c.to_host(&oc);
        assert_close(
            &format!("attention layer {layer}"),
            &got,
            &want,
            &vec![1.0; want.len()],
            1e-5,
            0.0,
        );
        let row_len = n_heads * head_dim;
        assert!(got[9 * row_len..10 * row_len].iter().all(|&v| v == 0.0));
        // Each token alone gives the same bits as inside the batch.
        for (i, m) in meta.iter().enumerate() {
            let mut o1 = g.tensor(0, 0);
            g.attention(
                &g.upload(&q[i * row_len..(i + 1) * row_len], 1, row_len),
                &kvg,
                layer,
                &g.upload_meta(std::slice::from_ref(m)),
                shape,
                &mut o1,
            );
            assert_eq!(
                bits(&g.to_host(&o1)),
                bits(&got[i * row_len..(i + 1) * row_len]),
                "attention of token {i} alone differs from the batch"
            );
        }
    }
}

/// Every token gets the bits it gets alone whatever launch it is in, where its splits change size:
/// a verify block of 16 crossing 2,048 keys (64 tiles of 32 keys fill 16 splits of four; from 2,049
/// keys a split holds five), a bidirectional block, sliding windows (a new first key per token), a
/// token with no keys, and another row's tokens between them; the whole launch (past 16 tokens: the
/// split kernel merges by itself), launches of 3 and 13 tokens (the merge launch) and each token
/// alone (the early-load kernel).
#[test]
fn attention_tokens_alone_equal_any_launch() {
    on_each_kv_type(attention_tokens_alone_on);
}

fn attention_tokens_alone_on(g: &CudaBackend, kv: KvType) {
    let c = cpu_kv(kv);
    let (layers, n_heads, n_kv_heads, head_dim) = (1, 6, 2, 64);
    let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
    let lens = [2_100usize, 90];
    let (kvg, kvc) = filled_kv(g, c, layers, n_kv_heads, head_dim, &lens, 61);
    let tm = |row: u32, pos: u32, s: u32, e: u32| TokenMeta {
        row,
        pos,
        kv_start: s,
        kv_end: e,
    };
    let mut meta: Vec<TokenMeta> = (2_038..2_054).map(|p| TokenMeta::causal(0, p)).collect();
    meta.push(TokenMeta::causal(1, 80));
    meta.extend((0..6).map(|i| tm(0, 1_000 + i, 1_000, 1_006)));
    meta.extend((0..5).map(|i| tm(0, 1_500 + i, 1_200 + i, 1_501 + i)));
    meta.push(tm(1, 5, 5, 5));
    meta.extend((80..87).map(|p| TokenMeta::causal(1, p)));
    meta.extend((2_090..2_095).map(|p| TokenMeta::causal(0, p)));
    let t = meta.len();
    let row_len = n_heads * head_dim;
    let q = random_vec(t * row_len, -2.0, 2.0, 78);
    let run = |first: usize, n: usize| {
        let mut o = g.tensor(0, 0);
        g.attention(
            &g.upload(&q[first * row_len..(first + n) * row_len], n, row_len),
            &kvg,
            0,
            &g.upload_meta(&meta[first..first + n]),
            shape,
            &mut o,
        );
        g.to_host(&o)
    };
    let all = run(0, t);
    let mut oc = c.tensor(0, 0);
    c.attention(
        &c.upload(&q, t, row_len),
        &kvc,
        0,
        &c.upload_meta(&meta),
        shape,
        &mut oc,
    );
    let want = c.to_host(&oc);
    assert_close(
        "attention around 2,048 keys",
        &all,
        &want,
        &vec![1.0; want.len()],
        1e-5,
        0.0,
    );
    let windows = std::iter::once((0, 3)).chain((3..t).step_by(13).map(|f| (f, 13.min(t - f))));
    for (first, n) in windows {
        assert_eq!(
            bits(&run(first, n)),
            bits(&all[first * row_len..(first + n) * row_len]),
            "tokens {first}..{} in a launch of their own differ from the whole launch",
            first + n
        );
    }
    for i in 0..t {
        assert_eq!(
            bits(&run(i, 1)),
            bits(&all[i * row_len..(i + 1) * row_len]),
            "token {i} ({:?}) alone differs from the whole launch",
            meta[i]
        );
    }
}

/// The split kernel's own merge (prompt rows by default, here every launch) gives the merge
/// launch's bits (decode and verify rows by default), for ragged rows, empty slices and
/// repeated launches (the arrival counts return to zero), and so does the int8 copy of its
/// output that an int8 output projection reads.
#[test]
fn attention_in_kernel_merge_equals_the_merge_launch() {
    on_each_kv_type(attention_in_kernel_merge_on);
}

fn attention_in_kernel_merge_on(separate: &CudaBackend, kv: KvType) {
    let opts = CudaOptions {
        int8: common::int8_policy(),
        fuse_merge_min_rows: 1,
        kv_type: kv,
        ..CudaOptions::from_env().unwrap()
    };
    let fused = &CudaBackend::with_options(opts).unwrap();
    let c = cpu_kv(kv);
    // The default model's group (3 query heads per KV head of 64) and Qwen3-4B's (4 of 128).
    for (n_heads, n_kv_heads, head_dim) in [(9usize, 3usize, 64usize), (8, 2, 128)] {
        let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
        let lens = [5usize, 700, 37];
        let kvs: Vec<_> = [fused, separate]
            .iter()
            .map(|g| filled_kv(g, c, 2, n_kv_heads, head_dim, &lens, 90).0)
            .collect();
        let meta = vec![
            TokenMeta::causal(0, 4),
            TokenMeta::causal(1, 699), // 16 splits
            TokenMeta {
                row: 1,
                pos: 300,
                kv_start: 290,
                kv_end: 306,
            },
            TokenMeta {
                row: 2,
                pos: 3,
                kv_start: 3,
                kv_end: 3, // nothing visible: zeros
            },
            TokenMeta::causal(2, 36),
            TokenMeta::causal(1, 129),
        ];
        let t = meta.len();
        let k = n_heads * head_dim;
        let q = random_vec(t * k, -2.0, 2.0, 91);
        let w = random_weight(DType::Q8_0, 40, k, 92);
        let run = |g: &CudaBackend, kv, layer: usize| -> (Vec<u32>, Vec<u32>) {
            let wg = g.upload_weight(&w, WeightRole::Projection).unwrap();
            let (mut o, mut y) = (g.tensor(t, k), g.tensor(t, 40));
            g.attention(
                &g.upload(&q, t, k),
                kv,
                layer,
                &g.upload_meta(&meta),
                shape,
                &mut o,
            );
            // An int8 product of the output (its int8 copy, written by the merge).
            g.matmul(&o, &wg, &mut y);
            (bits(&g.to_host(&o)), bits(&g.to_host(&y)))
        };
        for round in 0..3 {
            for layer in 0..2 {
                let what =
                    format!("heads {n_heads}/{n_kv_heads}x{head_dim} layer {layer} round {round}");
                let (of, yf) = run(fused, &kvs[0], layer);
                let (os, ys) = run(separate, &kvs[1], layer);
                assert_eq!(of, os, "{what}: attention output");
                assert_eq!(yf, ys, "{what}: product of the output");
                assert!(
                    of[3 * k..4 * k].iter().all(|&b| b == 0),
                    "{what}: empty slice"
                );
            }
        }
    }
}

/// How many warps a split block has (one per slot for decode launches, two slots a warp for
/// larger ones: `DFLASH_CUDA_ATT_WIDE`) does not change a bit: every launch of tokens at short,
/// middle and long contexts (one, two and three tiles a slot: up to 2,048, 4,096 and past
/// 4,096 keys), through both kernels (early loads up to 8 tokens, plain above), gives the same
/// bits with a warp per slot and with four warps, and each token alone equals its launch.
#[test]
fn attention_warps_a_block_do_not_change_bits() {
    on_each_kv_type(attention_warps_on);
}

fn attention_warps_on(_: &CudaBackend, kv: KvType) {
    let with = |wide: usize| {
        let opts = CudaOptions {
            int8: common::int8_policy(),
            att_wide_max_rows: wide,
            kv_type: kv,
            ..CudaOptions::from_env().unwrap()
        };
        CudaBackend::with_options(opts).unwrap()
    };
    let (wide, narrow) = (&with(usize::MAX), &with(0));
    let c = cpu_kv(kv);
    for (n_heads, n_kv_heads, head_dim) in [(9usize, 3usize, 64usize), (8, 2, 128), (2, 1, 30)] {
        let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
        let lens = [9_000usize, 3_000, 300];
        let kvs: Vec<_> = [wide, narrow]
            .iter()
            .map(|g| filled_kv(g, c, 1, n_kv_heads, head_dim, &lens, 93).0)
            .collect();
        let mut meta: Vec<TokenMeta> = (8_990..8_994).map(|p| TokenMeta::causal(0, p)).collect();
        meta.extend((2_995..2_999).map(|p| TokenMeta::causal(1, p)));
        meta.extend([4_100, 2_050, 1_000].map(|p| TokenMeta::causal(0, p)));
        meta.extend((290..295).map(|p| TokenMeta::causal(2, p)));
        let t = meta.len();
        let k = n_heads * head_dim;
        let q = random_vec(t * k, -2.0, 2.0, 94);
        let run = |g: &CudaBackend, kv, first: usize, n: usize| -> Vec<u32> {
            let mut o = g.tensor(0, 0);
            g.attention(
                &g.upload(&q[first * k..(first + n) * k], n, k),
                kv,
                0,
                &g.upload_meta(&meta[first..first + n]),
                shape,
                &mut o,
            );
            bits(&g.to_host(&o))
        };
        let what = format!("heads {n_heads}/{n_kv_heads}x{head_dim}");
        let all = run(wide, &kvs[0], 0, t);
        assert_eq!(all, run(narrow, &kvs[1], 0, t), "{what}: {t} tokens");
        for (first, n) in [(0, 8), (8, 8)] {
            let w = run(wide, &kvs[0], first, n);
            assert_eq!(
                w,
                run(narrow, &kvs[1], first, n),
                "{what}: tokens {first}.. (early loads)"
            );
            assert_eq!(
                w,
                all[first * k..(first + n) * k],
                "{what}: tokens {first}.. against all"
            );
        }
        for i in 0..t {
            for (g, kv) in [(wide, &kvs[0]), (narrow, &kvs[1])] {
                assert_eq!(
                    run(g, kv, i, 1),
                    all[i * k..(i + 1) * k],
                    "{what}: token {i} ({:?}) alone",
                    meta[i]
                );
            }
        }
    }
}

/// An f16 KV cache holds each value rounded to nearest even once (the CPU's `half` rounding,
/// subnormals included) and attention widens it exactly: on every kernel path (16-byte loads of
/// four values, single values where head sizes are not multiples of four; decode tokens,
/// verify blocks, ragged rows, long rows with many splits) attention over an f16 cache gives
/// the bits of attention over an f32 cache written with the rounded values.
#[test]
fn f16_cache_attention_equals_an_f32_cache_of_the_rounded_values() {
    let (Some(g32), Some(g16)) = (gpu(), gpu_f16()) else {
        return;
    };
    assert_eq!(g16.kv_type(), KvType::F16);
    for (n_heads, n_kv_heads, head_dim) in [(9usize, 3usize, 64usize), (8, 2, 128), (2, 1, 30)] {
        let kv_dim = n_kv_heads * head_dim;
        let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
        let (mut kv16, mut kv32) = (
            g16.kv_new(1, n_kv_heads, head_dim),
            g32.kv_new(1, n_kv_heads, head_dim),
        );
        assert_eq!(g16.kv_value_bytes(&kv16), 2);
        assert_eq!(g32.kv_value_bytes(&kv32), 4);
        let lens = [7usize, 1500, 64];
        for (row, &len) in lens.iter().enumerate() {
            g16.kv_reserve(&mut kv16, row, len, 0);
            g32.kv_reserve(&mut kv32, row, len, 0);
            let meta: Vec<TokenMeta> = (0..len)
                .map(|p| TokenMeta::causal(row as u32, p as u32))
                .collect();
            // Moderate values, with some far below f16's normal range (subnormal and zero
            // after rounding) and some with ties to round.
            let values = |seed: u64| -> Vec<f32> {
                let mut v = random_vec(len * kv_dim, -1.5, 1.5, seed);
                for (i, x) in v.iter_mut().enumerate() {
                    match i % 97 {
                        0 => *x *= 1e-5,
                        1 => *x *= 3e-8,
                        2 => *x = 1.0 + 2f32.powi(-11), // halfway between two f16 values
                        _ => {}
                    }
                }
                v
            };
            let (k, v) = (values(500 + row as u64), values(600 + row as u64));
            let rounded =
                |x: &[f32]| -> Vec<f32> { x.iter().map(|&a| KvType::F16.round(a)).collect() };
            g16.kv_write(
                &mut kv16,
                0,
                &g16.upload(&k, len, kv_dim),
                &g16.upload(&v, len, kv_dim),
                &g16.upload_meta(&meta),
            );
            g32.kv_write(
                &mut kv32,
                0,
                &g32.upload(&rounded(&k), len, kv_dim),
                &g32.upload(&rounded(&v), len, kv_dim),
                &g32.upload_meta(&meta),
            );
        }
        let mut meta = vec![
            TokenMeta::causal(0, 6),
            TokenMeta::causal(1, 1499),
            TokenMeta::causal(2, 63),
            TokenMeta::causal(1, 40),
        ];
        // A verify block of 16 at the end of row 1.
        meta.extend((1484..1500).map(|p| TokenMeta::causal(1, p)));
        let t = meta.len();
        let q = random_vec(t * n_heads * head_dim, -2.0, 2.0, 700);
        let run =
            |g: &CudaBackend, kv: &<CudaBackend as Backend>::Kv, meta: &[TokenMeta], q: &[f32]| {
                let mut o = g.tensor(0, 0);
                g.attention(
                    &g.upload(q, meta.len(), n_heads * head_dim),
                    kv,
                    0,
                    &g.upload_meta(meta),
                    shape,
                    &mut o,
                );
                bits(&g.to_host(&o))
            };
        let what = format!("heads {n_heads}/{n_kv_heads} dim {head_dim}");
        // One key: attention returns its value exactly (a negative zero comes back positive: it
        // is added to zero), so an f16 cache must give back every value rounded once, infinities
        // (past ±65504) and subnormals included.
        let special: Vec<f32> = (0..kv_dim)
            .map(|i| match i % 8 {
                0 => 70_000.0,
                1 => -1e6,
                2 => 3e-8,
                3 => -6.1e-5,
                4 => 65_504.0,
                5 => 1.0 + 2f32.powi(-11),
                6 => -2e-5,
                _ => i as f32 * 0.37 - 5.0,
            })
            .collect();
        g16.kv_reserve(&mut kv16, 3, 1, 0);
        g16.kv_write(
            &mut kv16,
            0,
            &g16.upload(&vec![0.5; kv_dim], 1, kv_dim),
            &g16.upload(&special, 1, kv_dim),
            &g16.upload_meta(&[TokenMeta::causal(3, 0)]),
        );
        let one = run(
            g16,
            &kv16,
            &[TokenMeta::causal(3, 0)],
            &q[..n_heads * head_dim],
        );
        for (h, out) in one.chunks(head_dim).enumerate() {
            let kvh = h / (n_heads / n_kv_heads);
            let want: Vec<u32> = special[kvh * head_dim..(kvh + 1) * head_dim]
                .iter()
                .map(|&x| KvType::F16.round(x).to_bits())
                .collect();
            assert_eq!(out, &want[..], "{what}: head {h} reads its values back");
        }
        let got = run(g16, &kv16, &meta, &q);
        assert_eq!(got, run(g32, &kv32, &meta, &q), "{what}: batch");
        // Token by token on the f16 cache: the batch's bits.
        let w = n_heads * head_dim;
        for (i, m) in meta.iter().enumerate() {
            let one = run(g16, &kv16, std::slice::from_ref(m), &q[i * w..(i + 1) * w]);
            assert_eq!(one, got[i * w..(i + 1) * w], "{what}: token {i} alone");
        }
    }
}

#[test]
fn attention_long_context() {
    on_each_kv_type(attention_long_context_on);
}

fn attention_long_context_on(g: &CudaBackend, kv: KvType) {
    let c = cpu_kv(kv);
    let (layers, n_heads, n_kv_heads, head_dim) = (1, 4, 1, 128);
    let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
    let len = 20_000;
    let (kvg, kvc) = filled_kv(g, c, layers, n_kv_heads, head_dim, &[len], 90);
    let meta = vec![
        TokenMeta::causal(0, (len - 1) as u32),
        TokenMeta::causal(0, 12_345),
    ];
    let q = random_vec(2 * n_heads * head_dim, -3.0, 3.0, 91);
    let mut og = g.tensor(0, 0);
    let mut oc = c.tensor(0, 0);
    g.attention(
        &g.upload(&q, 2, n_heads * head_dim),
        &kvg,
        0,
        &g.upload_meta(&meta),
        shape,
        &mut og,
    );
    c.attention(
        &c.upload(&q, 2, n_heads * head_dim),
        &kvc,
        0,
        &c.upload_meta(&meta),
        shape,
        &mut oc,
    );
    let want = c.to_host(&oc);
    assert_close(
        "attention 20k keys",
        &g.to_host(&og),
        &want,
        &vec![1.0; want.len()],
        1e-5,
        0.0,
    );
}

#[test]
fn kv_grow_truncate_copy_release() {
    on_each_kv_type(kv_grow_truncate_copy_release_on);
}

fn kv_grow_truncate_copy_release_on(g: &CudaBackend, kv: KvType) {
    let c = cpu_kv(kv);
    let (layers, n_heads, n_kv_heads, head_dim) = (3, 2, 1, 32);
    let kv_dim = n_kv_heads * head_dim;
    let shape = AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        scale: 0.2,
    };
    assert_eq!(g.kv_capacity(&g.kv_new(layers, n_kv_heads, head_dim), 0), 0);
    let (mut kvg, mut kvc) = filled_kv(g, c, layers, n_kv_heads, head_dim, &[8], 500);
    assert_eq!(g.kv_capacity(&kvg, 0), 8);

    // Grow row 0 keeping 6 positions (a rollback to 6), then write positions 6..20.
    g.kv_reserve(&mut kvg, 0, 40, 6);
    c.kv_reserve(&mut kvc, 0, 40, 6);
    assert_eq!(g.kv_capacity(&kvg, 0), 40);
    let meta: Vec<TokenMeta> = (6..20).map(|p| TokenMeta::causal(0, p)).collect();
    let (mg, mc) = (g.upload_meta(&meta), c.upload_meta(&meta));
    for layer in 0..layers {
        let k = random_vec(14 * kv_dim, -1.0, 1.0, 600 + layer as u64);
        let v = random_vec(14 * kv_dim, -1.0, 1.0, 700 + layer as u64);
        g.kv_write(
            &mut kvg,
            layer,
            &g.upload(&k, 14, kv_dim),
            &g.upload(&v, 14, kv_dim),
            &mg,
        );
        c.kv_write(
            &mut kvc,
            layer,
            &c.upload(&k, 14, kv_dim),
            &c.upload(&v, 14, kv_dim),
            &mc,
        );
    }
    // Fork row 0 into row 3, then release row 0 and reuse it with a small capacity.
    g.kv_copy_row(&mut kvg, 0, 3, 20);
    c.kv_copy_row(&mut kvc, 0, 3, 20);
    assert_eq!(g.kv_capacity(&kvg, 3), 40);
    let q = random_vec(n_heads * head_dim, -2.0, 2.0, 800);
    let attend = |row: u32,
                  kvg: &<CudaBackend as Backend>::Kv,
                  kvc: &<CpuBackend as Backend>::Kv,
                  layer: usize| {
        let m = [TokenMeta::causal(row, 19)];
        let mut og = g.tensor(0, 0);
        let mut oc = c.tensor(0, 0);
        g.attention(
            &g.upload(&q, 1, n_heads * head_dim),
            kvg,
            layer,
            &g.upload_meta(&m),
            shape,
            &mut og,
        );
        c.attention(
            &c.upload(&q, 1, n_heads * head_dim),
            kvc,
            layer,
            &c.upload_meta(&m),
            shape,
            &mut oc,
        );
        (g.to_host(&og), c.to_host(&oc))
    };
    for layer in 0..layers {
        let (g0, c0) = attend(0, &kvg, &kvc, layer);
        let (g3, c3) = attend(3, &kvg, &kvc, layer);
        assert_close(
            "attention after grow",
            &g0,
            &c0,
            &vec![1.0; c0.len()],
            1e-5,
            0.0,
        );
        assert_eq!(bits(&c0), bits(&c3), "cpu copy");
        assert_eq!(bits(&g0), bits(&g3), "a copied row attends like its source");
    }
    g.kv_release(&mut kvg, 0);
    c.kv_release(&mut kvc, 0);
    assert_eq!(g.kv_capacity(&kvg, 0), 0);
    // Row 3 is independent of row 0's storage.
    for layer in 0..layers {
        let (g3, c3) = attend(3, &kvg, &kvc, layer);
        assert_close(
            "attention after release",
            &g3,
            &c3,
            &vec![1.0; c3.len()],
            1e-5,
            0.0,
        );
    }
    g.kv_reserve(&mut kvg, 0, 4, 0);
    assert_eq!(g.kv_capacity(&kvg, 0), 4);
}

#[test]
fn decode_and_verify_layers_agree_bit_for_bit() {
    on_each_kv_type(|g, _| decode_and_verify_layers_agree_bit_for_bit_on(g));
}

fn decode_and_verify_layers_agree_bit_for_bit_on(g: &CudaBackend) {
    // A miniature transformer layer step (norm, q/k/v, rope, kv write, attention, o, mlp) run
    // for a block of 16 tokens at once and token by token must give the same bits: what the
    // lossless contract asks of verify (M = block) against decode (M = 1).
    let (hidden, n_heads, n_kv_heads, head_dim, inter) =
        (256usize, 4usize, 2usize, 32usize, 512usize);
    let kv_dim = n_kv_heads * head_dim;
    let shape = common::attn_shape(n_heads, n_kv_heads, head_dim);
    let wq = g
        .upload_weight(
            &random_weight(DType::Q4_1, n_heads * head_dim, hidden, 1),
            WeightRole::Projection,
        )
        .unwrap();
    let wk = g
        .upload_weight(
            &random_weight(DType::Q8_0, kv_dim, hidden, 2),
            WeightRole::Projection,
        )
        .unwrap();
    let wv = g
        .upload_weight(
            &random_weight(DType::Q4_0, kv_dim, hidden, 3),
            WeightRole::Projection,
        )
        .unwrap();
    let wo = g
        .upload_weight(
            &random_weight(DType::F16, hidden, n_heads * head_dim, 4),
            WeightRole::Projection,
        )
        .unwrap();
    let wg = g
        .upload_weight(
            &random_weight(DType::Q4K, inter, hidden, 5),
            WeightRole::Projection,
        )
        .unwrap();
    let wd = g
        .upload_weight(
            &random_weight(DType::Q6K, hidden, inter, 6),
            WeightRole::Projection,
        )
        .unwrap();
    let norm = g.upload(&random_vec(hidden, 0.5, 1.5, 7), 1, hidden);
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-((2 * i) as f32) / head_dim as f32))
        .collect();
    let inv = g.upload(&inv, 1, head_dim / 2);
    let prefix = 21;
    let block = 16;
    let x_all = random_vec((prefix + block) * hidden, -1.0, 1.0, 8);

    let step = |kv: &mut <CudaBackend as Backend>::Kv, x: &[f32], start: usize| -> Vec<f32> {
        let t = x.len() / hidden;
        let meta: Vec<TokenMeta> = (0..t)
            .map(|i| TokenMeta::causal(0, (start + i) as u32))
            .collect();
        let meta = g.upload_meta(&meta);
        let mut xt = g.upload(x, t, hidden);
        let (mut h, mut q, mut k, mut v, mut att, mut o, mut gate) = (
            g.tensor(0, 0),
            g.tensor(0, 0),
            g.tensor(0, 0),
            g.tensor(0, 0),
            g.tensor(0, 0),
            g.tensor(0, 0),
            g.tensor(0, 0),
        );
        g.rms_norm(&mut xt, &norm, 1e-5, false, Some(&mut h));
        g.matmul_many(&h, &[&wq, &wk, &wv], &mut [&mut q, &mut k, &mut v]);
        g.rope(&mut q, &meta, &inv, head_dim, RopeStyle::Neox);
        g.rope(&mut k, &meta, &inv, head_dim, RopeStyle::Neox);
        g.kv_write(kv, 0, &k, &v, &meta);
        g.attention(&q, kv, 0, &meta, shape, &mut att);
        g.matmul(&att, &wo, &mut o);
        g.add(&mut xt, &o);
        g.matmul(&xt, &wg, &mut gate);
        let up = g.upload(&g.to_host(&gate), t, inter);
        g.silu_mul(&mut gate, &up);
        g.matmul(&gate, &wd, &mut o);
        g.add(&mut xt, &o);
        g.to_host(&xt)
    };

    let mut kv_a = g.kv_new(1, n_kv_heads, head_dim);
    g.kv_reserve(&mut kv_a, 0, 64, 0);
    step(&mut kv_a, &x_all[..prefix * hidden], 0);
    let verify = step(&mut kv_a, &x_all[prefix * hidden..], prefix);

    let mut kv_b = g.kv_new(1, n_kv_heads, head_dim);
    g.kv_reserve(&mut kv_b, 0, 64, 0);
    step(&mut kv_b, &x_all[..prefix * hidden], 0);
    let mut decode = Vec::new();
    for i in 0..block {
        let r = prefix + i;
        decode.extend(step(&mut kv_b, &x_all[r * hidden..(r + 1) * hidden], r));
    }
    assert_eq!(
        bits(&verify),
        bits(&decode),
        "verify (M=16) differs from decode (M=1)"
    );
}
