//! The CUDA backend's fused ops, step inputs and graphs: each fusion against the ops it
//! replaces (bit for bit on the GPU; the q/k/v products with RoPE and the KV write in their
//! epilogue included), the small-M matmul tiles against each other for every
//! M = 1..20 (one reduction order: bit for bit) and the int8 tensor-core kernels' two block
//! widths against each other, split attention across split boundaries, and
//! a step replayed from a CUDA graph against the same step run eagerly; rows gathered into an
//! offset of a larger tensor; the int8 x the norm and the attention merge hand to the next
//! product against the quantizer's.
//!
//! Every test prints "skipped: no CUDA device (<reason>)" and returns when there is none.
#![cfg(feature = "cuda")]

mod common;

use common::{bits, cpu, gpu, on_each_kv_type, random_vec, random_weight};

use dflash_runtime::backend::{AttnShape, GraphKey, QkNorm, Rope, RopeStyle, RowSpan};
use dflash_runtime::cuda::{CudaBackend, CudaOptions, Int8Policy, KernelClassTime};
use dflash_runtime::{Backend, DType, KvType, TokenMeta, WeightRole};
use rand::{Rng, SeedableRng};

#[test]
fn every_m_from_1_to_20_gives_the_bits_of_m_1() {
    let Some(g) = gpu() else { return };
    // K = 576 (18 groups: a partial last step of 8 groups) and 1536; N not a multiple of any
    // block's rows.
    for (k, n) in [(576usize, 197usize), (1536, 61)] {
        // Projections (int8 activations in Q4_0/Q4_1/Q8_0), drafter weights (f32) and the
        // output head (f32; TF32 tensor cores in Q4_0/Q4_1/Q8_0).
        for (dtype, role) in DType::ALL.into_iter().flat_map(|d| {
            [
                (d, WeightRole::Projection),
                (d, WeightRole::Draft),
                (d, WeightRole::Vocab),
            ]
        }) {
            let k = if dtype.block_len() == 256 { 1536 } else { k };
            let w = g
                .upload_weight(&random_weight(dtype, n, k, 7 + k as u64), role)
                .unwrap();
            let x = random_vec(20 * k, -1.0, 1.0, 9);
            let mut alone = Vec::new();
            for r in 0..20 {
                let mut o = g.tensor(0, 0);
                g.matmul(&g.upload(&x[r * k..(r + 1) * k], 1, k), &w, &mut o);
                alone.extend(g.to_host(&o));
            }
            for m in 1..=20 {
                let mut o = g.tensor(0, 0);
                g.matmul(&g.upload(&x[..m * k], m, k), &w, &mut o);
                assert_eq!(
                    bits(&g.to_host(&o)),
                    bits(&alone[..m * n]),
                    "{dtype} {role:?} K={k}: M={m} differs from the rows alone"
                );
            }
        }
    }
}

#[test]
fn fused_matmuls_equal_the_ops_they_replace() {
    let Some(g) = gpu() else { return };
    for dtype in [
        DType::Q4_1,
        DType::Q8_0,
        DType::BF16,
        DType::Q4K,
        DType::Q6K,
    ] {
        let (k, n) = (512usize, 300usize);
        let wa = g
            .upload_weight(&random_weight(dtype, n, k, 1), WeightRole::Projection)
            .unwrap();
        let wb = g
            .upload_weight(&random_weight(dtype, n, k, 2), WeightRole::Projection)
            .unwrap();
        let wc = g
            .upload_weight(&random_weight(dtype, 77, k, 3), WeightRole::Projection)
            .unwrap();
        for m in [1usize, 3, 8, 16, 40] {
            let x = g.upload(&random_vec(m * k, -1.0, 1.0, 4 + m as u64), m, k);
            let base = random_vec(m * n, -3.0, 3.0, 5);

            // out += x · wᵀ
            let mut fused = g.upload(&base, m, n);
            let mut scratch = g.tensor(0, 0);
            g.matmul_add(&x, &wa, &mut fused, &mut scratch);
            let mut sep = g.upload(&base, m, n);
            let mut prod = g.tensor(0, 0);
            g.matmul(&x, &wa, &mut prod);
            g.add(&mut sep, &prod);
            assert_eq!(
                bits(&g.to_host(&fused)),
                bits(&g.to_host(&sep)),
                "matmul_add {dtype} M={m}"
            );

            // silu(x · gᵀ) * (x · uᵀ)
            let (mut fg, mut fu) = (g.tensor(0, 0), g.tensor(0, 0));
            g.matmul_swiglu(&x, &wa, &wb, &mut fg, &mut fu);
            let (mut sg, mut su) = (g.tensor(0, 0), g.tensor(0, 0));
            g.matmul(&x, &wa, &mut sg);
            g.matmul(&x, &wb, &mut su);
            g.silu_mul(&mut sg, &su);
            assert_eq!(
                bits(&g.to_host(&fg)),
                bits(&g.to_host(&sg)),
                "matmul_swiglu {dtype} M={m}"
            );

            // Three products in one launch (different N) against one at a time.
            let (mut o1, mut o2, mut o3) = (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
            g.matmul_many(&x, &[&wa, &wc, &wb], &mut [&mut o1, &mut o2, &mut o3]);
            for (w, o) in [(&wa, &o1), (&wc, &o2), (&wb, &o3)] {
                let mut single = g.tensor(0, 0);
                g.matmul(&x, w, &mut single);
                assert_eq!(
                    bits(&g.to_host(o)),
                    bits(&g.to_host(&single)),
                    "matmul_many {dtype} M={m}"
                );
            }
        }
    }
}

/// Tokens of rows with contexts around tile (32) and split boundaries, for `rope_kv_write`
/// and attention tests.
fn kv_setup(
    g: &CudaBackend,
    (kv_heads, head_dim): (usize, usize),
    lens: &[usize],
) -> <CudaBackend as Backend>::Kv {
    let kv_dim = kv_heads * head_dim;
    let mut kv = g.kv_new(1, kv_heads, head_dim);
    for (row, &len) in lens.iter().enumerate() {
        g.kv_reserve(&mut kv, row, len + 64, 0);
        let meta: Vec<TokenMeta> = (0..len)
            .map(|p| TokenMeta::causal(row as u32, p as u32))
            .collect();
        let k = random_vec(len * kv_dim, -1.0, 1.0, 100 + row as u64);
        let v = random_vec(len * kv_dim, -1.0, 1.0, 200 + row as u64);
        g.kv_write(
            &mut kv,
            0,
            &g.upload(&k, len, kv_dim),
            &g.upload(&v, len, kv_dim),
            &g.upload_meta(&meta),
        );
    }
    kv
}

/// `m` tokens of two rows with contexts `lens` (a decode row and a verify block: every third
/// token in row 1), each its own span on the CUDA-core path (no span is a prompt piece).
fn two_row_tokens(m: usize, lens: &[usize; 2]) -> (Vec<TokenMeta>, Vec<RowSpan>) {
    let meta: Vec<TokenMeta> = (0..m)
        .map(|i| {
            let row = usize::from(i % 3 == 0);
            TokenMeta::causal(row as u32, (lens[row] + i) as u32)
        })
        .collect();
    let spans = (0..m)
        .map(|i| RowSpan {
            row: meta[i].row,
            first: i as u32,
            count: 1,
            chunked: false,
            prompt: false,
        })
        .collect();
    (meta, spans)
}

/// The rotary frequencies of base 10000 for `head_dim`, on the GPU (`[1, head_dim / 2]`).
fn rope_freqs(g: &CudaBackend, head_dim: usize) -> <CudaBackend as Backend>::Tensor {
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 10000f32.powf(-((2 * i) as f32) / head_dim as f32))
        .collect();
    g.upload(&inv, 1, head_dim / 2)
}

#[test]
fn rope_kv_write_equals_rope_rope_kv_write_and_verify_equals_decode() {
    on_each_kv_type(|g, _| rope_kv_write_equals_rope_rope_kv_write_and_verify_equals_decode_on(g));
}

fn rope_kv_write_equals_rope_rope_kv_write_and_verify_equals_decode_on(g: &CudaBackend) {
    for (n_heads, n_kv_heads, head_dim) in [(9usize, 3usize, 64usize), (32, 8, 128), (8, 8, 64)] {
        let kv_dim = n_kv_heads * head_dim;
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let inv = rope_freqs(g, head_dim);
        // Row contexts just below, at and above tile and split boundaries (512 = 16 tiles:
        // beyond it a split holds several tiles).
        let lens = [31usize, 495, 512, 1000, 4100];
        let block = 17;
        let q = random_vec(block * n_heads * head_dim, -2.0, 2.0, 300);
        let k = random_vec(block * kv_dim, -1.0, 1.0, 301);
        let v = random_vec(block * kv_dim, -1.0, 1.0, 302);
        for (row, &len) in lens.iter().enumerate() {
            let meta: Vec<TokenMeta> = (0..block)
                .map(|i| TokenMeta::causal(row as u32, (len + i) as u32))
                .collect();
            // Fused and separate: same q, same cache, same attention.
            let mut kv_f = kv_setup(g, (n_kv_heads, head_dim), &lens);
            let mut kv_s = kv_setup(g, (n_kv_heads, head_dim), &lens);
            let mg = g.upload_meta(&meta);
            let mut qf = g.upload(&q, block, n_heads * head_dim);
            let mut kf = g.upload(&k, block, kv_dim);
            let vf = g.upload(&v, block, kv_dim);
            let rope = Rope {
                inv_freq: &inv,
                head_dim,
                style: RopeStyle::Neox,
            };
            g.rope_kv_write(&mut qf, &mut kf, &vf, &mut kv_f, 0, &mg, rope);
            let mut qs = g.upload(&q, block, n_heads * head_dim);
            let mut ks = g.upload(&k, block, kv_dim);
            g.rope(&mut qs, &mg, &inv, head_dim, RopeStyle::Neox);
            g.rope(&mut ks, &mg, &inv, head_dim, RopeStyle::Neox);
            g.kv_write(&mut kv_s, 0, &ks, &vf, &mg);
            assert_eq!(bits(&g.to_host(&qf)), bits(&g.to_host(&qs)), "rotated q");
            assert_eq!(bits(&g.to_host(&kf)), bits(&g.to_host(&ks)), "rotated k");
            let (mut af, mut asep) = (g.tensor(0, 0), g.tensor(0, 0));
            g.attention(&qf, &kv_f, 0, &mg, shape, &mut af);
            g.attention(&qs, &kv_s, 0, &mg, shape, &mut asep);
            let verify = g.to_host(&af);
            assert_eq!(
                bits(&verify),
                bits(&g.to_host(&asep)),
                "attention after fusion"
            );

            // Token by token (decode) gives the verify block's bits.
            let width = n_heads * head_dim;
            let qh = g.to_host(&qf);
            for (i, m) in meta.iter().enumerate() {
                let mut o = g.tensor(0, 0);
                g.attention(
                    &g.upload(&qh[i * width..(i + 1) * width], 1, width),
                    &kv_f,
                    0,
                    &g.upload_meta(std::slice::from_ref(m)),
                    shape,
                    &mut o,
                );
                assert_eq!(
                    bits(&g.to_host(&o)),
                    bits(&verify[i * width..(i + 1) * width]),
                    "heads {n_heads}/{n_kv_heads} dim {head_dim}: token {i} of the block at \
                     context {len} alone differs"
                );
            }
        }
    }
}

#[test]
fn qk_and_k_norm_rope_kv_write_equal_norms_then_rope_kv_write() {
    on_each_kv_type(|g, _| qk_and_k_norm_rope_kv_write_equal_norms_then_rope_kv_write_on(g));
}

/// `qk_norm_rope_kv_write`, and its keys-only form `k_norm_rope_kv_write`, against the norms
/// then `rope_kv_write`.
fn qk_and_k_norm_rope_kv_write_equal_norms_then_rope_kv_write_on(g: &CudaBackend) {
    // (heads, KV heads, head_dim, rotary pairs): Qwen3-4B's attention, the default model's
    // drafter-like one, a partial rotary embedding and the largest head size of the kernel.
    for (n_heads, n_kv_heads, head_dim, half) in [
        (32usize, 8usize, 128usize, 64usize),
        (9, 3, 64, 32),
        (4, 2, 128, 16),
        (4, 4, 256, 128),
    ] {
        let kv_dim = n_kv_heads * head_dim;
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let inv: Vec<f32> = (0..half)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / (2 * half) as f32))
            .collect();
        let inv = g.upload(&inv, 1, half);
        let qn = g.upload(&random_vec(head_dim, 0.5, 1.5, 400), 1, head_dim);
        let kn = g.upload(&random_vec(head_dim, 0.5, 1.5, 401), 1, head_dim);
        let eps = 1e-6;
        let lens = [31usize, 512, 1000];
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            for block in [1usize, 17] {
                let q = random_vec(block * n_heads * head_dim, -2.0, 2.0, 300 + block as u64);
                let k = random_vec(block * kv_dim, -1.0, 1.0, 301);
                let v = random_vec(block * kv_dim, -1.0, 1.0, 302);
                for (row, &len) in lens.iter().enumerate() {
                    let meta: Vec<TokenMeta> = (0..block)
                        .map(|i| TokenMeta::causal(row as u32, (len + i) as u32))
                        .collect();
                    let mg = g.upload_meta(&meta);
                    let rope = Rope {
                        inv_freq: &inv,
                        head_dim,
                        style,
                    };
                    let mut kv_f = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let mut qf = g.upload(&q, block, n_heads * head_dim);
                    let mut kf = g.upload(&k, block, kv_dim);
                    let vf = g.upload(&v, block, kv_dim);
                    let norm = QkNorm {
                        q: &qn,
                        k: &kn,
                        eps,
                    };
                    g.qk_norm_rope_kv_write(&mut qf, &mut kf, &vf, &mut kv_f, 0, &mg, norm, rope);
                    let mut kv_s = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let mut qs = g.upload(&q, block, n_heads * head_dim);
                    let mut ks = g.upload(&k, block, kv_dim);
                    g.rms_norm(&mut qs, &qn, eps, false, None);
                    g.rms_norm(&mut ks, &kn, eps, false, None);
                    g.rope_kv_write(&mut qs, &mut ks, &vf, &mut kv_s, 0, &mg, rope);
                    let what = format!(
                        "heads {n_heads}/{n_kv_heads} dim {head_dim} pairs {half} {style:?} \
                         block {block} context {len}"
                    );
                    assert_eq!(bits(&g.to_host(&qf)), bits(&g.to_host(&qs)), "q: {what}");
                    assert_eq!(bits(&g.to_host(&kf)), bits(&g.to_host(&ks)), "k: {what}");
                    // The caches: attention over them, every head and position read.
                    let (mut af, mut asep) = (g.tensor(0, 0), g.tensor(0, 0));
                    g.attention(&qf, &kv_f, 0, &mg, shape, &mut af);
                    g.attention(&qs, &kv_s, 0, &mg, shape, &mut asep);
                    assert_eq!(
                        bits(&g.to_host(&af)),
                        bits(&g.to_host(&asep)),
                        "attention: {what}"
                    );
                    // Keys only (a DFlash drafter's context write): the same k and cache.
                    let mut kv_k = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let mut kk = g.upload(&k, block, kv_dim);
                    g.k_norm_rope_kv_write(&mut kk, &vf, &mut kv_k, 0, &mg, (&kn, eps), rope);
                    assert_eq!(
                        bits(&g.to_host(&kk)),
                        bits(&g.to_host(&ks)),
                        "keys only k: {what}"
                    );
                    let mut ak = g.tensor(0, 0);
                    g.attention(&qs, &kv_k, 0, &mg, shape, &mut ak);
                    assert_eq!(
                        bits(&g.to_host(&ak)),
                        bits(&g.to_host(&asep)),
                        "keys only attention: {what}"
                    );
                }
            }
        }
    }
}

#[test]
fn qkv_rope_epilogue_equals_products_then_rope_kv_write() {
    on_each_kv_type(|g, _| qkv_rope_epilogue_equals_products_then_rope_kv_write_on(g));
}

fn qkv_rope_epilogue_equals_products_then_rope_kv_write_on(g: &CudaBackend) {
    // (heads, KV heads, head_dim, K): the default model's attention and a Qwen3-4B-like one.
    for (n_heads, n_kv_heads, head_dim, k) in
        [(9usize, 3usize, 64usize, 576usize), (8, 2, 128, 512)]
    {
        let (q_cols, kv_dim) = (n_heads * head_dim, n_kv_heads * head_dim);
        let shape = AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let inv = rope_freqs(g, head_dim);
        for dtype in [
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_0,
            DType::BF16,
            DType::Q4K,
        ] {
            // K-quant super-blocks hold 256 values.
            let k = if dtype.block_len() == 256 { 512 } else { k };
            let w = |n: usize, seed: u64| {
                g.upload_weight(&random_weight(dtype, n, k, seed), WeightRole::Projection)
                    .unwrap()
            };
            let (wq, wk, wv) = (w(q_cols, 21), w(kv_dim, 22), w(kv_dim, 23));
            for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                let rope = Rope {
                    inv_freq: &inv,
                    head_dim,
                    style,
                };
                // Tokens of two rows (a decode row and a verify block), up to a prompt-sized
                // step on the CUDA-core path (no span is a prompt piece).
                for m in [1usize, 2, 5, 16, 17, 40] {
                    let lens = [200usize, 37];
                    let (meta, spans) = two_row_tokens(m, &lens);
                    let mg = g.upload_meta(&meta);
                    let x = g.upload(&random_vec(m * k, -1.0, 1.0, 30 + m as u64), m, k);
                    let mut kv_f = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let mut kv_s = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let (mut qf, mut kf, mut vf) = (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
                    g.step_qkv_rope_kv(
                        &x,
                        [&wq, &wk, &wv],
                        [&mut qf, &mut kf, &mut vf],
                        &mut kv_f,
                        0,
                        &mg,
                        rope,
                        &spans,
                    );
                    let (mut qs, mut ks, mut vs) = (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
                    g.matmul_many(&x, &[&wq, &wk, &wv], &mut [&mut qs, &mut ks, &mut vs]);
                    g.rope_kv_write(&mut qs, &mut ks, &vs, &mut kv_s, 0, &mg, rope);
                    let what = format!("{dtype} {style:?} heads {n_heads}/{n_kv_heads} M={m}");
                    for (a, b, name) in [(&qf, &qs, "q"), (&kf, &ks, "k"), (&vf, &vs, "v")] {
                        assert_eq!(bits(&g.to_host(a)), bits(&g.to_host(b)), "{what}: {name}");
                    }
                    // The caches: attention over every key of both rows, with random queries.
                    let probe: Vec<TokenMeta> = (0..2)
                        .map(|row| {
                            let end = meta
                                .iter()
                                .filter(|t| t.row == row)
                                .map(|t| t.pos + 1)
                                .max();
                            TokenMeta::causal(row, end.unwrap_or(lens[row as usize] as u32) - 1)
                        })
                        .collect();
                    let pm = g.upload_meta(&probe);
                    let pq = g.upload(&random_vec(2 * q_cols, -2.0, 2.0, 40), 2, q_cols);
                    let (mut af, mut asep) = (g.tensor(0, 0), g.tensor(0, 0));
                    g.attention(&pq, &kv_f, 0, &pm, shape, &mut af);
                    g.attention(&pq, &kv_s, 0, &pm, shape, &mut asep);
                    assert_eq!(
                        bits(&g.to_host(&af)),
                        bits(&g.to_host(&asep)),
                        "{what}: the KV caches differ"
                    );
                }
            }
        }
    }
}

/// The int8 tensor-core kernels' three block widths (4, 2 or 1 column tiles of 8; the host
/// picks one by product, `CudaBackend::qt_width`) give the same bits as each other
/// and as the default choice, in every epilogue (store, add, SwiGLU, three products in one
/// launch, and RoPE with the KV write), from 9 to 20 rows of x.
#[test]
fn int8_tensor_core_block_widths_give_the_same_bits() {
    if gpu().is_none() {
        return;
    }
    let open = |width: Option<usize>| {
        CudaBackend::with_options(CudaOptions {
            int8: common::int8_policy(),
            int8_mma_width: width,
            ..CudaOptions::from_env().unwrap()
        })
        .unwrap()
    };
    let backends = [open(Some(4)), open(Some(2)), open(Some(1)), open(None)];
    // The default model's attention (9 heads of 64 over 3 KV heads, K = 576) and a wider
    // product (K = 1536).
    let (n_heads, n_kv_heads, head_dim) = (9usize, 3usize, 64usize);
    let (q_cols, kv_dim) = (n_heads * head_dim, n_kv_heads * head_dim);
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        for m in [9usize, 16, 20] {
            let outputs: Vec<Vec<Vec<u32>>> = backends
                .iter()
                .map(|g| {
                    let mut got = Vec::new();
                    for (k, n) in [(576usize, 197usize), (1536, 61)] {
                        let w = |rows: usize, seed: u64| {
                            g.upload_weight(
                                &random_weight(dtype, rows, k, seed),
                                WeightRole::Projection,
                            )
                            .unwrap()
                        };
                        let (wa, wb, wc) = (w(n, 1), w(n, 2), w(77, 3));
                        let x = g.upload(&random_vec(m * k, -1.0, 1.0, 4 + m as u64), m, k);
                        let mut o = g.tensor(0, 0);
                        g.matmul(&x, &wa, &mut o);
                        got.push(bits(&g.to_host(&o)));
                        let mut sum = g.upload(&random_vec(m * n, -3.0, 3.0, 5), m, n);
                        let mut scratch = g.tensor(0, 0);
                        g.matmul_add(&x, &wa, &mut sum, &mut scratch);
                        got.push(bits(&g.to_host(&sum)));
                        let (mut fg, mut fu) = (g.tensor(0, 0), g.tensor(0, 0));
                        g.matmul_swiglu(&x, &wa, &wb, &mut fg, &mut fu);
                        got.push(bits(&g.to_host(&fg)));
                        let (mut o1, mut o2, mut o3) =
                            (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
                        g.matmul_many(&x, &[&wa, &wc, &wb], &mut [&mut o1, &mut o2, &mut o3]);
                        for o in [&o1, &o2, &o3] {
                            got.push(bits(&g.to_host(o)));
                        }
                    }
                    // q, k, v with RoPE and the KV write in the epilogue, then the caches.
                    let k = 576;
                    let w = |rows: usize, seed: u64| {
                        g.upload_weight(
                            &random_weight(dtype, rows, k, seed),
                            WeightRole::Projection,
                        )
                        .unwrap()
                    };
                    let (wq, wk, wv) = (w(q_cols, 21), w(kv_dim, 22), w(kv_dim, 23));
                    let inv = rope_freqs(g, head_dim);
                    let rope = Rope {
                        inv_freq: &inv,
                        head_dim,
                        style: RopeStyle::Neox,
                    };
                    let lens = [200usize, 37];
                    let (meta, spans) = two_row_tokens(m, &lens);
                    let mut kv = kv_setup(g, (n_kv_heads, head_dim), &lens);
                    let x = g.upload(&random_vec(m * k, -1.0, 1.0, 30 + m as u64), m, k);
                    let (mut q, mut kk, mut v) = (g.tensor(0, 0), g.tensor(0, 0), g.tensor(0, 0));
                    g.step_qkv_rope_kv(
                        &x,
                        [&wq, &wk, &wv],
                        [&mut q, &mut kk, &mut v],
                        &mut kv,
                        0,
                        &g.upload_meta(&meta),
                        rope,
                        &spans,
                    );
                    for o in [&q, &kk, &v] {
                        got.push(bits(&g.to_host(o)));
                    }
                    // The caches: attention over every key of both rows, with random queries.
                    let probe: Vec<TokenMeta> = (0..2u32)
                        .map(|row| {
                            let end = meta.iter().filter(|t| t.row == row).map(|t| t.pos).max();
                            TokenMeta::causal(row, end.unwrap_or(lens[row as usize] as u32 - 1))
                        })
                        .collect();
                    let shape = AttnShape {
                        n_heads,
                        n_kv_heads,
                        head_dim,
                        scale: 0.125,
                    };
                    let pq = g.upload(&random_vec(2 * q_cols, -2.0, 2.0, 40), 2, q_cols);
                    let mut att = g.tensor(0, 0);
                    g.attention(&pq, &kv, 0, &g.upload_meta(&probe), shape, &mut att);
                    got.push(bits(&g.to_host(&att)));
                    got
                })
                .collect();
            for (i, other) in outputs.iter().enumerate().skip(1) {
                for (j, (a, b)) in outputs[0].iter().zip(other).enumerate() {
                    assert!(
                        a == b,
                        "{dtype} M={m}: output {j} of backend {i} differs from the wide blocks'"
                    );
                }
            }
        }
    }
}

#[test]
fn step_inputs_feed_embed_and_gather() {
    let Some(g) = gpu() else { return };
    let table = g
        .upload_weight(
            &random_weight(DType::Q8_0, 1000, 64, 11),
            WeightRole::Embedding,
        )
        .unwrap();
    let mut step = g.step_new();
    for (t, seed) in [(3usize, 1u64), (40, 2), (1, 3), (600, 4)] {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        let ids: Vec<u32> = (0..t).map(|_| r.random_range(0..1000)).collect();
        let sel: Vec<u32> = (0..t.min(5)).map(|i| (t - 1 - i) as u32).collect();
        let meta: Vec<TokenMeta> = (0..t).map(|i| TokenMeta::causal(0, i as u32)).collect();
        g.step_upload(&mut step, &meta, &ids, &sel);
        assert_eq!(g.step_meta(&step).tokens(), &meta[..]);
        let (mut e1, mut e2) = (g.tensor(0, 0), g.tensor(0, 0));
        g.embed_step(&table, &step, &mut e1);
        g.embed(&table, &ids, &mut e2);
        assert_eq!(
            bits(&g.to_host(&e1)),
            bits(&g.to_host(&e2)),
            "embed_step t={t}"
        );
        let (mut s1, mut s2) = (g.tensor(0, 0), g.tensor(0, 0));
        g.gather_step(&e1, &step, &mut s1);
        g.gather_rows(&e1, &sel, &mut s2);
        assert_eq!(
            bits(&g.to_host(&s1)),
            bits(&g.to_host(&s2)),
            "gather_step t={t}"
        );
    }
}

#[test]
fn gather_rows_at_writes_at_the_offset_and_keeps_the_other_rows() {
    let Some(g) = gpu() else { return };
    let cols = 300;
    let x = random_vec(20 * cols, -1.0, 1.0, 21);
    let base = random_vec(50 * cols, -1.0, 1.0, 22);
    let rows = [19u32, 0, 7, 7, 3];
    for at in [0usize, 1, 45] {
        let mut out = g.upload(&base, 50, cols);
        g.gather_rows_at(&g.upload(&x, 20, cols), &rows, &mut out, at);
        let mut want = base.clone();
        for (i, &r) in rows.iter().enumerate() {
            let r = r as usize;
            want[(at + i) * cols..(at + i + 1) * cols]
                .copy_from_slice(&x[r * cols..(r + 1) * cols]);
        }
        assert_eq!(g.shape(&out), (50, cols));
        assert_eq!(bits(&g.to_host(&out)), bits(&want), "at {at}");
    }
}

#[test]
fn graph_replays_equal_eager_steps() {
    on_each_kv_type(|g, _| graph_replays_equal_eager_steps_on(g));
}

fn graph_replays_equal_eager_steps_on(g: &CudaBackend) {
    let (hidden, vocab) = (128usize, 500usize);
    let table = g
        .upload_weight(
            &random_weight(DType::Q4_1, vocab, hidden, 21),
            WeightRole::Embedding,
        )
        .unwrap();
    let w = g
        .upload_weight(
            &random_weight(DType::Q4_0, hidden, hidden, 22),
            WeightRole::Projection,
        )
        .unwrap();
    let head = g
        .upload_weight(
            &random_weight(DType::Q8_0, vocab, hidden, 23),
            WeightRole::Vocab,
        )
        .unwrap();
    let norm = g.upload(&random_vec(hidden, 0.5, 1.5, 24), 1, hidden);
    let owner = g.graph_owner();
    // A step of 4 tokens: embed, norm, a residual product, gather 2 rows, head. The graph
    // path keeps its buffers for every call (as a model's workspace does).
    struct Bufs {
        x: <CudaBackend as Backend>::Tensor,
        h: <CudaBackend as Backend>::Tensor,
        o: <CudaBackend as Backend>::Tensor,
        sel: <CudaBackend as Backend>::Tensor,
        logits: <CudaBackend as Backend>::Tensor,
    }
    let bufs = || Bufs {
        x: g.tensor(4, hidden),
        h: g.tensor(4, hidden),
        o: g.tensor(4, hidden),
        sel: g.tensor(2, hidden),
        logits: g.tensor(2, vocab),
    };
    let run =
        |step: &mut <CudaBackend as Backend>::Step, b: &mut Bufs, ids: &[u32], graph: bool| {
            let meta: Vec<TokenMeta> = (0..ids.len())
                .map(|i| TokenMeta::causal(0, i as u32))
                .collect();
            g.step_upload(step, &meta, ids, &[3, 1]);
            let mut work = || {
                g.embed_step(&table, step, &mut b.x);
                g.rms_norm(&mut b.x, &norm, 1e-5, false, Some(&mut b.h));
                g.matmul_add(&b.h, &w, &mut b.x, &mut b.o);
                g.gather_step(&b.x, step, &mut b.sel);
                g.matmul(&b.sel, &head, &mut b.logits);
            };
            if graph {
                let key = GraphKey {
                    owner,
                    tokens: 4,
                    rows: 2,
                    variant: 0,
                };
                g.graph(key, &mut work);
            } else {
                work();
            }
            g.to_host(&b.logits)
        };
    let (mut eager_step, mut eager_bufs) = (g.step_new(), bufs());
    let (mut graph_step, mut graph_bufs) = (g.step_new(), bufs());
    // Run the graph path many times (eager, capture, replays) with new ids each time.
    for i in 0..6u32 {
        let ids = [i * 7 % 500, 3 + i, 499 - i, 250];
        let want = run(&mut eager_step, &mut eager_bufs, &ids, false);
        let got = run(&mut graph_step, &mut graph_bufs, &ids, true);
        assert_eq!(bits(&got), bits(&want), "step {i}: graph path differs");
    }
    if !g.graphs_enabled() {
        println!("note: DFLASH_CUDA_GRAPHS=0: the graph path ran eagerly");
    }
}

/// Launches of kernel class `class` in a profile.
fn launches(profile: &[KernelClassTime], class: &str) -> usize {
    profile
        .iter()
        .filter(|c| c.class == class)
        .map(|c| c.launches)
        .sum()
}

/// The RMS norm and the attention merge write the int8 copy of their output for the int8
/// products that follow (no quantizer launch), with the quantizer's bits; a launch that writes
/// x in between makes the next product quantize x again. With one-term and with two-term int8
/// activations.
#[test]
fn int8_x_from_norm_and_attention_equals_the_quantizer() {
    if gpu().is_none() {
        return;
    }
    for policy in [Int8Policy::All, Int8Policy::TwoTerms] {
        norm_and_attention_handoff(policy);
    }
}

fn norm_and_attention_handoff(policy: Int8Policy) {
    // A backend of its own, so that the launch counts are this test's alone; its KV cache
    // holds f32, as the CPU reference's.
    let opts = CudaOptions {
        int8: policy,
        kv_type: KvType::F32,
        ..CudaOptions::from_env().unwrap()
    };
    let g = &CudaBackend::with_options(opts).unwrap();
    // The default model's attention: 9 heads of 64 over 3 KV heads, K = 576.
    let (n_heads, n_kv_heads, head_dim) = (9usize, 3usize, 64usize);
    let (k, kv_dim) = (n_heads * head_dim, n_kv_heads * head_dim);
    let shape = AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        scale: 0.125,
    };
    let ctx = 70;
    let mut kv = g.kv_new(1, n_kv_heads, head_dim);
    g.kv_reserve(&mut kv, 0, ctx, 0);
    let all: Vec<TokenMeta> = (0..ctx as u32).map(|p| TokenMeta::causal(0, p)).collect();
    g.kv_write(
        &mut kv,
        0,
        &g.upload(&random_vec(ctx * kv_dim, -1.0, 1.0, 61), ctx, kv_dim),
        &g.upload(&random_vec(ctx * kv_dim, -1.0, 1.0, 62), ctx, kv_dim),
        &g.upload_meta(&all),
    );
    let norm_host = random_vec(k, 0.5, 1.5, 63);
    let norm_w = g.upload(&norm_host, 1, k);
    // The CPU's norm (which the plain GPU norm equals bit for bit, cuda_ops.rs).
    let c = cpu();
    let cpu_norm = |x: &[f32], m: usize| -> Vec<u32> {
        let mut o = c.tensor(0, 0);
        let nw = c.upload(&norm_host, 1, k);
        c.rms_norm(&mut c.upload(x, m, k), &nw, 1e-5, false, Some(&mut o));
        bits(&c.to_host(&o))
    };
    for (di, dtype) in [DType::Q4_0, DType::Q4_1, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        let seed = 70 + 10 * di as u64;
        let w = g
            .upload_weight(&random_weight(dtype, 197, k, seed), WeightRole::Projection)
            .unwrap();
        let w2 = g
            .upload_weight(
                &random_weight(dtype, 61, k, seed + 1),
                WeightRole::Projection,
            )
            .unwrap();
        // The products of x from the host (an upload: the quantizer runs).
        let reference = |x: &[f32], m: usize| -> Vec<u32> {
            let xg = g.upload(x, m, k);
            let (mut a, mut b) = (g.tensor(0, 0), g.tensor(0, 0));
            g.matmul(&xg, &w, &mut a);
            g.matmul(&xg, &w2, &mut b);
            bits(&[g.to_host(&a), g.to_host(&b)].concat())
        };
        // 1 row (decode), 3 (dp4a tiles), 16 (integer tensor cores), 40 (the norm for
        // prompt rows).
        for m in [1usize, 3, 16, 40] {
            let what = format!("{dtype} M={m} {policy:?}");
            let x = random_vec(m * k, -3.0, 3.0, seed + m as u64);
            // Outputs at their size up front: an allocation (a zeroing copy) would forget the
            // int8 copy too.
            let (mut h, mut a, mut b) = (g.tensor(m, k), g.tensor(m, 197), g.tensor(m, 61));

            // Norm, then two products of its output.
            g.set_profiling(true);
            g.rms_norm(&mut g.upload(&x, m, k), &norm_w, 1e-5, false, Some(&mut h));
            g.matmul(&h, &w, &mut a);
            g.matmul(&h, &w2, &mut b);
            let profile = g.take_profile();
            g.set_profiling(false);
            assert_eq!(launches(&profile, "quant_q8"), 0, "{what}: {profile:?}");
            assert_eq!(launches(&profile, "matmul"), 2, "{what}: {profile:?}");
            // The quantizing norm's f32 output is the plain norm's.
            assert_eq!(bits(&g.to_host(&h)), cpu_norm(&x, m), "{what}: norm output");
            let got = bits(&[g.to_host(&a), g.to_host(&b)].concat());
            assert_eq!(got, reference(&g.to_host(&h), m), "{what}: after the norm");

            // A launch that writes x between the norm and the product.
            g.rms_norm(&mut g.upload(&x, m, k), &norm_w, 1e-5, false, Some(&mut h));
            g.scale(&mut h, 0.75);
            g.set_profiling(true);
            g.matmul(&h, &w, &mut a);
            let profile = g.take_profile();
            g.set_profiling(false);
            assert_eq!(launches(&profile, "quant_q8"), 1, "{what}: {profile:?}");
            let got = bits(&g.to_host(&a));
            let want = reference(&g.to_host(&h), m);
            assert_eq!(got, want[..m * 197], "{what}: after a write into x");

            // Attention of m tokens at the end of the context, then two products.
            let meta: Vec<TokenMeta> = (ctx - m..ctx)
                .map(|p| TokenMeta::causal(0, p as u32))
                .collect();
            let q = g.upload(&random_vec(m * k, -2.0, 2.0, seed + 7), m, k);
            g.set_profiling(true);
            g.attention(&q, &kv, 0, &g.upload_meta(&meta), shape, &mut h);
            g.matmul(&h, &w, &mut a);
            g.matmul(&h, &w2, &mut b);
            let profile = g.take_profile();
            g.set_profiling(false);
            assert_eq!(launches(&profile, "quant_q8"), 0, "{what}: {profile:?}");
            let got = bits(&[g.to_host(&a), g.to_host(&b)].concat());
            assert_eq!(got, reference(&g.to_host(&h), m), "{what}: after attention");
        }
    }
}

/// The int8 SwiGLU product of few rows writes the int8 copy of its output for the down
/// projection with the quantizer's bits, with one-term and with two-term int8 activations.
#[test]
fn int8_x_from_swiglu_equals_the_quantizer() {
    if gpu().is_none() {
        return;
    }
    for policy in [Int8Policy::All, Int8Policy::TwoTerms] {
        swiglu_handoff(policy);
    }
}

fn swiglu_handoff(policy: Int8Policy) {
    // Backends of their own (launch counts are this test's alone): the SwiGLU product writes
    // the int8 copy of its output (`mmqs_*`) or leaves it to the quantizer.
    let backend = |swiglu_q8| {
        CudaBackend::with_options(CudaOptions {
            int8: policy,
            swiglu_q8,
            ..CudaOptions::from_env().unwrap()
        })
        .unwrap()
    };
    let (on, off) = (&backend(true), &backend(false));
    // K = 576 (the default model's), 640 gate/up rows (20 blocks of 32 outputs: fewer than
    // any GPU's SMs it would run on, so the kernel is taken), a down projection of 61 rows.
    let (k, n, nd) = (576usize, 640usize, 61usize);
    for (di, dtype) in [DType::Q4_0, DType::Q4_1, DType::Q8_0]
        .into_iter()
        .enumerate()
    {
        let seed = 170 + 10 * di as u64;
        let host = [
            random_weight(dtype, n, k, seed),
            random_weight(dtype, n, k, seed + 1),
            random_weight(dtype, nd, n, seed + 2),
        ];
        let weights = |g: &CudaBackend| {
            host.clone()
                .map(|w| g.upload_weight(&w, WeightRole::Projection).unwrap())
        };
        let (w_on, w_off) = (weights(on), weights(off));
        // 1, 2, 3, 4 rows (the dp4a tiles: the copy comes from the SwiGLU kernel), 5 and 16
        // (integer tensor cores: the quantizer runs).
        for m in [1usize, 2, 3, 4, 5, 16] {
            let what = format!("{dtype} M={m} {policy:?}");
            let x = random_vec(m * k, -3.0, 3.0, seed + m as u64);
            // SwiGLU of x from the host, then the down product of its output: both outputs'
            // bits and the quantizer launches.
            let run = |g: &CudaBackend, w: &[_; 3]| {
                let xg = g.upload(&x, m, k);
                // Outputs at their size up front: an allocation would forget the int8 copy.
                let (mut h, mut s, mut o) = (g.tensor(m, n), g.tensor(m, n), g.tensor(m, nd));
                g.set_profiling(true);
                g.matmul_swiglu(&xg, &w[0], &w[1], &mut h, &mut s);
                g.matmul(&h, &w[2], &mut o);
                let profile = g.take_profile();
                g.set_profiling(false);
                let h_host = g.to_host(&h);
                // The down product of the same values uploaded from the host (the quantizer).
                let mut r = g.tensor(0, 0);
                g.matmul(&g.upload(&h_host, m, n), &w[2], &mut r);
                (
                    bits(&h_host),
                    bits(&g.to_host(&o)),
                    bits(&g.to_host(&r)),
                    launches(&profile, "quant_q8"),
                )
            };
            let (h1, o1, r1, q1) = run(on, &w_on);
            let (h0, o0, r0, q0) = run(off, &w_off);
            assert_eq!(h1, h0, "{what}: SwiGLU outputs");
            assert_eq!(
                o1, r1,
                "{what}: down product after the SwiGLU kernel's copy"
            );
            assert_eq!(o0, r0, "{what}: down product after the quantizer");
            assert_eq!(o1, o0, "{what}: down products");
            // x of the SwiGLU product always takes the quantizer (an upload); its output's
            // copy only from 5 rows (or with the copy off).
            assert_eq!(q1, if m <= 4 { 1 } else { 2 }, "{what}: quantizer launches");
            assert_eq!(q0, 2, "{what}: quantizer launches, copy off");
        }
    }
}
