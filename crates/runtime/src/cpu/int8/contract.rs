//! The numeric contract of the int8 path against the f32 kernels: a per-output bound on how
//! far an int8-activation product may be from the f32-activation one.
//!
//! Quantizing a block with scale `dx` moves each activation by at most `dx / 2` (round to
//! nearest; `dx = amax / 127` and the reciprocal `127 / amax` are each rounded once, hence a
//! `2⁻²⁰` relative slack), so the exact products differ by at most
//! `E = Σ_g (dx_g / 2) · Σ_{k∈g} |w_k|`. Both sides also round in f32, each by at most
//! `K · 2⁻²⁴ · Σ_k |w_k| · (|x_k| + dx/2)` (recursive summation over at most K terms, the
//! standard worst case). The bound is the sum: `E · (1 + 2⁻²⁰) + 2 · K · 2⁻²⁴ · Σ|w|(|x| + dx/2)`.
//!
//! Two terms (`quantize::Terms::Two`): the kernels multiply `x̂ = q₁ dx₁ + q₂ dx₂`, where `q₂`,
//! `dx₂` quantize the residual `r = fl(x − fl(q₁ dx₁))`. Then `|x − x̂| ≤ dx₂/2 · (1 + 2⁻²⁰)`
//! (the residual's rounding) `+ 2⁻²⁴ (|x| + dx₁)` (the two roundings that made `r`), and the
//! f32 sides round over two accumulations of K terms, the f32 kernel's one and the final
//! `first + second`: at most `(2K + 1) · 2⁻²⁴ · Σ|w|(|x| + dx₁)` in all.

use super::quantize::{QuantRows, Terms};
use crate::quant::GROUP;

/// The bound for one output: `w` the dequantized weight row, `x` the f32 activation row,
/// `d` the row's activation block scales (from `QuantRows::d`).
pub fn deviation_bound(w: &[f32], x: &[f32], d: &[f32]) -> f64 {
    let k = w.len();
    assert!(x.len() == k && d.len() * GROUP == k);
    let (mut rounding, mut magnitude) = (0f64, 0f64);
    for (g, &dx) in d.iter().enumerate() {
        let dx = dx as f64;
        for kk in g * GROUP..(g + 1) * GROUP {
            let aw = (w[kk] as f64).abs();
            rounding += aw * dx / 2.0;
            magnitude += aw * ((x[kk] as f64).abs() + dx / 2.0);
        }
    }
    rounding * (1.0 + 2f64.powi(-20)) + 2.0 * k as f64 * 2f64.powi(-24) * magnitude
}

/// The bound for one output of a two-term product: `w` the dequantized weight row, `x` the
/// f32 activation row, `d1` and `d2` the block scales of its first and second int8 rows.
pub fn deviation_bound_x2(w: &[f32], x: &[f32], d1: &[f32], d2: &[f32]) -> f64 {
    let k = w.len();
    assert!(x.len() == k && d1.len() * GROUP == k && d2.len() == d1.len());
    let u = 2f64.powi(-24);
    let (mut moved, mut magnitude) = (0f64, 0f64);
    for (g, (&a, &b)) in d1.iter().zip(d2).enumerate() {
        let (a, b) = (a as f64, b as f64);
        for kk in g * GROUP..(g + 1) * GROUP {
            let (aw, ax) = ((w[kk] as f64).abs(), (x[kk] as f64).abs());
            moved += aw * (b / 2.0 * (1.0 + 2f64.powi(-20)) + u * (ax + a));
            magnitude += aw * (ax + a);
        }
    }
    moved + (2 * k + 1) as f64 * u * magnitude
}

/// The bound for an output of activation row `i` (f32 values `x`), quantized into `q` in
/// `terms`, with the dequantized weight row `w`: [`deviation_bound`] or
/// [`deviation_bound_x2`], reading the row's block scales from `q`.
pub fn row_bound(w: &[f32], x: &[f32], q: &QuantRows, terms: Terms, i: usize) -> f64 {
    let (kb, m) = (q.blocks(), q.m / terms.count());
    let d1 = &q.d[i * kb..(i + 1) * kb];
    match terms {
        Terms::One => deviation_bound(w, x, d1),
        Terms::Two => deviation_bound_x2(w, x, d1, &q.d[(m + i) * kb..(m + i + 1) * kb]),
    }
}
