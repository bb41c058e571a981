//! Kernel microbench of the CUDA backend: each weight format x M = 1, 2, 4, 8, 16 x the
//! projection shapes of a model, and split attention at contexts 128 .. 8k, as µs per call
//! and GB/s against the measured device-to-device copy bandwidth; and prompt (prefill) rows,
//! M = 64, 128, 512, on the CUDA-core kernel against the tensor-core kernels.
//!
//! ```text
//! cargo build --release -p dflash-runtime --features cuda --example cuda_microbench
//! cuda_microbench [--shapes smollm2|qwen3-4b|all] [--formats q4_0,q4_1,...] [--reps 50]
//!                 [--only matmul|attention|prefill] [--epi store|add|swiglu]
//!                 [--role projection|vocab] [--hot]
//! ```
//!
//! `--role` is what the products' weights are uploaded as: a target projection (default; int8
//! activations for the formats that have them) or the output head (f32 activations, the
//! head's path in the model).
//!
//! `--epi` picks the products' epilogue: the plain store (default), the residual add (the
//! o and down projections: out += x·Wᵀ), or SwiGLU (gate and up, two weights of the shape per
//! output: out = silu(x·gᵀ) * (x·uᵀ); bytes counted for both).
//!
//! Method: every measured call is one of `reps` launches captured in a CUDA graph (so launch
//! overhead is out, as in a captured decode step), the graph is replayed 5 times after a
//! warm-up and the median is reported. Weights rotate over enough copies to exceed the 60 MB
//! L2 cache, so each call reads its weight from HBM; with `--hot` every call reads the same
//! weight (one copy; two for SwiGLU), which stays in L2 where it fits. Bytes counted: the
//! weight once per call (matmul); the visible K and V once per call (attention), at the
//! cache's value size (`DFLASH_KV_CACHE=f16|f32`; f32 by default on a GPU).

use dflash_runtime::backend::{AttnShape, GraphKey, RowSpan};
use dflash_runtime::cuda::CudaBackend;
use dflash_runtime::{Backend, DType, HostWeight, TokenMeta, WeightBytes, WeightRole};
use rand::{Rng, SeedableRng};

struct Shapes {
    name: &'static str,
    /// (label, N, K) of the products.
    products: Vec<(&'static str, usize, usize)>,
    /// (heads, kv heads, head dim).
    attention: (usize, usize, usize),
}

fn shapes(which: &str) -> Vec<Shapes> {
    let smollm2 = Shapes {
        name: "smollm2-135m",
        products: vec![
            ("q/o 576x576", 576, 576),
            ("k/v 192x576", 192, 576),
            ("gate/up 1536x576", 1536, 576),
            ("down 576x1536", 576, 1536),
            ("head 49152x576", 49152, 576),
        ],
        attention: (9, 3, 64),
    };
    let qwen3_4b = Shapes {
        name: "qwen3-4b",
        products: vec![
            ("q 4096x2560", 4096, 2560),
            ("k/v 1024x2560", 1024, 2560),
            ("o 2560x4096", 2560, 4096),
            ("gate/up 9728x2560", 9728, 2560),
            ("down 2560x9728", 2560, 9728),
            ("head 151936x2560", 151936, 2560),
        ],
        attention: (32, 8, 128),
    };
    match which {
        "smollm2" => vec![smollm2],
        "qwen3-4b" => vec![qwen3_4b],
        _ => vec![smollm2, qwen3_4b],
    }
}

fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> HostWeight {
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let row_bytes = dtype.row_bytes(cols).expect("whole blocks");
    let mut bytes = vec![0u8; rows * row_bytes];
    r.fill(&mut bytes[..]);
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    let scales: &[usize] = match dtype {
        DType::Q4_0 | DType::Q8_0 => &[0],
        DType::Q4_1 | DType::Q4K => &[0, 2],
        DType::Q6K => &[208],
        _ => &[],
    };
    if scales.is_empty() {
        // Plain floats: small finite values (random bits could be NaN or huge).
        let width = dtype.block_bytes();
        for c in bytes.chunks_exact_mut(width) {
            let v = r.random_range(-1.0f32..1.0);
            match dtype {
                DType::F32 => c.copy_from_slice(&v.to_le_bytes()),
                DType::F16 => c.copy_from_slice(&f16(v)),
                _ => c.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
            }
        }
    } else {
        for blk in bytes.chunks_exact_mut(dtype.block_bytes()) {
            for &o in scales {
                blk[o..o + 2].copy_from_slice(&f16(r.random_range(-0.05f32..0.05)));
            }
        }
    }
    HostWeight::new(
        format!("w_{dtype}_{rows}x{cols}"),
        dtype,
        rows,
        cols,
        WeightBytes::from_vec(bytes),
    )
    .expect("consistent shape")
}

/// Median milliseconds of replaying `f` (captured as a graph after one eager run).
fn time_graph(g: &CudaBackend, owner: u64, tokens: usize, f: &mut dyn FnMut()) -> f64 {
    let key = GraphKey {
        owner,
        tokens,
        rows: 0,
        variant: 0,
    };
    g.graph(key, f); // eager: allocations
    g.graph(key, f); // capture and first replay
    let mut t: Vec<f64> = (0..5)
        .map(|_| g.time_gpu(&mut || g.graph(key, f)))
        .collect();
    t.sort_by(f64::total_cmp);
    t[2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut which = "all".to_string();
    let mut reps = 50usize;
    let mut only = String::new();
    let mut epi = String::from("store");
    let mut role = WeightRole::Projection;
    let mut hot = false;
    let mut formats = vec![
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
        DType::BF16,
        DType::F16,
    ];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--shapes" => which = val()?,
            "--reps" => reps = val()?.parse()?,
            "--only" => only = val()?,
            "--hot" => hot = true,
            "--epi" => {
                epi = val()?;
                if !["store", "add", "swiglu"].contains(&epi.as_str()) {
                    return Err(format!("--epi {epi}: expected store, add or swiglu").into());
                }
            }
            "--role" => {
                role = match val()?.as_str() {
                    "projection" => WeightRole::Projection,
                    "vocab" => WeightRole::Vocab,
                    r => return Err(format!("--role {r}: expected projection or vocab").into()),
                }
            }
            "--formats" => {
                formats = val()?
                    .split(',')
                    .map(|f| {
                        DType::ALL
                            .into_iter()
                            .find(|d| d.info().kernel_name == f || d.info().name == f)
                            .ok_or(format!("unknown format {f}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            _ => return Err(format!("unknown flag {a}").into()),
        }
    }
    let g = CudaBackend::new()?;
    g.preload(&formats)?;
    let bw = g.copy_bandwidth(2 << 30);
    println!(
        "# {} ({}); device-to-device copy {:.0} GB/s (read + write); {reps} launches per graph",
        g.device_name(),
        g.kernel_target(),
        bw
    );
    let owner = g.graph_owner();
    let mut variant_owner = owner * 1000;
    for sh in shapes(&which) {
        if only.is_empty() || only == "matmul" {
            println!(
                "\n## {} matmul, {epi} epilogue, weights as {role:?}{}: us per call (GB/s of \
                 weight, % of copy bandwidth)",
                sh.name,
                if hot { ", one copy (L2-hot)" } else { "" }
            );
            println!("| format | shape | M=1 | M=2 | M=4 | M=8 | M=16 |");
            println!("|---|---|---|---|---|---|---|");
            for &dtype in &formats {
                for &(label, n, k) in &sh.products {
                    if !k.is_multiple_of(dtype.block_len()) {
                        continue;
                    }
                    let weights = if epi == "swiglu" { 2 } else { 1 };
                    let bytes = weights * n * dtype.row_bytes(k).expect("whole blocks");
                    let copies = if hot {
                        weights
                    } else {
                        (256usize << 20).div_ceil(bytes).clamp(2, 64)
                    };
                    let ws: Vec<_> = (0..copies)
                        .map(|c| g.upload_weight(&random_weight(dtype, n, k, c as u64), role))
                        .collect::<Result<_, _>>()?;
                    let mut cells = Vec::new();
                    for m in [1usize, 2, 4, 8, 16] {
                        let mut r = rand::rngs::StdRng::seed_from_u64(m as u64);
                        let xv: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0..1.0)).collect();
                        let x = g.upload(&xv, m, k);
                        let mut out = g.tensor(m, n);
                        let mut scratch = g.tensor(m, n);
                        variant_owner += 1;
                        let ms = time_graph(&g, variant_owner, m, &mut || {
                            for i in 0..reps {
                                // SwiGLU takes copies 2i and 2i + 1 (no copy read twice in a row).
                                let w = &ws[(weights * i) % copies];
                                match epi.as_str() {
                                    "add" => g.matmul_add(&x, w, &mut out, &mut scratch),
                                    "swiglu" => g.matmul_swiglu(
                                        &x,
                                        w,
                                        &ws[(2 * i + 1) % copies],
                                        &mut out,
                                        &mut scratch,
                                    ),
                                    _ => g.matmul(&x, w, &mut out),
                                }
                            }
                        });
                        let us = 1000.0 * ms / reps as f64;
                        let gbs = bytes as f64 / (us * 1e-6) / 1e9;
                        cells.push(format!("{us:.2} ({gbs:.0}, {:.0}%)", 100.0 * gbs / bw));
                    }
                    println!("| {dtype} | {label} | {} |", cells.join(" | "));
                }
            }
        }
        if only.is_empty() || only == "prefill" {
            println!(
                "\n## {} prefill rows: us per call, CUDA cores (`matmul`) / tensor cores \
                 (`step_matmul_many`, every row a prompt row; prefill path {:?}) (TFLOP/s)",
                sh.name,
                g.prefill_gemm()
            );
            println!("| format | shape | M | CUDA cores | tensor cores | speedup |");
            println!("|---|---|---|---|---|---|");
            for &dtype in &formats {
                for &(label, n, k) in sh.products.iter().filter(|p| !p.0.starts_with("head")) {
                    if !k.is_multiple_of(dtype.block_len()) {
                        continue;
                    }
                    let w =
                        g.upload_weight(&random_weight(dtype, n, k, 7), WeightRole::Projection)?;
                    for m in [64usize, 128, 512] {
                        let mut r = rand::rngs::StdRng::seed_from_u64(m as u64);
                        let xv: Vec<f32> = (0..m * k).map(|_| r.random_range(-1.0..1.0)).collect();
                        let x = g.upload(&xv, m, k);
                        let mut out = g.tensor(m, n);
                        let spans = [RowSpan {
                            row: 0,
                            first: 0,
                            count: m as u32,
                            chunked: false,
                            prompt: true,
                        }];
                        let mut us = [0.0f64; 2];
                        for (tensor, slot) in us.iter_mut().enumerate() {
                            variant_owner += 1;
                            let ms = time_graph(&g, variant_owner, m, &mut || {
                                for _ in 0..reps {
                                    if tensor == 1 {
                                        g.step_matmul_many(&x, &[&w], &mut [&mut out], &spans);
                                    } else {
                                        g.matmul(&x, &w, &mut out);
                                    }
                                }
                            });
                            *slot = 1000.0 * ms / reps as f64;
                        }
                        let tflops = |us: f64| 2.0 * (m * n * k) as f64 / (us * 1e-6) / 1e12;
                        println!(
                            "| {dtype} | {label} | {m} | {:.2} ({:.1}) | {:.2} ({:.1}) | {:.2}x |",
                            us[0],
                            tflops(us[0]),
                            us[1],
                            tflops(us[1]),
                            us[0] / us[1]
                        );
                    }
                }
            }
        }
        if only.is_empty() || only == "attention" {
            let (heads, kv_heads, hd) = sh.attention;
            let kv_dim = kv_heads * hd;
            let shape = AttnShape {
                n_heads: heads,
                n_kv_heads: kv_heads,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            println!(
                "\n## {} attention ({heads} heads, {kv_heads} KV heads, dim {hd}), {} KV cache \
                 (DFLASH_KV_CACHE): us per call (GB/s of K+V)",
                sh.name,
                g.kv_type()
            );
            println!("| context | T=1 | T=16 (a verify block) |");
            println!("|---|---|---|");
            for ctx in [128usize, 512, 1024, 2048, 4096, 8192] {
                let mut kv = g.kv_new(1, kv_heads, hd);
                g.kv_reserve(&mut kv, 0, ctx + 16, 0);
                let meta: Vec<TokenMeta> = (0..ctx + 16)
                    .map(|p| TokenMeta::causal(0, p as u32))
                    .collect();
                let mut r = rand::rngs::StdRng::seed_from_u64(ctx as u64);
                let kvv: Vec<f32> = (0..(ctx + 16) * kv_dim)
                    .map(|_| r.random_range(-1.0..1.0))
                    .collect();
                let kt = g.upload(&kvv, ctx + 16, kv_dim);
                g.kv_write(&mut kv, 0, &kt, &kt, &g.upload_meta(&meta));
                let mut cells = Vec::new();
                for t in [1usize, 16] {
                    let tm: Vec<TokenMeta> = (0..t)
                        .map(|i| TokenMeta::causal(0, (ctx - 1 + i) as u32))
                        .collect();
                    let mg = g.upload_meta(&tm);
                    let qv: Vec<f32> = (0..t * heads * hd)
                        .map(|_| r.random_range(-1.0..1.0))
                        .collect();
                    let q = g.upload(&qv, t, heads * hd);
                    let mut out = g.tensor(t, heads * hd);
                    variant_owner += 1;
                    let ms = time_graph(&g, variant_owner, t, &mut || {
                        for _ in 0..reps {
                            g.attention(&q, &kv, 0, &mg, shape, &mut out);
                        }
                    });
                    let us = 1000.0 * ms / reps as f64;
                    let bytes = 2 * (ctx + t) * kv_dim * g.kv_value_bytes(&kv);
                    cells.push(format!("{us:.2} ({:.0})", bytes as f64 / (us * 1e-6) / 1e9));
                }
                println!("| {ctx} | {} |", cells.join(" | "));
            }
        }
    }
    Ok(())
}
