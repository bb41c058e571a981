//! CPU ops other than matmul: normalisation, RoPE, attention and element-wise work.
//!
//! Each op treats tokens independently and with a fixed summation order, so results for a
//! token never depend on the batch around it.

pub mod attention;
pub mod elementwise;
pub mod norm;
pub mod rope;

/// Sum of `a[i] * b[i]` with eight running partial sums combined pairwise (fixed order).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] = a[c * 8 + l].mul_add(b[c * 8 + l], acc[l]);
        }
    }
    for i in chunks * 8..a.len() {
        acc[i % 8] = a[i].mul_add(b[i], acc[i % 8]);
    }
    crate::cpu::matmul::portable::reduce_lanes(acc)
}

/// Sum of squares with the same fixed order as [`dot`].
#[inline]
pub fn sum_squares(a: &[f32]) -> f32 {
    dot(a, a)
}
