//! The portable matmul kernel: plain Rust emulating `L` SIMD lanes.
//!
//! It defines the summation order every SIMD kernel reproduces: for output (m, n) one
//! accumulator of `L` lanes walks the row group by group, `L` values at a time, with fused
//! multiply-adds; the lanes are then added pairwise, halving the width each step
//! (lane i + lane i+L/2, ...). Because that order does not depend on how many rows of `x`
//! are processed together, a row's result is the same at M = 1 and at any larger M.

use crate::dtype::DType;
use crate::quant::{decode_group, GROUP};

/// Sums `L` lanes by repeated halving: the reduction tree the SIMD kernels use.
#[inline(always)]
pub fn reduce_lanes<const L: usize>(mut lanes: [f32; L]) -> f32 {
    let mut width = L;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

/// `out[i * out_stride + j] = x[i] · W[row j]` for `i < m`, `j < n`, over `k_groups` groups.
///
/// # Safety
/// `x` holds `m` rows of at least `k_groups * 32` values at stride `x_stride`; `w` holds `n`
/// rows of `row_bytes` bytes; `out` has room for `m` rows at `out_stride`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul<const L: usize>(
    dtype: DType,
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut wbuf = [0f32; GROUP];
    for j in 0..n {
        let row = std::slice::from_raw_parts(w.add(j * row_bytes), row_bytes);
        for i in 0..m {
            let xr = std::slice::from_raw_parts(x.add(i * x_stride), k_groups * GROUP);
            let mut acc = [0f32; L];
            for g in 0..k_groups {
                decode_group(dtype, row, g, &mut wbuf);
                for c in 0..GROUP / L {
                    for (l, a) in acc.iter_mut().enumerate() {
                        let kk = c * L + l;
                        *a = wbuf[kk].mul_add(xr[g * GROUP + kk], *a);
                    }
                }
            }
            *out.add(i * out_stride + j) = reduce_lanes(acc);
        }
    }
}
