//! The int8 kernels: bit equality with the reference for every family this CPU has (and so
//! verify rows equal decode rows), the numeric contract against the f32 kernels with a bound
//! derived from int8 rounding, pinned output fingerprints, and the self-check.

use super::*;
use crate::cpu::matmul::{self as f32mm, Isa};
use crate::cpu::pool::CpuPool;
use crate::weight::HostWeight;

const FORMATS: [DType; 3] = [DType::Q4_0, DType::Q4_1, DType::Q8_0];

const TERMS: [Terms; 2] = [Terms::One, Terms::Two];

fn quant(x: &[f32], m: usize, k: usize, terms: Terms) -> QuantRows {
    let mut q = QuantRows::default();
    q.quantize_terms(x, m, k, terms, &mut Vec::new());
    q
}

fn with_kernel(kernel: Int8Kernel, terms: Terms, w: &HostWeight, x: &[f32], m: usize) -> Vec<f32> {
    let packed = PackedWeight::pack(w).unwrap();
    let mut out = vec![f32::NAN; m * w.rows];
    matmul_many(
        &CpuPool::new(2),
        kernel,
        terms,
        x,
        m,
        &mut [(&packed, &mut out[..])],
    );
    out
}

fn with_reference(w: &HostWeight, x: &[f32], m: usize, terms: Terms) -> Vec<f32> {
    let mut out = vec![f32::NAN; m * w.rows];
    reference::matmul_terms(w, &quant(x, m, w.cols, terms), terms, &mut out);
    out
}

fn families() -> Vec<Int8Kernel> {
    Int8Kernel::ALL
        .into_iter()
        .filter(|k| {
            let has = k.cpu_has();
            if !has {
                println!("skipped {k}: this CPU lacks its instructions");
            }
            has
        })
        .collect()
}

#[test]
fn every_family_equals_the_reference_bit_for_bit_at_every_m() {
    // A partial panel, and the default model's k/v and down shapes (576 and 1536 inner).
    for (n, k) in [(37, 96), (192, 576), (48, 1536)] {
        for dtype in FORMATS {
            let w = synthetic::weight(dtype, n, k, 0.02, n as u64);
            let x = synthetic::activations(16, k, k as u64);
            for kernel in families() {
                for (terms, m) in TERMS
                    .into_iter()
                    .flat_map(|t| (1..=16).map(move |m| (t, m)))
                {
                    let got = with_kernel(kernel, terms, &w, &x[..m * k], m);
                    let want = with_reference(&w, &x[..m * k], m, terms);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{kernel} {terms:?} {dtype} {n}x{k} m={m}");
                }
            }
        }
    }
}

#[test]
fn a_row_gets_the_same_bits_alone_or_in_a_verify_block() {
    let Some(kernel) = Int8Kernel::best() else {
        println!("skipped: no tuned int8 kernel on this CPU");
        return;
    };
    let (n, k) = (96, 576);
    for dtype in FORMATS {
        let w = synthetic::weight(dtype, n, k, 0.02, 5);
        let x = synthetic::activations(16, k, 6);
        for (terms, m) in TERMS
            .into_iter()
            .flat_map(|t| [4usize, 8, 16].map(|m| (t, m)))
        {
            let block = with_kernel(kernel, terms, &w, &x[..m * k], m);
            for i in 0..m {
                let alone = with_kernel(kernel, terms, &w, &x[i * k..(i + 1) * k], 1);
                assert_eq!(
                    &block[i * n..(i + 1) * n],
                    &alone[..],
                    "{terms:?} {dtype} m={m} row {i}"
                );
            }
        }
    }
}

/// The AMX tile products, forced at every row count (the family itself hands one row to
/// the VNNI kernel): every row equals the reference and that row computed alone, bit for
/// bit, in one tile (M <= 16) and across several (M > 16).
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_tiles_equal_the_reference_and_the_row_alone_at_every_m() {
    if !Int8Kernel::Amx.cpu_has() {
        println!("skipped: this CPU or OS offers no AMX int8 tiles");
        return;
    }
    let tiles = |packed: &PackedWeight, x: &[f32], m: usize| {
        let q = quant(x, m, packed.cols, Terms::One);
        let mut out = vec![f32::NAN; m * packed.rows];
        let job = Job {
            w: packed,
            panels: 0..packed.panels(),
            x: &q,
            out: out.as_mut_ptr(),
            out_stride: packed.rows,
        };
        // SAFETY: the CPU offers the tiles (checked above); the buffers match the job.
        unsafe { amx::run_tiles(&job) };
        out
    };
    for (n, k) in [(37, 96), (192, 576), (48, 1536)] {
        for dtype in FORMATS {
            let w = synthetic::weight(dtype, n, k, 0.02, 3 + n as u64);
            let packed = PackedWeight::pack(&w).unwrap();
            let x = synthetic::activations(40, k, 9 + k as u64);
            let alone: Vec<Vec<f32>> = (0..40)
                .map(|i| tiles(&packed, &x[i * k..(i + 1) * k], 1))
                .collect();
            for m in (1..=18).chain([31, 32, 33, 40]) {
                let got = tiles(&packed, &x[..m * k], m);
                let want = with_reference(&w, &x[..m * k], m, Terms::One);
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same(&got, &want),
                    "{dtype} {n}x{k} m={m}: tiles vs reference"
                );
                for (i, row) in alone.iter().enumerate().take(m) {
                    assert!(
                        same(&got[i * n..(i + 1) * n], row),
                        "{dtype} {n}x{k} m={m}: row {i} differs from the row alone"
                    );
                }
            }
        }
    }
}

/// Both codes against the f32 kernels, each within its bound (`contract`); the second term
/// takes the product most of the way to the f32 one.
#[test]
fn int8_products_stay_within_their_rounding_bounds_of_the_f32_kernels() {
    let pool = CpuPool::new(2);
    for (n, k) in [(64, 576), (32, 1536)] {
        for dtype in FORMATS {
            let w = synthetic::weight(dtype, n, k, 0.02, 40 + n as u64);
            let dense = w.to_f32();
            for m in [1usize, 4, 8, 16] {
                let x = synthetic::activations(m, k, 50 + m as u64);
                let mut f32_out = vec![0f32; m * n];
                f32mm::matmul(&pool, Isa::detect(), &x, m, &w, &mut f32_out);
                let mut largest = [0f64; 2];
                for (t, terms) in TERMS.into_iter().enumerate() {
                    let q = quant(&x, m, k, terms);
                    let got = with_reference(&w, &x, m, terms);
                    let mut worst = 0f64;
                    for i in 0..m {
                        for j in 0..n {
                            let dev = (got[i * n + j] as f64 - f32_out[i * n + j] as f64).abs();
                            let bound = contract::row_bound(
                                &dense[j * k..(j + 1) * k],
                                &x[i * k..(i + 1) * k],
                                &q,
                                terms,
                                i,
                            );
                            assert!(
                                dev <= bound,
                                "{terms:?} {dtype} m={m} ({i},{j}): {dev} > {bound}"
                            );
                            worst = worst.max(dev / bound);
                            largest[t] = largest[t].max(dev);
                        }
                    }
                    println!(
                        "{terms:?} {dtype} {n}x{k} m={m}: largest deviation {worst:.3} of the \
                         bound, {:.2e}",
                        largest[t]
                    );
                }
                assert!(
                    largest[1] * 20.0 < largest[0],
                    "{dtype} m={m}: two terms {} vs one {}",
                    largest[1],
                    largest[0]
                );
            }
        }
    }
}

fn fnv1a(values: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for b in v.to_bits().to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// Output hashes for fixed inputs (64 x 256 weights, 8 rows). The int8 arithmetic does not
/// depend on the instruction set, so one hash per format covers every family.
const INT8_FINGERPRINTS: [(DType, u64); 3] = [
    (DType::Q4_0, 0x8cc5_1a56_6a0d_0f40),
    (DType::Q4_1, 0xa194_2fa8_b905_e5f9),
    (DType::Q8_0, 0xf610_9d13_10ae_74f3),
];

/// The same with two-term activations.
const INT8X2_FINGERPRINTS: [(DType, u64); 3] = [
    (DType::Q4_0, 0x67a1_0277_a8ab_0334),
    (DType::Q4_1, 0x152b_3e33_30ac_3fcb),
    (DType::Q8_0, 0x8d57_1453_2de5_cd41),
];

/// The f32 kernels' hashes for the same inputs, per lane count (their summation order).
const F32_FINGERPRINTS: [(DType, [u64; 3]); 3] = [
    (
        DType::Q4_0,
        [
            0x3627_3d97_a3b5_4d06,
            0x06f7_6844_1439_e2ee,
            0x1d4f_8d92_1ce7_5153,
        ],
    ),
    (
        DType::Q4_1,
        [
            0x1632_a09e_e83e_4452,
            0x2ad4_cff0_e92e_4319,
            0xc112_0c52_dfa7_f592,
        ],
    ),
    (
        DType::Q8_0,
        [
            0x3e03_b344_2039_c0bd,
            0xc569_5411_2e18_c501,
            0x76de_a3f3_ddc8_49d1,
        ],
    ),
];

fn fingerprint_inputs(dtype: DType) -> (HostWeight, Vec<f32>) {
    (
        synthetic::weight(dtype, 64, 256, 0.02, 2024),
        synthetic::activations(8, 256, 7),
    )
}

#[test]
fn int8_fingerprints_are_pinned_for_every_family() {
    let mut got = Vec::new();
    for (terms, pinned) in [
        (Terms::One, INT8_FINGERPRINTS),
        (Terms::Two, INT8X2_FINGERPRINTS),
    ] {
        for (dtype, want) in pinned {
            let (w, x) = fingerprint_inputs(dtype);
            let reference = fnv1a(&with_reference(&w, &x, 8, terms));
            println!("{terms:?} {dtype}: reference {reference:#018x}");
            got.push((terms, dtype, "reference".to_string(), reference, want));
            for kernel in families() {
                let hash = fnv1a(&with_kernel(kernel, terms, &w, &x, 8));
                got.push((terms, dtype, kernel.to_string(), hash, want));
            }
        }
    }
    for (terms, dtype, name, hash, want) in got {
        assert_eq!(hash, want, "{terms:?} {name} {dtype}: {hash:#018x}");
    }
}

#[test]
fn f32_fingerprints_are_pinned_for_every_instruction_set() {
    let pool = CpuPool::new(2);
    let simd = [Isa::Neon, Isa::Avx2, Isa::Avx512];
    let mut seen = Vec::new();
    for (dtype, want) in F32_FINGERPRINTS {
        let (w, x) = fingerprint_inputs(dtype);
        for (slot, lanes) in [4usize, 8, 16].into_iter().enumerate() {
            let mut isas = vec![Isa::Portable(lanes)];
            match simd.into_iter().find(|i| i.lanes() == lanes) {
                Some(isa) if isa.is_supported() => isas.push(isa),
                Some(isa) => println!("skipped f32 {isa}: this CPU lacks it"),
                None => {}
            }
            for isa in isas {
                let mut out = vec![0f32; 8 * 64];
                f32mm::matmul(&pool, isa, &x, 8, &w, &mut out);
                let got = fnv1a(&out);
                println!("f32 {isa} {dtype}: {got:#018x}");
                seen.push((isa, dtype, got, want[slot]));
            }
        }
    }
    for (isa, dtype, got, want) in seen {
        assert_eq!(got, want, "f32 {isa} {dtype}: {got:#018x}");
    }
}

#[test]
fn a_kernel_that_fails_its_self_check_is_disabled() {
    // A kernel that writes zeros: the check must catch it.
    let zeros = |job: &Job| {
        for i in 0..job.x.m {
            for p in job.panels.clone() {
                for j in p * pack::PANEL..((p + 1) * pack::PANEL).min(job.w.rows) {
                    // SAFETY: the job names these outputs.
                    unsafe { *job.out.add(i * job.out_stride + j) = 0.0 };
                }
            }
        }
    };
    let err = self_check(zeros).unwrap_err();
    assert!(err.contains("reference"), "{err}");
    let kept = passing(&[Int8Kernel::Avx2, Int8Kernel::NeonDot], |k| {
        if k == Int8Kernel::Avx2 {
            Err("injected".into())
        } else {
            Ok(())
        }
    });
    assert_eq!(kept, vec![Int8Kernel::NeonDot]);
    // Every family this CPU has passes the real check.
    for kernel in families() {
        // SAFETY: the CPU has the family.
        self_check(|job| unsafe { kernel.run(job) }).unwrap();
        assert!(Int8Kernel::usable().contains(&kernel));
    }
}
