//! Element-wise ops: SiLU-gated product, residual add, argmax.

/// `gate[i] = silu(gate[i]) * up[i]`, with silu(x) = x / (1 + e^-x): e^-x from
/// [`super::vexp`] on AVX-512 and AVX2 (the same bits), from libm elsewhere (each value on its
/// own either way).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F was just detected; the slices have the same length.
        return unsafe { silu_mul_avx512(gate, up) };
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: AVX2 and FMA were just detected; the slices have the same length.
        return unsafe { silu_mul_avx2(gate, up) };
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    use super::vexp::{exp16, lane_mask, LANES};
    use std::arch::x86_64::*;
    let one = _mm512_set1_ps(1.0);
    for (gs, us) in gate.chunks_mut(LANES).zip(up.chunks(LANES)) {
        let m = lane_mask(gs.len());
        let g = _mm512_maskz_loadu_ps(m, gs.as_ptr());
        let u = _mm512_maskz_loadu_ps(m, us.as_ptr());
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        let s = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u);
        _mm512_mask_storeu_ps(gs.as_mut_ptr(), m, s);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    use super::vexp::{exp8, load8, store8, LANES8};
    use std::arch::x86_64::*;
    let one = _mm256_set1_ps(1.0);
    for (gs, us) in gate.chunks_mut(LANES8).zip(up.chunks(LANES8)) {
        let n = gs.len();
        let g = load8(gs.as_ptr(), n);
        let u = load8(us.as_ptr(), n);
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        let s = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
        store8(gs.as_mut_ptr(), s, n);
    }
}

/// `x[i] += y[i]`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Index of the largest value (the first on ties); NaNs are never chosen over numbers.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_definition() {
        let mut g = [0.0f32, 1.0, -2.0];
        silu_mul(&mut g, &[1.0, 2.0, 3.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((g[2] - 3.0 * -2.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    }

    #[test]
    fn silu_mul_is_close_to_f64_position_free_and_keeps_the_limits() {
        let n = 1000;
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 500.0) * 0.061).collect();
        let up: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut got = gate.clone();
        silu_mul(&mut got, &up);
        for i in 0..n {
            let (g, u) = (gate[i] as f64, up[i] as f64);
            let want = g / (1.0 + (-g).exp()) * u;
            assert!(
                (got[i] as f64 - want).abs() <= 5e-7 * want.abs() + 1e-30,
                "x = {g}: {} vs {want}",
                got[i]
            );
            // The same value alone (a different lane, a masked tail) gives the same bits.
            let mut one = [gate[i]];
            silu_mul(&mut one, &[up[i]]);
            assert_eq!(one[0].to_bits(), got[i].to_bits(), "x = {g}");
        }
        let mut ends = [f32::INFINITY, f32::NEG_INFINITY, -200.0, 200.0, f32::NAN];
        silu_mul(&mut ends, &[2.0; 5]);
        assert_eq!(ends[0], f32::INFINITY);
        assert!(ends[1].is_nan(), "-inf / inf, as libm gives");
        assert_eq!(ends[2], -0.0);
        assert_eq!(ends[3], 400.0);
        assert!(ends[4].is_nan());
    }

    #[test]
    fn argmax_takes_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
    }
}
