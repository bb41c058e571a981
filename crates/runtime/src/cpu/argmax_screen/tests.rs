//! The screened product against the f32 kernels: the same first largest value at the same
//! position on every row (random weights, near-ties that int8 activations cannot see,
//! extreme activations, non-finite rows), and the bound it rests on, output by output.

use super::*;
use crate::cpu::int8::synthetic;
use crate::cpu::matmul;
use crate::dtype::DType;
use crate::weight::WeightBytes;

const FORMATS: [DType; 3] = [DType::Q4_0, DType::Q4_1, DType::Q8_0];

/// The usable int8 families (each test says so loudly when there are none).
fn kernels() -> Vec<Int8Kernel> {
    let k = Int8Kernel::usable().to_vec();
    if k.is_empty() {
        println!("SKIPPED: this CPU has no usable int8 kernel family, so nothing is screened");
    }
    k
}

fn f32_product(pool: &CpuPool, w: &HostWeight, x: &[f32], m: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    matmul::matmul(pool, Isa::detect(), x, m, w, &mut out);
    out
}

/// The first largest value of a row and its position (the engine's greedy rule).
fn first_max(row: &[f32]) -> (usize, u32) {
    let mut best = 0;
    for (j, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = j;
        }
    }
    (best, row[best].to_bits())
}

/// Screens `x` through `w` in `format` with every kernel and checks each row against the
/// f32 product: the same first maximum, every other output either the f32 bits or below
/// that maximum. Returns the outputs recomputed per row, for the last kernel.
fn check_against_f32(w: &HostWeight, format: DType, x: &[f32], m: usize) -> Rescored {
    let pool = CpuPool::new(2);
    let full = f32_product(&pool, w, x, m);
    let n = w.rows;
    let mut last = vec![None; m];
    for kernel in kernels() {
        let screen = ArgmaxScreen::new(&pool, w, format, kernel).unwrap();
        let mut out = vec![f32::NAN; m * n];
        last = screen.matmul(&pool, Isa::detect(), w, x, m, &mut out);
        for i in 0..m {
            let (got, want) = (&out[i * n..(i + 1) * n], &full[i * n..(i + 1) * n]);
            let top = first_max(want);
            assert_eq!(first_max(got), top, "{} {format} {kernel} row {i}", w.dtype);
            for j in 0..n {
                assert!(
                    got[j].to_bits() == want[j].to_bits() || got[j] < want[top.0],
                    "{} {format} {kernel} row {i} output {j}: {} (f32 {}, max {})",
                    w.dtype,
                    got[j],
                    want[j],
                    want[top.0]
                );
            }
        }
    }
    last
}

#[test]
fn screened_rows_choose_as_the_f32_product_bit_for_bit() {
    for dtype in FORMATS {
        for (n, k, m) in [(2000, 576, 5), (37, 96, 3)] {
            let w = synthetic::weight(dtype, n, k, 0.02, 7 + n as u64);
            let x = synthetic::activations(m, k, k as u64);
            for format in FORMATS {
                for r in check_against_f32(&w, format, &x, m) {
                    let r = r.expect("finite rows are screened");
                    assert!(
                        r >= 1,
                        "{dtype} by {format}: the maximum is always recomputed"
                    );
                    if n == 2000 && format == dtype {
                        // Random rows are far apart: the screen recomputes few of them.
                        assert!(r < n / 4, "{dtype}: {r} of {n} outputs recomputed");
                    }
                }
            }
        }
    }
}

/// Heads stored in formats the int8 kernels do not read get a screen in one they do.
#[test]
fn float_and_k_quant_heads_are_screened_in_an_int8_format() {
    let (n, k, m) = (500, 256, 3);
    let x = synthetic::activations(m, k, 41);
    for dtype in [DType::BF16, DType::F16, DType::F32, DType::Q4K, DType::Q6K] {
        let w = synthetic::weight(dtype, n, k, 0.05, 43);
        for format in FORMATS {
            check_against_f32(&w, format, &x, m);
        }
    }
}

/// A row of `k` values in `dtype` whose every block has scale 0.01 (Q4_1 minimum −0.08) and
/// mid codes (value 0), but for one code step up at each value of `bumps`.
fn bumped_row(dtype: DType, k: usize, bumps: &[usize]) -> Vec<u8> {
    let bb = dtype.block_bytes();
    let mut row = vec![0u8; k / GROUP * bb];
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    for blk in row.chunks_exact_mut(bb) {
        blk[0..2].copy_from_slice(&f16(0.01));
        match dtype {
            DType::Q4_0 => blk[2..].fill(0x88),
            DType::Q4_1 => {
                blk[2..4].copy_from_slice(&f16(-0.08));
                blk[4..].fill(0x88);
            }
            _ => blk[2..].fill(0),
        }
    }
    for &v in bumps {
        let (g, v) = (v / GROUP, v % GROUP);
        let codes = g * bb + if dtype == DType::Q4_1 { 4 } else { 2 };
        match dtype {
            DType::Q8_0 => row[codes + v] += 1,
            _ => row[codes + v % 16] += if v < 16 { 0x01 } else { 0x10 },
        }
    }
    row
}

/// Rows the int8 product ranks one way and the f32 product the other: row 1 gains where x is
/// below its block's int8 step (read as 0), row 2 gains less where x is read almost exactly.
#[test]
fn outputs_that_int8_rounding_reorders_keep_the_f32_choice() {
    let k = 64;
    let mut x = vec![0f32; k];
    (x[0], x[1]) = (100.0, 0.39); // block 0: step 100/127, so 0.39 reads as 0
    (x[32], x[33]) = (1.0, 0.3); // block 1: step 1/127, so 0.3 reads as about 0.3
    let pool = CpuPool::new(2);
    for dtype in FORMATS {
        let rows: [&[usize]; 4] = [&[], &[1], &[33], &[]];
        let bytes: Vec<u8> = rows.iter().flat_map(|b| bumped_row(dtype, k, b)).collect();
        let w = HostWeight::new("reordered", dtype, 4, k, WeightBytes::from_vec(bytes)).unwrap();
        assert_eq!(first_max(&f32_product(&pool, &w, &x, 1)).0, 1, "{dtype}");
        for kernel in kernels() {
            let packed = PackedWeight::pack(&w).unwrap();
            let mut approx = vec![0f32; 4];
            int8::matmul_many(
                &pool,
                kernel,
                Terms::One,
                &x,
                1,
                &mut [(&packed, &mut approx[..])],
            );
            assert_eq!(
                first_max(&approx).0,
                2,
                "{dtype} {kernel}: int8 alone picks row 2"
            );
        }
        for format in FORMATS {
            check_against_f32(&w, format, &x, 1);
        }
    }
}

#[test]
fn extreme_activations_and_scales_keep_the_f32_choice() {
    for dtype in FORMATS {
        let (n, k, m) = (300, 256, 4);
        let w = synthetic::weight(dtype, n, k, 0.5, 11);
        let mut x = synthetic::activations(m, k, 5);
        // Row 1: a huge outlier per block; row 2: tiny values; row 3: zeros with one spike.
        for v in 0..k {
            if v % 32 == 5 {
                x[k + v] *= 1e4;
            }
            x[2 * k + v] *= 1e-20;
            x[3 * k + v] = if v == 77 { 3.0 } else { 0.0 };
        }
        for format in FORMATS {
            check_against_f32(&w, format, &x, m);
        }
    }
}

#[test]
fn rows_that_are_not_finite_are_computed_whole() {
    let pool = CpuPool::new(2);
    let (n, k, m) = (100, 64, 3);
    let w = synthetic::weight(DType::Q8_0, n, k, 0.02, 1);
    let mut x = synthetic::activations(m, k, 2);
    x[k + 3] = f32::INFINITY;
    let full = f32_product(&pool, &w, &x, m);
    for kernel in kernels() {
        let screen = ArgmaxScreen::new(&pool, &w, DType::Q4_0, kernel).unwrap();
        let mut out = vec![0f32; m * n];
        let r = screen.matmul(&pool, Isa::detect(), &w, &x, m, &mut out);
        assert!(r[0].is_some() && r[1].is_none() && r[2].is_some(), "{r:?}");
        for j in 0..n {
            assert_eq!(out[n + j].to_bits(), full[n + j].to_bits(), "output {j}");
        }
    }
}

/// The bound itself: `|F_j − I_j| ≤ B_j` for every output, on rows made to stress it.
#[test]
fn the_bound_covers_every_output() {
    let pool = CpuPool::new(2);
    for dtype in [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::BF16,
        DType::Q6K,
    ] {
        // 768: whole K-quant super-blocks.
        let (n, k, m) = (500, 768, 3);
        let w = synthetic::weight(dtype, n, k, 0.05, 23);
        let mut x = synthetic::activations(m, k, 29);
        for v in 0..k {
            x[k + v] *= if v % 32 == 0 { 300.0 } else { 1.0 };
            x[2 * k + v] = 1e3 * (v as f32 * 0.37).sin();
        }
        let full = f32_product(&pool, &w, &x, m);
        let mut xq = QuantRows::default();
        xq.quantize(&x, m, k);
        for format in FORMATS {
            for kernel in kernels() {
                let screen = ArgmaxScreen::new(&pool, &w, format, kernel).unwrap();
                let mut approx = vec![0f32; m * n];
                int8::matmul_many(
                    &pool,
                    kernel,
                    Terms::One,
                    &x,
                    m,
                    &mut [(&screen.packed, &mut approx[..])],
                );
                for i in 0..m {
                    let scale = Scale::of(&x[i * k..(i + 1) * k], &xq, i);
                    for j in 0..n {
                        let gap = (full[i * n + j] as f64 - approx[i * n + j] as f64).abs();
                        let bound = screen.abs_norms[j] as f64 * scale.abs
                            + screen.offsets[j] as f64 * scale.offset;
                        assert!(
                            gap <= bound,
                            "{dtype} by {format} {kernel} row {i} output {j}: \
                             |F − I| = {gap} > B = {bound}"
                        );
                    }
                }
            }
        }
    }
}
