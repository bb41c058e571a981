//! Every SIMD kernel against the portable kernel of the same lane count (bit for bit), every
//! kernel against dequantize + f64 products (within rounding), and row-batch invariance.

use rand::{Rng, SeedableRng};

use super::*;
use crate::cpu::pool::CpuPool;
use crate::weight::{HostWeight, WeightBytes};

/// Random weights of `dtype`: random codes with finite, moderate scales.
pub(crate) fn random_weight(dtype: DType, rows: usize, cols: usize, seed: u64) -> HostWeight {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let row_bytes = dtype.row_bytes(cols).unwrap();
    let mut bytes = vec![0u8; rows * row_bytes];
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match dtype {
        DType::F32 => {
            for c in bytes.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        DType::F16 => {
            for c in bytes.chunks_exact_mut(2) {
                c.copy_from_slice(&f16(rng.random_range(-1.0f32..1.0)));
            }
        }
        DType::BF16 => {
            for c in bytes.chunks_exact_mut(2) {
                let b = half::bf16::from_f32(rng.random_range(-1.0f32..1.0));
                c.copy_from_slice(&b.to_bits().to_le_bytes());
            }
        }
        _ => {
            rng.fill(&mut bytes[..]);
            let (size, scale_offs): (usize, &[usize]) = match dtype {
                DType::Q4_0 | DType::Q8_0 => (dtype.block_bytes(), &[0]),
                DType::Q4_1 | DType::Q4K => (dtype.block_bytes(), &[0, 2]),
                DType::Q6K => (210, &[208]),
                _ => unreachable!(),
            };
            for blk in bytes.chunks_exact_mut(size) {
                for &o in scale_offs {
                    blk[o..o + 2].copy_from_slice(&f16(rng.random_range(-0.05f32..0.05)));
                }
            }
        }
    }
    HostWeight::new("w", dtype, rows, cols, WeightBytes::from_vec(bytes)).unwrap()
}

fn random_x(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

fn run(isa: Isa, x: &[f32], m: usize, w: &HostWeight) -> Vec<f32> {
    let pool = CpuPool::new(2);
    let mut out = vec![f32::NAN; m * w.rows];
    matmul(&pool, isa, x, m, w, &mut out);
    out
}

fn shapes() -> Vec<(DType, usize, usize)> {
    let mut v = Vec::new();
    for d in DType::ALL {
        let k = if d.block_len() == 256 { 512 } else { 96 };
        v.push((d, 37, k));
    }
    v
}

#[test]
fn simd_kernels_equal_portable_bit_for_bit() {
    let native = Isa::detect();
    let mut isas = vec![native];
    if native == Isa::Avx512 {
        isas.push(Isa::Avx2);
    }
    for isa in isas {
        for (dtype, n, k) in shapes() {
            let w = random_weight(dtype, n, k, 7);
            // Every streamed row count (each has its own tiles), then the panel path.
            for m in (1usize..=9).chain([16]) {
                let x = random_x(m, k, m as u64);
                let got = run(isa, &x, m, &w);
                let want = run(Isa::Portable(isa.lanes()), &x, m, &w);
                assert_eq!(got, want, "{isa} {dtype} m={m}");
            }
        }
    }
}

#[test]
fn kernels_match_dequantized_f64_products() {
    for (dtype, n, k) in shapes() {
        let w = random_weight(dtype, n, k, 11);
        let dense = w.to_f32();
        let m = 3;
        let x = random_x(m, k, 5);
        for isa in [Isa::detect(), Isa::Portable(8)] {
            let got = run(isa, &x, m, &w);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|kk| x[i * k + kk] as f64 * dense[j * k + kk] as f64)
                        .sum();
                    let mag: f64 = (0..k)
                        .map(|kk| (x[i * k + kk] as f64 * dense[j * k + kk] as f64).abs())
                        .sum();
                    let err = (got[i * n + j] as f64 - want).abs();
                    assert!(
                        err <= 1e-5 * mag + 1e-6,
                        "{isa} {dtype} ({i},{j}): err {err}"
                    );
                }
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_alone_or_in_a_batch() {
    for (dtype, n, k) in shapes() {
        let w = random_weight(dtype, n, k, 3);
        let m = 16;
        let x = random_x(m, k, 9);
        let batched = run(Isa::detect(), &x, m, &w);
        for i in 0..m {
            let alone = run(Isa::detect(), &x[i * k..(i + 1) * k], 1, &w);
            assert_eq!(&batched[i * n..(i + 1) * n], &alone[..], "{dtype} row {i}");
        }
    }
}

#[test]
fn matmul_many_equals_separate_products() {
    let pool = CpuPool::new(2);
    let k = 96;
    let ws: Vec<HostWeight> = [(DType::Q4_1, 37), (DType::Q8_0, 16), (DType::BF16, 5)]
        .iter()
        .enumerate()
        .map(|(i, &(d, n))| random_weight(d, n, k, 20 + i as u64))
        .collect();
    for m in [1usize, 3, 16] {
        let x = random_x(m, k, 4);
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; m * w.rows]).collect();
        {
            let mut jobs: Vec<(&HostWeight, &mut [f32])> = ws
                .iter()
                .zip(outs.iter_mut())
                .map(|(w, o)| (w, o.as_mut_slice()))
                .collect();
            matmul_many(&pool, Isa::detect(), &x, m, &mut jobs);
        }
        for (w, got) in ws.iter().zip(&outs) {
            assert_eq!(got, &run(Isa::detect(), &x, m, w), "{} m={m}", w.dtype);
        }
    }
}
