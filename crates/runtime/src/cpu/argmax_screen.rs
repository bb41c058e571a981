//! The greedy choice through an f32-activation product at about the cost of an int8 one.
//!
//! The vocabulary projection keeps f32 activations (issue 14's W4A32 rule: the target's
//! logits stay close to the model's), and with them its products are compute-bound on a few
//! CPU cores as soon as a verify block brings several rows (and at one row on CPUs with slow
//! f32 decoding). A greedy row reads only the position of its largest logit, and that
//! position can be found exactly without computing every logit in f32:
//!
//! 1. a *screen* — the stored weight where the int8 kernels read its format, else its
//!    encoding in one they do (`policy::screen_for`) — gives `I_j` for every output `j`
//!    through the int8 kernels;
//! 2. a bound `B_j ≥ |F_j − I_j|` on the distance to the f32 kernel's `F_j` comes from
//!    quantities known without `F` (below);
//! 3. with `L = max_j (I_j − B_j)`, every `j` whose `I_j + B_j ≥ L` is a *candidate*: the f32
//!    kernel recomputes `F_j` for it from the stored weight, written in place of `I_j`.
//!
//! The first largest `F` is a candidate (its `F ≥ L`), and every other output keeps an
//! `I_j < L − B_j ≤ L`, below it: the row's first largest value and its position are those
//! of the plain f32 product, bit for bit (the f32 kernels give an output the same bits
//! whatever else they compute, `matmul`). A row whose input or screen outputs are not finite
//! is computed in f32 whole.
//!
//! The bound. Let `w` be row `j` as the f32 kernels decode it, `w'` the screen's row
//! (exactly `dw·c_v + mw` per block), `x` the activations, `x̂` their int8 reading (`dx·q_v`
//! per block) and `e = x − x̂`; `u = 2⁻²⁴`, `γ(n) = n·u / (1 − n·u)`, `K` the inner dimension
//! and `kb` its blocks. The f32 kernel sums with fused multiply-adds in lanes then a pairwise
//! tree, so `|F − w·x| ≤ γ(K)·Σ|w_v||x_v|`. The int8 kernel's exact integer block dots enter
//! through at most `2·kb + 2` roundings, so `|I − w'·x̂| ≤ γ(2·kb + 2)·Σ a_v|x̂_v|` with
//! `a_v = |dw·c_v| + |mw| ≥ |w'_v|`. And `w'·x̂ − w·x = w'·(−e) + (w' − w)·x`. With Cauchy–
//! Schwarz for every sum and, per row, `W ≥ ‖w‖`, `A ≥ ‖a‖` and `E ≥ ‖w − w'‖` (computed
//! once in f64, rounded up):
//!
//! `B_j = A_j · (‖e‖·(1 + γ₂) + ‖x‖·γ₂) + ‖x‖ · (W_j·γ₁ + E_j)`, `γ₁ = γ(K + 8)`,
//! `γ₂ = γ(2·kb + 2)`,
//!
//! taken 2⁻¹⁶ larger for the rounding of the f64 arithmetic that evaluates it and the
//! comparisons. When the screen is the stored weight itself `E` is at most a rounding and
//! the candidates are the outputs within about `2·A·‖e‖` of the top (1.6 a row on average
//! on the default model); a coarser screen would read fewer bytes, but `E·‖x‖` then spans
//! almost every output.

use super::int8::pack::{Int8Format, PackedWeight};
use super::int8::quantize::{QuantRows, Terms};
use super::int8::reference::block_parts;
use super::int8::{self, Int8Kernel};
use super::matmul::Isa;
use super::pool::{CpuPool, SyncPtr};
use crate::dtype::DType;
use crate::quant::{decode_group, GROUP};
use crate::weight::HostWeight;

/// Relative slack for the f64 evaluation of the bound and of the comparisons.
const SLACK: f64 = 1.0 + 1.0 / 65536.0;

/// A weight's int8 screen and the per-row norms of its bound.
#[derive(Debug)]
pub struct ArgmaxScreen {
    packed: PackedWeight,
    kernel: Int8Kernel,
    /// `A_j` of the module docs, per output row.
    abs_norms: Vec<f32>,
    /// `W_j · γ₁ + E_j` of the module docs, per output row.
    offsets: Vec<f32>,
}

/// What one screened product did, per row of `x`: how many outputs the f32 kernel
/// recomputed (`None`: the whole row, its input or screen outputs not being finite).
pub type Rescored = Vec<Option<usize>>;

impl ArgmaxScreen {
    /// The screen of `w` in `format` for `kernel` (the stored weight itself when `w` is in
    /// `format`), or `None` when `format` has no int8 kernel or `w` cannot be re-encoded.
    pub fn new(
        pool: &CpuPool,
        w: &HostWeight,
        format: DType,
        kernel: Int8Kernel,
    ) -> Option<ArgmaxScreen> {
        let sformat = Int8Format::of(format)?;
        let screen = if w.dtype == format {
            w.clone()
        } else {
            w.requantized(format)?
        };
        let packed = PackedWeight::pack(&screen)?;
        let (mut abs_norms, mut offsets) = (vec![0f32; w.rows], vec![0f32; w.rows]);
        let (kb, bb) = (w.cols / GROUP, format.block_bytes());
        let g1 = gamma(w.cols + 8);
        let at = (
            SyncPtr(abs_norms.as_mut_ptr()),
            SyncPtr(offsets.as_mut_ptr()),
        );
        let tasks = w.rows.min(pool.threads() * 8).max(1);
        pool.for_each(tasks, |t| {
            let mut dec = [0f32; GROUP];
            for j in w.rows * t / tasks..w.rows * (t + 1) / tasks {
                let (row, srow) = (w.row(j), screen.row(j));
                let (mut ww, mut aa, mut ee) = (0f64, 0f64, 0f64);
                for g in 0..kb {
                    decode_group(w.dtype, row, g, &mut dec);
                    let (dw, mw, code) = block_parts(sformat, &srow[g * bb..(g + 1) * bb]);
                    let (dw, mw) = (dw as f64, mw as f64);
                    for (&c, &v) in code.iter().zip(&dec) {
                        let (v, c) = (v as f64, c as f64);
                        let a = (dw * c).abs() + mw.abs();
                        let e = v - (dw * c + mw);
                        (ww, aa, ee) = (ww + v * v, aa + a * a, ee + e * e);
                    }
                }
                let offset = ww.sqrt() * SLACK * g1 + ee.sqrt() * SLACK;
                // SAFETY: tasks write disjoint rows of both vectors.
                unsafe {
                    *at.0.get().add(j) = round_up(aa.sqrt() * SLACK);
                    *at.1.get().add(j) = round_up(offset * SLACK);
                }
            }
        });
        Some(ArgmaxScreen {
            packed,
            kernel,
            abs_norms,
            offsets,
        })
    }

    /// The screen's format.
    pub fn format(&self) -> DType {
        self.packed.format.dtype()
    }

    /// Bytes a screened product streams (the screen; the recomputed rows are few).
    pub fn bytes_len(&self) -> usize {
        self.packed.bytes_len()
    }

    pub fn kernel(&self) -> Int8Kernel {
        self.kernel
    }

    /// `out` (`m x w.rows`) for the `m` rows of `x`: every row's first largest value and its
    /// position as [`super::matmul::matmul`] of `w` would give them; other outputs may hold
    /// int8 values below them. `w` must be the weight this screen was made from.
    pub fn matmul(
        &self,
        pool: &CpuPool,
        isa: Isa,
        w: &HostWeight,
        x: &[f32],
        m: usize,
        out: &mut [f32],
    ) -> Rescored {
        let (n, k) = (w.rows, w.cols);
        assert!(self.packed.rows == n && self.packed.cols == k);
        assert!(x.len() >= m * k && out.len() >= m * n);
        int8::matmul_many(
            pool,
            self.kernel,
            Terms::One,
            x,
            m,
            &mut [(&self.packed, &mut out[..m * n])],
        );
        let mut xq = QuantRows::default();
        xq.quantize(x, m, k);
        let mut rescored: Rescored = vec![None; m];
        let (outp, done) = (SyncPtr(out.as_mut_ptr()), SyncPtr(rescored.as_mut_ptr()));
        pool.for_each(m, |i| {
            let xi = &x[i * k..(i + 1) * k];
            // SAFETY: task i owns row i of `out` and entry i of `rescored`.
            let (row, slot) = unsafe {
                (
                    std::slice::from_raw_parts_mut(outp.get().add(i * n), n),
                    &mut *done.get().add(i),
                )
            };
            let scale = Scale::of(xi, &xq, i);
            if !(scale.abs.is_finite() && scale.offset.is_finite()) {
                return;
            }
            let Some(candidates) = self.candidates(row, scale) else {
                return;
            };
            for &j in &candidates {
                // SAFETY: `isa` is supported (the backend checked it), row j of `w` and
                // output j of this row exist.
                unsafe { f32_outputs(isa, w, xi, j..j + 1, row.as_mut_ptr().add(j)) };
            }
            *slot = Some(candidates.len());
        });
        for (i, r) in rescored.iter().enumerate() {
            if r.is_none() {
                let row = &mut out[i * n..(i + 1) * n];
                super::matmul::matmul(pool, isa, &x[i * k..(i + 1) * k], 1, w, row);
            }
        }
        rescored
    }

    /// The outputs of `row` whose `[I − B, I + B]` reaches the largest lower end, in order
    /// (a superset of them); `None` when an output is not finite.
    ///
    /// In f32, 16 lanes at a time: the scales are rounded up by 2⁻²⁰ (far more than the few
    /// roundings of `b = A·abs + O·offset`, so every computed `b ≥ B`), and an output is kept
    /// when `fl(I + b) + μ ≥ max fl(I − b)` with `μ = 2⁻²⁰ · max (|I| + b)`, more than the
    /// rounding of the sums on both sides (`2⁻²³` of that): every output the exact
    /// comparison keeps is kept.
    fn candidates(&self, row: &[f32], scale: Scale) -> Option<Vec<usize>> {
        const L: usize = 16;
        let up = 1.0 + f32::powi(2.0, -20);
        let (sa, so) = ((scale.abs as f32) * up, (scale.offset as f32) * up);
        let b = |j: usize| self.abs_norms[j] * sa + self.offsets[j] * so;
        let n = row.len();
        let (mut floor, mut reach, mut nan) = ([f32::NEG_INFINITY; L], [0f32; L], [0f32; L]);
        for c in 0..n / L {
            for l in 0..L {
                let (j, v) = (c * L + l, row[c * L + l]);
                let (lo, r) = (v - b(j), v.abs() + b(j));
                floor[l] = if lo > floor[l] { lo } else { floor[l] };
                reach[l] = if r > reach[l] { r } else { reach[l] };
                nan[l] += v * 0.0;
            }
        }
        let (mut floor, mut reach) = (
            floor.into_iter().fold(f32::NEG_INFINITY, f32::max),
            reach.into_iter().fold(0f32, f32::max),
        );
        let mut finite = nan.iter().all(|v| *v == 0.0);
        for (j, &v) in row.iter().enumerate().skip(n / L * L) {
            floor = floor.max(v - b(j));
            reach = reach.max(v.abs() + b(j));
            finite &= v.is_finite();
        }
        if !(finite && reach.is_finite()) {
            return None;
        }
        let floor = floor - reach * f32::powi(2.0, -20);
        Some((0..n).filter(|&j| row[j] + b(j) >= floor).collect())
    }
}

/// What multiplies a row's norms into its bound: `B_j = A_j · abs + (W_j·γ₁ + E_j) · offset`.
#[derive(Clone, Copy)]
struct Scale {
    abs: f64,
    offset: f64,
}

impl Scale {
    /// The scale of row `i` of `x` (`xq` its int8 reading).
    fn of(x: &[f32], xq: &QuantRows, i: usize) -> Scale {
        let g2 = gamma(2 * (x.len() / GROUP) + 2);
        let (x_norm, e_norm) = norms(x, xq, i);
        Scale {
            abs: (e_norm * (1.0 + g2) + x_norm * g2) * SLACK,
            offset: x_norm * SLACK,
        }
    }
}

/// `‖x‖` and `‖x − x̂‖` of row `i` (`x̂` its int8 reading in `xq`), in f64.
fn norms(x: &[f32], xq: &QuantRows, i: usize) -> (f64, f64) {
    let k = x.len();
    let (mut xs, mut es) = (0f64, 0f64);
    for (v, &xv) in x.iter().enumerate() {
        let d = xq.d[(i * k + v) / GROUP] as f64;
        let e = xv as f64 - d * xq.q[i * k + v] as f64;
        xs += xv as f64 * xv as f64;
        es += e * e;
    }
    (xs.sqrt(), es.sqrt())
}

/// Outputs `cols` of one row `x` through the f32 kernels, written from `out` on.
///
/// # Safety
/// `isa` must be supported here; `cols` must lie inside `w`'s rows and `out` have room for
/// `cols.len()` values.
unsafe fn f32_outputs(
    isa: Isa,
    w: &HostWeight,
    x: &[f32],
    cols: std::ops::Range<usize>,
    out: *mut f32,
) {
    let rb = w.row_bytes();
    isa.kernel(
        w.dtype,
        x.as_ptr(),
        w.cols,
        1,
        w.bytes.as_slice().as_ptr().add(cols.start * rb),
        rb,
        cols.len(),
        w.cols / GROUP,
        out,
        cols.len(),
    );
}

/// `γ(n) = n·u / (1 − n·u)`, `u = 2⁻²⁴`.
fn gamma(n: usize) -> f64 {
    let nu = n as f64 * f64::powi(2.0, -24);
    nu / (1.0 - nu)
}

/// The smallest f32 at or above `v`.
fn round_up(v: f64) -> f32 {
    let f = v as f32;
    if (f as f64) < v {
        f.next_up()
    } else {
        f
    }
}

#[cfg(test)]
mod tests;
