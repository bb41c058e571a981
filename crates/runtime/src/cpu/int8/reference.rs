//! The int8 reference: the arithmetic every tuned int8 kernel reproduces bit for bit.
//!
//! Output `(i, j)` is one f32 accumulator walking the blocks of row `j` in order. For block
//! `g`, with activation scale `dx`, code sum `sx` and `dsx = dx · sx` (see `quantize`) and the
//! weight block's scale `dw` (minimum `mw` for Q4_1), the exact integer
//!
//! - Q4_0: `D = Σ (q_j − 8) · x_j`, Q4_1: `D = Σ q_j · x_j`, Q8_0: `D = Σ w_j · x_j`
//!
//! (|D| ≤ 32 · 128 · 127 < 2²⁴, so `D as f32` is exact) enters as
//! `acc = fma(dw · dx, D, acc)`, and for Q4_1 then `acc = fma(mw, dsx, acc)`.
//! Integer sums are exact in any order, so kernels may split them across lanes freely; the
//! float steps are per output and in block order, hence the same for every M, every
//! instruction set and every tiling. This code reads the weights in their stored (GGUF)
//! layout, so it also checks the repacking the tuned kernels read.

use super::pack::Int8Format;
use super::quantize::{QuantRows, Terms};
use crate::quant::GROUP;
use crate::weight::HostWeight;

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// One stored block of a weight row read as the int8 kernels see it: the scale `dw`, the
/// minimum `mw` (Q4_1; 0 otherwise) and the 32 integer codes (Q4_0 already less 8), so that
/// value `v` of the block is `dw · code[v] + mw`.
pub fn block_parts(format: Int8Format, b: &[u8]) -> (f32, f32, [i32; GROUP]) {
    let mut code = [0i32; GROUP];
    for (v, c) in code.iter_mut().enumerate() {
        *c = match format {
            Int8Format::Q4_0 | Int8Format::Q4_1 => {
                let byte = b[if format == Int8Format::Q4_0 { 2 } else { 4 } + v % 16];
                let q = if v < 16 { byte & 0x0F } else { byte >> 4 } as i32;
                if format == Int8Format::Q4_0 {
                    q - 8
                } else {
                    q
                }
            }
            Int8Format::Q8_0 => b[2 + v] as i8 as i32,
        };
    }
    let mw = if format == Int8Format::Q4_1 {
        f16(&b[2..4])
    } else {
        0.0
    };
    (f16(&b[0..2]), mw, code)
}

/// `out[i · n + j]` for all `m` rows of `x` and `n` rows of `w` (Q4_0, Q4_1 or Q8_0).
pub fn matmul(w: &HostWeight, x: &QuantRows, out: &mut [f32]) {
    let format = Int8Format::of(w.dtype).expect("the int8 reference reads Q4_0, Q4_1 or Q8_0");
    assert_eq!(w.cols, x.k);
    let (n, kb, bb) = (w.rows, x.blocks(), w.dtype.block_bytes());
    assert!(out.len() >= x.m * n);
    for j in 0..n {
        let row = w.row(j);
        for i in 0..x.m {
            let mut acc = 0f32;
            for g in 0..kb {
                let (dw, mw, code) = block_parts(format, &row[g * bb..(g + 1) * bb]);
                let xs = &x.q[i * x.k + g * GROUP..i * x.k + (g + 1) * GROUP];
                let bi = i * kb + g;
                let dot: i32 = (0..GROUP).map(|v| code[v] * xs[v] as i32).sum();
                acc = (dw * x.d[bi]).mul_add(dot as f32, acc);
                if format == Int8Format::Q4_1 {
                    acc = mw.mul_add(x.ds[bi], acc);
                }
            }
            out[i * n + j] = acc;
        }
    }
}

/// The product of the activation rows `x` carries in `terms` int8 rows each
/// (`QuantRows::quantize_terms`): each int8 row as [`matmul`], and for [`Terms::Two`] row i's
/// output is `first + second` (rows `i` and `m + i`).
pub fn matmul_terms(w: &HostWeight, x: &QuantRows, terms: Terms, out: &mut [f32]) {
    let (m, n) = (x.m / terms.count(), w.rows);
    match terms {
        Terms::One => matmul(w, x, out),
        Terms::Two => {
            let mut both = vec![0f32; x.m * n];
            matmul(w, x, &mut both);
            for (i, o) in out[..m * n].iter_mut().enumerate() {
                *o = both[i] + both[m * n + i];
            }
        }
    }
}
