//! CPU ops other than matmul: normalisation, RoPE, attention, the DFlash2 convolution and
//! element-wise work.
//!
//! Each op treats tokens independently and with a fixed summation order, so results for a
//! token never depend on the batch around it.

pub mod attention;
pub mod conv;
pub mod elementwise;
pub mod gdn;
pub mod norm;
pub mod rope;
pub mod vexp;

/// Sum of `a[i] * b[i]` with sixteen running partial sums combined pairwise (fixed order;
/// plain multiply and add, which the compiler vectorises on any x86-64 or aarch64).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = a.len() / 16;
    for c in 0..chunks {
        for l in 0..16 {
            acc[l] += a[c * 16 + l] * b[c * 16 + l];
        }
    }
    for i in chunks * 16..a.len() {
        acc[i % 16] += a[i] * b[i];
    }
    crate::cpu::matmul::portable::reduce_lanes(acc)
}

/// Sum of squares with the same fixed order as [`dot`].
#[inline]
pub fn sum_squares(a: &[f32]) -> f32 {
    dot(a, a)
}
