//! e^x for 16 lanes at once (AVX-512) or 8 (AVX2), for the SiLU product and the softmax weights.
//!
//! `x` is clamped to [−150, 100] (NaN passes through), split as `x = n·ln 2 + r` with
//! `n = round(x · log2 e)` and `|r| ≤ ln 2 / 2` (two-part ln 2, fused multiply-adds), `e^r` is
//! the degree-7 Taylor polynomial (truncation below 5e-9 relative) and `2^n` is applied by
//! `vscalefps` (AVX-512), which overflows to +inf and underflows through subnormals to 0 like
//! `expf`. AVX2 has no `vscalefps`: it multiplies by `2^⌊n/2⌋`, which is exact (`|n| ≤ 217`, so
//! both factors are normal), then by `2^(n − ⌊n/2⌋)`, which rounds once as `vscalefps` does, so
//! the two widths give the same bits.
//! Within 2 ulp of the exact value over the normal range (tested against f64); every lane takes
//! the same operations, so a value's result never depends on its position or neighbours.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Lanes of [`exp16`].
pub const LANES: usize = 16;

/// e^x per lane.
///
/// # Safety
/// The CPU must support AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn exp16(x: __m512) -> __m512 {
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    // max/min return their second operand when one is NaN: x goes second to keep NaN.
    let x = _mm512_min_ps(
        _mm512_set1_ps(100.0),
        _mm512_max_ps(_mm512_set1_ps(-150.0), x),
    );
    let n = _mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(x, _mm512_set1_ps(LOG2_E)));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// Lanes of [`exp8`].
pub const LANES8: usize = 8;

/// e^x per lane, with the bits of [`exp16`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub unsafe fn exp8(x: __m256) -> __m256 {
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let x = _mm256_min_ps(
        _mm256_set1_ps(100.0),
        _mm256_max_ps(_mm256_set1_ps(-150.0), x),
    );
    let n = _mm256_round_ps::<NEAREST>(_mm256_mul_ps(x, _mm256_set1_ps(LOG2_E)));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // 2^a for integer lanes a in −126..=127: the biased exponent alone.
    let pow2 = |a: __m256i| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            a,
            _mm256_set1_epi32(127),
        )))
    };
    // NaN lanes convert to i32::MIN; p is NaN there already, and stays so.
    let ni = _mm256_cvtps_epi32(n);
    let lo = _mm256_srai_epi32::<1>(ni);
    let hi = _mm256_sub_epi32(ni, lo);
    _mm256_mul_ps(_mm256_mul_ps(p, pow2(lo)), pow2(hi))
}

/// The first `n ≤ 8` values at `p` in a vector, the lanes past `n` zero.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `p` holds at least `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub unsafe fn load8(p: *const f32, n: usize) -> __m256 {
    if n == LANES8 {
        return _mm256_loadu_ps(p);
    }
    let mut buf = [0f32; LANES8];
    std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n);
    _mm256_loadu_ps(buf.as_ptr())
}

/// Stores the first `n ≤ 8` lanes of `v` at `p`.
///
/// # Safety
/// The CPU must support AVX; `p` has room for `n` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
pub unsafe fn store8(p: *mut f32, v: __m256, n: usize) {
    if n == LANES8 {
        return _mm256_storeu_ps(p, v);
    }
    let mut buf = [0f32; LANES8];
    _mm256_storeu_ps(buf.as_mut_ptr(), v);
    std::ptr::copy_nonoverlapping(buf.as_ptr(), p, n);
}

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2 rounded to f32, and the rest.
const LN2_HI: f32 = std::f32::consts::LN_2;
const LN2_LO: f32 = (std::f64::consts::LN_2 - std::f32::consts::LN_2 as f64) as f32;
/// 1/7!, 1/6!, …, 1/1!, 1/0! (Horner order).
const TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `exp16` over a slice, 16 values at a time (the last group masked).
///
/// # Safety
/// The CPU must support AVX-512F; `out` is at least as long as `x`.
#[cfg(all(test, target_arch = "x86_64"))]
#[target_feature(enable = "avx512f")]
unsafe fn exp_slice(x: &[f32], out: &mut [f32]) {
    for (xs, os) in x.chunks(LANES).zip(out.chunks_mut(LANES)) {
        let m = lane_mask(xs.len());
        let v = exp16(_mm512_maskz_loadu_ps(m, xs.as_ptr()));
        _mm512_mask_storeu_ps(os.as_mut_ptr(), m, v);
    }
}

/// The mask of the first `n ≤ 16` lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub fn lane_mask(n: usize) -> __mmask16 {
    debug_assert!(n <= LANES);
    ((1u32 << n) - 1) as __mmask16
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// `exp8` over a slice, 8 values at a time.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; `out` is at least as long as `x`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8_slice(x: &[f32], out: &mut [f32]) {
        for (xs, os) in x.chunks(LANES8).zip(out.chunks_mut(LANES8)) {
            store8(
                os.as_mut_ptr(),
                exp8(load8(xs.as_ptr(), xs.len())),
                xs.len(),
            );
        }
    }

    /// e^x of a slice into another of the same length.
    type ExpSlice = fn(&[f32], &mut [f32]);

    /// The widths this CPU runs: name and slice function.
    fn widths() -> Vec<(&'static str, ExpSlice)> {
        let mut w: Vec<(&'static str, ExpSlice)> = Vec::new();
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected; the callers pass slices of one length.
            w.push(("exp16", |x, o| unsafe { exp_slice(x, o) }));
        } else {
            eprintln!("exp16 not checked: this CPU has no AVX-512F");
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: AVX2 and FMA were detected; as above.
            w.push(("exp8", |x, o| unsafe { exp8_slice(x, o) }));
        } else {
            eprintln!("exp8 not checked: this CPU has no AVX2 + FMA");
        }
        w
    }

    fn ulps(a: f32, b: f64) -> f64 {
        let b32 = b as f32;
        let ulp = (f32::from_bits(b32.abs().to_bits() + 1) - b32.abs()) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn within_two_ulp_of_exp_and_exact_at_the_edges() {
        let xs: Vec<f32> = (0..200_001)
            .map(|i| -87.0 + 175.0 * i as f32 / 200_000.0)
            .chain([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 1.0, 2.0])
            .collect();
        for (name, exp) in widths() {
            let mut out = vec![0f32; xs.len()];
            exp(&xs, &mut out);
            let worst = xs
                .iter()
                .zip(&out)
                .map(|(&x, &e)| ulps(e, (x as f64).exp()))
                .fold(0f64, f64::max);
            assert!(worst <= 2.0, "{name}: {worst} ulp");
            assert_eq!(out[xs.len() - 8], 1.0, "{name}: e^0");
            let special = [
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                89.0,
                -100.0,
                -150.0,
                1000.0,
            ];
            let mut got = [0f32; 7];
            exp(&special, &mut got);
            assert_eq!(got[0], f32::INFINITY, "{name}");
            assert_eq!(got[1], 0.0, "{name}");
            assert!(got[2].is_nan(), "{name}");
            assert_eq!(got[3], f32::INFINITY, "{name}: e^89 overflows f32");
            assert!(
                got[4] > 0.0 && got[4] < f32::MIN_POSITIVE,
                "{name}: e^-100 is subnormal"
            );
            assert_eq!(got[5], 0.0, "{name}");
            assert_eq!(got[6], f32::INFINITY, "{name}");
        }
    }

    #[test]
    fn a_value_gives_the_same_bits_in_every_lane() {
        let xs: Vec<f32> = (0..37).map(|i| i as f32 * 0.731 - 13.0).collect();
        for (name, exp) in widths() {
            let mut whole = vec![0f32; xs.len()];
            exp(&xs, &mut whole);
            for (i, &x) in xs.iter().enumerate() {
                let mut one = [0f32; 1];
                exp(&[x], &mut one);
                assert_eq!(one[0].to_bits(), whole[i].to_bits(), "{name}: x = {x}");
            }
        }
    }

    #[test]
    fn both_widths_give_the_same_bits() {
        let w = widths();
        if w.len() < 2 {
            eprintln!("skipped: this CPU runs one width only");
            return;
        }
        // Every result kind: overflow, normal, subnormal, zero.
        let xs: Vec<f32> = (0..400_001)
            .map(|i| -160.0 + 260.0 * i as f32 / 400_000.0)
            .collect();
        let (mut a, mut b) = (vec![0f32; xs.len()], vec![0f32; xs.len()]);
        (w[0].1)(&xs, &mut a);
        (w[1].1)(&xs, &mut b);
        for ((x, p), q) in xs.iter().zip(&a).zip(&b) {
            assert_eq!(p.to_bits(), q.to_bits(), "x = {x}");
        }
    }
}
