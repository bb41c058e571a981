//! The CUDA Gated DeltaNet ops against the CPU backend (the chunked prefill form against the
//! CPU's chunked form too), and the properties the lossless contract needs on the GPU itself:
//! a row's results do not depend on the batch, a block of tokens equals the same tokens one
//! at a time bit for bit, and a rollback gives exactly the state of a step that had only the
//! kept tokens.
//!
//! Every test opens the GPU first and prints "skipped: no CUDA device (<reason>)" and returns
//! when there is none; `gdn_kernels_compile_with_nvrtc` needs only NVRTC.
#![cfg(feature = "cuda")]

mod common;

use common::{cpu, gpu, random_vec};

use dflash_runtime::cuda::compile;
use dflash_runtime::{Backend, GdnShape, RowSpan};

fn shapes() -> [GdnShape; 3] {
    let s = |k_heads, v_heads, k_dim, v_dim, tiled_heads| GdnShape {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        conv_kernel: 4,
        tiled_heads,
    };
    [
        s(2, 4, 32, 16, false),
        s(2, 6, 32, 32, true),
        s(2, 2, 128, 128, false),
    ]
}

/// Inputs of one step: pre-conv qkv, conv weights, g (log decays), beta.
struct Step {
    x: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    spans: Vec<RowSpan>,
}

fn step(shape: &GdnShape, counts: &[(u32, u32)], seed: u64) -> Step {
    let t: u32 = counts.iter().map(|c| c.1).sum();
    let mut spans = Vec::new();
    let mut first = 0;
    for &(row, count) in counts {
        spans.push(RowSpan {
            row,
            first,
            count,
            chunked: false,
            prompt: false,
        });
        first += count;
    }
    let hv = shape.v_heads;
    Step {
        x: random_vec(t as usize * shape.conv_dim(), -1.0, 1.0, seed),
        g: random_vec(t as usize * hv, -1.5, -0.01, seed + 1),
        beta: random_vec(t as usize * hv, 0.05, 0.95, seed + 2),
        spans,
    }
}

/// Runs conv + gated delta for one layer of `s` on `b`; returns (conv out, delta out).
fn run<B: Backend>(
    b: &B,
    st: &mut B::Gdn,
    shape: &GdnShape,
    w: &B::Tensor,
    s: &Step,
) -> (Vec<f32>, Vec<f32>) {
    let t = s.g.len() / shape.v_heads;
    let x = b.upload(&s.x, t, shape.conv_dim());
    let g = b.upload(&s.g, t, shape.v_heads);
    let beta = b.upload(&s.beta, t, shape.v_heads);
    let (mut conv, mut out) = (
        b.tensor(0, shape.conv_dim()),
        b.tensor(0, shape.value_dim()),
    );
    b.run(|| {
        b.gdn_begin(st, &s.spans);
        b.causal_conv(st, 0, &x, w, &s.spans, &mut conv);
        b.gated_delta(st, 0, &conv, &g, &beta, &s.spans, &mut out);
    });
    (b.to_host(&conv), b.to_host(&out))
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i}: gpu {a} vs cpu {b}"
        );
    }
}

#[test]
fn gdn_kernels_compile_with_nvrtc() {
    if !compile::nvrtc_available() {
        println!("skipped: NVRTC not found ({})", compile::NVRTC_HINT);
        return;
    }
    for target in [
        compile::Target {
            arch: 90,
            cubin: true,
        },
        compile::Target {
            arch: 90,
            cubin: false,
        },
    ] {
        let img = compile::compile(compile::Module::Gdn, target)
            .unwrap_or_else(|e| panic!("gdn.cu for {}: {e}", target.arch_flag()));
        println!("gdn.cu -> {} bytes for {}", img.len(), target.arch_flag());
        assert!(!img.is_empty());
    }
}

#[test]
fn conv_and_delta_match_the_cpu_over_steps() {
    let Some(gb) = gpu() else { return };
    let cb = cpu();
    for (si, shape) in shapes().iter().enumerate() {
        let w = random_vec(shape.conv_dim() * 4, -0.5, 0.5, 90 + si as u64);
        let (wc, wg) = (
            cb.upload(&w, shape.conv_dim(), 4),
            gb.upload(&w, shape.conv_dim(), 4),
        );
        let (mut sc, mut sg) = (cb.gdn_new(1, *shape, 16), gb.gdn_new(1, *shape, 16));
        for r in 0..3 {
            cb.gdn_open_row(&mut sc, r);
            gb.gdn_open_row(&mut sg, r);
        }
        // Rows at different lengths, several steps: the states carry over.
        for (k, counts) in [
            vec![(0, 5), (1, 1), (2, 9)],
            vec![(2, 1), (0, 3)],
            vec![(1, 7), (0, 1), (2, 2)],
        ]
        .iter()
        .enumerate()
        {
            let s = step(shape, counts, 1000 * si as u64 + k as u64);
            let (c_conv, c_out) = run(cb, &mut sc, shape, &wc, &s);
            let (g_conv, g_out) = run(gb, &mut sg, shape, &wg, &s);
            assert_close(&format!("shape {si} step {k} conv"), &g_conv, &c_conv, 1e-5);
            assert_close(&format!("shape {si} step {k} delta"), &g_out, &c_out, 1e-4);
        }
    }
}

/// Runs only the gated delta rule of `s` on `b`, `s.x` taken as the post-conv qkv (so both
/// backends get the same inputs bit for bit).
fn delta_only<B: Backend>(b: &B, st: &mut B::Gdn, shape: &GdnShape, s: &Step) -> Vec<f32> {
    let t = s.g.len() / shape.v_heads;
    let qkv = b.upload(&s.x, t, shape.conv_dim());
    let g = b.upload(&s.g, t, shape.v_heads);
    let beta = b.upload(&s.beta, t, shape.v_heads);
    let mut out = b.tensor(0, shape.value_dim());
    b.run(|| {
        b.gdn_begin(st, &s.spans);
        b.gated_delta(st, 0, &qkv, &g, &beta, &s.spans, &mut out);
    });
    b.to_host(&out)
}

/// A step of `rows` (row, tokens, chunked).
fn chunk_step(shape: &GdnShape, rows: &[(u32, u32, bool)], seed: u64) -> Step {
    let counts: Vec<(u32, u32)> = rows.iter().map(|r| (r.0, r.1)).collect();
    let mut s = step(shape, &counts, seed);
    for (sp, r) in s.spans.iter_mut().zip(rows) {
        sp.chunked = r.2;
    }
    s
}

/// The chunked form on the GPU against the CPU's chunked form, on the same inputs. The GPU
/// kernel follows the CPU's formula and summation orders; only exp differs (glibc's expf on
/// the CPU, exp in double rounded to f32 on the GPU, which part by one ulp now and then), so
/// the results agree to about 1e-9 relative; the bound asserted is 1e-6 (1 + |cpu|).
#[test]
fn chunked_prefill_matches_the_cpu_chunked_form() {
    let Some(gb) = gpu() else { return };
    let cb = cpu();
    let s = |k_heads, v_heads, k_dim, v_dim, tiled_heads| GdnShape {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        conv_kernel: 4,
        tiled_heads,
    };
    // Qwen3.5-like heads (k_dim = v_dim = 128) with GQA ratios 2 (grouped) and 3 (tiled);
    // narrow heads (a partly used column tile) and a v_dim that is not a multiple of 32.
    let shapes = [
        s(2, 4, 128, 128, false),
        s(2, 6, 128, 128, true),
        s(2, 4, 32, 16, false),
        s(1, 2, 64, 48, true),
    ];
    for (si, shape) in shapes.iter().enumerate() {
        let (mut sc, mut sg) = (cb.gdn_new(1, *shape, 16), gb.gdn_new(1, *shape, 16));
        for r in 0..4 {
            cb.gdn_open_row(&mut sc, r);
            gb.gdn_open_row(&mut sg, r);
        }
        // Ragged prefill pieces (several chunks, partial last chunks, one shorter than a
        // chunk), then a step mixing chunked and token-by-token rows, then one decode token
        // per row (which reads the states the chunked steps left).
        let steps = [
            vec![(0, 130, true), (1, 64, true), (2, 37, true), (3, 200, true)],
            vec![(1, 70, true), (0, 3, false), (3, 1, false), (2, 65, true)],
            vec![(3, 1, false), (2, 1, false), (1, 1, false), (0, 1, false)],
        ];
        for (k, rows) in steps.iter().enumerate() {
            let st = chunk_step(shape, rows, 500 * si as u64 + k as u64);
            let want = delta_only(cb, &mut sc, shape, &st);
            let got = delta_only(gb, &mut sg, shape, &st);
            let same = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / (1.0 + b.abs()))
                .fold(0f32, f32::max);
            println!(
                "shape {si} step {k}: {same} of {} outputs bit-identical, max relative error {worst:.2e}",
                want.len()
            );
            assert_close(&format!("shape {si} step {k}"), &got, &want, 1e-6);
        }
    }
}

/// A chunked span's result does not depend on the other rows of the step.
#[test]
fn chunked_rows_do_not_depend_on_the_batch() {
    let Some(gb) = gpu() else { return };
    let shape = shapes()[2];
    let alone = chunk_step(&shape, &[(0, 150, true)], 61);
    let other = chunk_step(&shape, &[(1, 40, false)], 62);
    let mut a = gb.gdn_new(1, shape, 16);
    gb.gdn_open_row(&mut a, 0);
    let out_a = delta_only(gb, &mut a, &shape, &alone);
    let mut b = gb.gdn_new(1, shape, 16);
    gb.gdn_open_row(&mut b, 0);
    gb.gdn_open_row(&mut b, 1);
    let both = Step {
        x: [other.x.clone(), alone.x.clone()].concat(),
        g: [other.g.clone(), alone.g.clone()].concat(),
        beta: [other.beta.clone(), alone.beta.clone()].concat(),
        spans: vec![
            RowSpan {
                row: 1,
                first: 0,
                count: 40,
                chunked: false,
                prompt: false,
            },
            RowSpan {
                row: 0,
                first: 40,
                count: 150,
                chunked: true,
                prompt: true,
            },
        ],
    };
    let out_b = delta_only(gb, &mut b, &shape, &both);
    assert_eq!(out_b[40 * shape.value_dim()..], out_a[..]);
}

#[test]
fn a_block_equals_its_tokens_one_at_a_time_and_any_batch() {
    let Some(gb) = gpu() else { return };
    for shape in shapes() {
        let w = random_vec(shape.conv_dim() * 4, -0.5, 0.5, 7);
        let wg = gb.upload(&w, shape.conv_dim(), 4);
        let block = step(&shape, &[(0, 6)], 11);
        let other = step(&shape, &[(1, 3)], 12);
        // (a) The block alone; (b) batched with another row; (c) one token per step.
        let mut a = gb.gdn_new(1, shape, 16);
        gb.gdn_open_row(&mut a, 0);
        let (_, out_a) = run(gb, &mut a, &shape, &wg, &block);
        let mut b = gb.gdn_new(1, shape, 16);
        gb.gdn_open_row(&mut b, 0);
        gb.gdn_open_row(&mut b, 1);
        let both = Step {
            x: [other.x.clone(), block.x.clone()].concat(),
            g: [other.g.clone(), block.g.clone()].concat(),
            beta: [other.beta.clone(), block.beta.clone()].concat(),
            spans: vec![
                RowSpan {
                    row: 1,
                    first: 0,
                    count: 3,
                    chunked: false,
                    prompt: false,
                },
                RowSpan {
                    row: 0,
                    first: 3,
                    count: 6,
                    chunked: false,
                    prompt: false,
                },
            ],
        };
        let (_, out_b) = run(gb, &mut b, &shape, &wg, &both);
        let vd = shape.value_dim();
        assert_eq!(out_b[3 * vd..], out_a[..], "batched with another row");
        let mut c = gb.gdn_new(1, shape, 16);
        gb.gdn_open_row(&mut c, 0);
        let (cd, hv) = (shape.conv_dim(), shape.v_heads);
        for t in 0..6 {
            let one = Step {
                x: block.x[t * cd..(t + 1) * cd].to_vec(),
                g: block.g[t * hv..(t + 1) * hv].to_vec(),
                beta: block.beta[t * hv..(t + 1) * hv].to_vec(),
                spans: vec![RowSpan {
                    row: 0,
                    first: 0,
                    count: 1,
                    chunked: false,
                    prompt: false,
                }],
            };
            let (_, o) = run(gb, &mut c, &shape, &wg, &one);
            assert_eq!(
                o[..],
                out_a[t * vd..(t + 1) * vd],
                "token {t} one at a time"
            );
        }
    }
}

#[test]
fn rollback_equals_a_step_of_the_kept_tokens() {
    let Some(gb) = gpu() else { return };
    let cb = cpu();
    for shape in shapes() {
        let w = random_vec(shape.conv_dim() * 4, -0.5, 0.5, 3);
        let wg = gb.upload(&w, shape.conv_dim(), 4);
        let wc = cb.upload(&w, shape.conv_dim(), 4);
        let prefix = step(&shape, &[(0, 4)], 21);
        let block = step(&shape, &[(0, 8)], 22);
        let probe = step(&shape, &[(0, 1)], 23);
        let (cd, hv) = (shape.conv_dim(), shape.v_heads);
        for keep in [0usize, 1, 5, 8] {
            let kept = Step {
                x: block.x[..keep * cd].to_vec(),
                g: block.g[..keep * hv].to_vec(),
                beta: block.beta[..keep * hv].to_vec(),
                spans: vec![RowSpan {
                    row: 0,
                    first: 0,
                    count: keep as u32,
                    chunked: false,
                    prompt: false,
                }],
            };
            // Rolled back on the GPU.
            let mut a = gb.gdn_new(1, shape, 16);
            gb.gdn_open_row(&mut a, 0);
            run(gb, &mut a, &shape, &wg, &prefix);
            run(gb, &mut a, &shape, &wg, &block);
            gb.gdn_rollback(&mut a, 0, keep).unwrap();
            let (_, got) = run(gb, &mut a, &shape, &wg, &probe);
            // Fresh on the GPU: prefix, then only the kept tokens.
            let mut f = gb.gdn_new(1, shape, 16);
            gb.gdn_open_row(&mut f, 0);
            run(gb, &mut f, &shape, &wg, &prefix);
            if keep > 0 {
                run(gb, &mut f, &shape, &wg, &kept);
            }
            let (_, want) = run(gb, &mut f, &shape, &wg, &probe);
            assert_eq!(got, want, "keep {keep}: rolled back vs fresh on the GPU");
            // And the CPU's rollback agrees.
            let mut c = cb.gdn_new(1, shape, 16);
            cb.gdn_open_row(&mut c, 0);
            run(cb, &mut c, &shape, &wc, &prefix);
            run(cb, &mut c, &shape, &wc, &block);
            cb.gdn_rollback(&mut c, 0, keep).unwrap();
            let (_, cpu_out) = run(cb, &mut c, &shape, &wc, &probe);
            assert_close(&format!("keep {keep}: gpu vs cpu"), &got, &cpu_out, 1e-4);
        }
        let mut e = gb.gdn_new(1, shape, 4);
        gb.gdn_open_row(&mut e, 0);
        run(gb, &mut e, &shape, &wg, &block);
        assert!(
            gb.gdn_rollback(&mut e, 0, 6).is_err(),
            "beyond the recorded history"
        );
        assert!(gb.gdn_rollback(&mut e, 0, 9).is_err(), "beyond the step");
    }
}

#[test]
fn forked_rows_continue_like_their_source() {
    let Some(gb) = gpu() else { return };
    let shape = shapes()[0];
    let w = random_vec(shape.conv_dim() * 4, -0.5, 0.5, 5);
    let wg = gb.upload(&w, shape.conv_dim(), 4);
    let mut st = gb.gdn_new(1, shape, 16);
    gb.gdn_open_row(&mut st, 0);
    run(gb, &mut st, &shape, &wg, &step(&shape, &[(0, 5)], 31));
    gb.gdn_copy_row(&mut st, 0, 1);
    let next = step(&shape, &[(0, 2)], 32);
    // The same inputs (same seed) for the fork.
    let next1 = step(&shape, &[(1, 2)], 32);
    let (_, a) = run(gb, &mut st, &shape, &wg, &next);
    let (_, b) = run(gb, &mut st, &shape, &wg, &next1);
    assert_eq!(a, b);
}

fn gates_on<B: Backend>(
    b: &B,
    a: &[f32],
    bb: &[f32],
    a_neg: &[f32],
    dt: &[f32],
    hv: usize,
) -> (Vec<f32>, Vec<f32>) {
    let t = a.len() / hv;
    let (mut x, mut y) = (b.upload(a, t, hv), b.upload(bb, t, hv));
    b.gdn_gates(
        &mut x,
        &mut y,
        &b.upload(a_neg, 1, hv),
        &b.upload(dt, 1, hv),
    );
    (b.to_host(&x), b.to_host(&y))
}

#[test]
fn gates_gated_norm_and_sigmoid_gate_match_the_cpu() {
    let Some(gb) = gpu() else { return };
    let cb = cpu();
    let (t, hv) = (5, 6);
    let a = random_vec(t * hv, -30.0, 30.0, 41);
    let bb = random_vec(t * hv, -8.0, 8.0, 42);
    let a_neg = random_vec(hv, -16.0, -0.01, 43);
    let dt = random_vec(hv, -1.0, 1.0, 44);
    let (gg, gbeta) = gates_on(gb, &a, &bb, &a_neg, &dt, hv);
    let (cg, cbeta) = gates_on(cb, &a, &bb, &a_neg, &dt, hv);
    assert_close("g", &gg, &cg, 1e-5);
    assert_close("beta", &gbeta, &cbeta, 1e-6);

    let (rows, cols, dim) = (3, 96, 32);
    let x = random_vec(rows * cols, -2.0, 2.0, 45);
    let z = random_vec(rows * cols, -3.0, 3.0, 46);
    let w = random_vec(dim, 0.5, 1.5, 47);
    let mut xg = gb.upload(&x, rows, cols);
    gb.rms_norm_gated(
        &mut xg,
        &gb.upload(&z, rows, cols),
        &gb.upload(&w, 1, dim),
        1e-6,
    );
    let mut xc = cb.upload(&x, rows, cols);
    cb.rms_norm_gated(
        &mut xc,
        &cb.upload(&z, rows, cols),
        &cb.upload(&w, 1, dim),
        1e-6,
    );
    assert_close("gated rms norm", &gb.to_host(&xg), &cb.to_host(&xc), 1e-5);

    let mut sg = gb.upload(&x, rows, cols);
    gb.sigmoid_mul(&mut sg, &gb.upload(&z, rows, cols));
    let mut sc = cb.upload(&x, rows, cols);
    cb.sigmoid_mul(&mut sc, &cb.upload(&z, rows, cols));
    assert_close("sigmoid gate", &gb.to_host(&sg), &cb.to_host(&sc), 1e-6);
}
