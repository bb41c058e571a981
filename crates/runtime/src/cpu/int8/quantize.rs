//! Activations to int8: every row is cut into 32-value blocks, each with its own scale.
//!
//! Block `x[0..32]` becomes `q[j] = clamp(round_ties_even(x[j] · 127 / amax), −127, 127)` with
//! `d = amax / 127` (`amax` the largest |x[j]|; an all-zero block has `d = 0` and `q = 0`), plus
//! the exact integer `sum = Σ q[j]` and `ds = d · sum` (rounded once, in f32), which the
//! kernels need for Q4_0/Q8_0 offsets and the Q4_1 minimum. Each row is quantized on its own,
//! so a row gets the same codes alone or in any batch. The code is one scalar definition; the
//! AVX2 entry point only compiles it with wider instructions, and the AVX-512 one writes the
//! same arithmetic in intrinsics (a block whose largest |x| or its inverse scale is not finite
//! takes the scalar definition): every operation is IEEE-exact or an exact integer step, so every build yields
//! the same bits (tested).
//!
//! With [`Terms::Two`] a row is carried by two int8 rows: the codes of `x` as above, then the
//! codes of its residual `r[j] = x[j] − q[j] · d` (each operation rounded once in f32), which
//! leaves at most half of the residual's step, `amax / (2 · 127 · 254)` or less, instead of
//! `amax / 254`. Products multiply both rows with the same weights and add the two results.

use crate::quant::GROUP;

/// How many int8 rows carry one activation row.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Terms {
    /// The codes of `x`.
    #[default]
    One,
    /// The codes of `x`, then the codes of its residual.
    Two,
}

impl Terms {
    /// Int8 rows per activation row.
    pub fn count(self) -> usize {
        match self {
            Terms::One => 1,
            Terms::Two => 2,
        }
    }
}

/// `m` rows of `k` activations, quantized per 32-value block.
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    /// Rows quantized.
    pub m: usize,
    /// Values per row (a multiple of 32).
    pub k: usize,
    /// Codes, row-major `m x k`.
    pub q: Vec<i8>,
    /// Per block (`m x k/32`): the scale `d`.
    pub d: Vec<f32>,
    /// Per block: the exact sum of the block's codes.
    pub sum: Vec<i32>,
    /// Per block: `d · sum`.
    pub ds: Vec<f32>,
}

impl QuantRows {
    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.k / GROUP
    }

    /// Quantizes `m` rows of `x` (row stride `k`), reusing this value's buffers.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        self.quantize_terms(x, m, k, Terms::One, &mut Vec::new());
    }

    /// Quantizes `m` rows of `x` (row stride `k`) into `terms.count() · m` int8 rows: for
    /// [`Terms::Two`], rows `0..m` carry `x` and rows `m..2m` its residuals (`scratch` holds
    /// the residuals in between).
    pub fn quantize_terms(
        &mut self,
        x: &[f32],
        m: usize,
        k: usize,
        terms: Terms,
        scratch: &mut Vec<f32>,
    ) {
        assert!(
            k.is_multiple_of(GROUP),
            "int8 activations need whole 32-value blocks"
        );
        assert!(x.len() >= m * k);
        let rows = terms.count() * m;
        let nb = rows * k / GROUP;
        self.m = rows;
        self.k = k;
        self.q.resize(rows * k, 0);
        self.d.resize(nb, 0.0);
        self.sum.resize(nb, 0);
        self.ds.resize(nb, 0.0);
        let x = &x[..m * k];
        self.blocks_from(x, 0);
        if terms == Terms::Two {
            scratch.clear();
            scratch.extend(x.iter().enumerate().map(|(i, &v)| {
                let code = self.q[i] as f32;
                v - code * self.d[i / GROUP]
            }));
            self.blocks_from(scratch, m * k / GROUP);
        }
    }

    /// Quantizes the blocks of `x` into blocks `first..` of this value.
    fn blocks_from(&mut self, x: &[f32], first: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                // SAFETY: the features were just detected.
                return unsafe { self.blocks_avx512(x, first) };
            }
            if is_x86_feature_detected!("avx2") {
                // SAFETY: as above.
                return unsafe { self.blocks_avx2(x, first) };
            }
        }
        self.all_blocks(x, first)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    unsafe fn blocks_avx512(&mut self, x: &[f32], first: usize) {
        use std::arch::x86_64::*;
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let abs = _mm512_set1_epi32(0x7FFF_FFFF);
        let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
        let q = &mut self.q[first * GROUP..];
        let blocks = x.chunks_exact(GROUP).zip(q.chunks_exact_mut(GROUP));
        for (b, (xs, qs)) in blocks.enumerate() {
            let b = first + b;
            let v0 = _mm512_loadu_ps(xs.as_ptr());
            let v1 = _mm512_loadu_ps(xs.as_ptr().add(16));
            // |x| as bits, as in `quantize_block`.
            let a0 = _mm512_and_si512(_mm512_castps_si512(v0), abs);
            let a1 = _mm512_and_si512(_mm512_castps_si512(v1), abs);
            let amax_bits = _mm512_reduce_max_epu32(_mm512_max_epu32(a0, a1));
            let amax = f32::from_bits(amax_bits);
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            if !amax.is_finite() || !inv.is_finite() {
                let xs: &[f32; GROUP] = xs.try_into().expect("whole block");
                let qs: &mut [i8; GROUP] = qs.try_into().expect("whole block");
                let (d, sum) = quantize_block(xs, qs);
                (self.d[b], self.sum[b], self.ds[b]) = (d, sum, d * sum as f32);
                continue;
            }
            // Finite scales: every |x · inv| is at most about 127, so no code is NaN.
            let d = amax / 127.0;
            let inv = _mm512_set1_ps(inv);
            let c0 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v0, inv));
            let c1 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v1, inv));
            let c0 = _mm512_min_epi32(_mm512_max_epi32(c0, lo), hi);
            let c1 = _mm512_min_epi32(_mm512_max_epi32(c1, lo), hi);
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
            _mm_storeu_si128(qs.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(c0));
            _mm_storeu_si128(qs.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(c1));
            (self.d[b], self.sum[b], self.ds[b]) = (d, sum, d * sum as f32);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn blocks_avx2(&mut self, x: &[f32], first: usize) {
        self.all_blocks(x, first)
    }

    #[inline(always)]
    fn all_blocks(&mut self, x: &[f32], first: usize) {
        let q = &mut self.q[first * GROUP..];
        let blocks = x.chunks_exact(GROUP).zip(q.chunks_exact_mut(GROUP));
        for (b, (xs, qs)) in blocks.enumerate() {
            let b = first + b;
            let xs: &[f32; GROUP] = xs.try_into().expect("whole block");
            let qs: &mut [i8; GROUP] = qs.try_into().expect("whole block");
            let (d, sum) = quantize_block(xs, qs);
            self.d[b] = d;
            self.sum[b] = sum;
            self.ds[b] = d * sum as f32;
        }
    }
}

/// Quantizes one block; returns its scale and the sum of its codes.
#[inline(always)]
pub fn quantize_block(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> (f32, i32) {
    // |x| as bits: for non-negative floats the integer order is the float order, and an
    // integer max reduces in any order to the same value.
    let amax_bits = x.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7FFF_FFFF));
    let amax = f32::from_bits(amax_bits);
    let d = amax / 127.0;
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (qi, &v) in q.iter_mut().zip(x) {
        let c = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
        *qi = c;
        sum += c as i32;
    }
    (d, sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_scale_and_sums_follow_the_definition() {
        let mut x = [0f32; 64];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i as f32 - 20.0) * 0.37;
        }
        x[40..].fill(0.0);
        let mut r = QuantRows::default();
        r.quantize(&x, 2, 32);
        let amax = ((0.0f32 - 20.0) * 0.37).abs();
        assert_eq!(r.d[0], amax / 127.0);
        assert_eq!(r.q[0], -127);
        assert_eq!(r.q[20], 0);
        assert_eq!(r.sum[0], r.q[..32].iter().map(|&c| c as i32).sum::<i32>());
        assert_eq!(r.ds[0], r.d[0] * r.sum[0] as f32);
        // The second row's block: 8 non-zero values then zeros; an all-zero block is exact.
        assert!(r.q[32..].iter().all(|&c| c != i8::MIN));
        let mut z = QuantRows::default();
        z.quantize(&[0.0; 32], 1, 32);
        assert_eq!((z.d[0], z.sum[0], z.q[5]), (0.0, 0, 0));
        // Each code is within half a step of the value.
        for (j, &c) in r.q[..32].iter().enumerate() {
            assert!((c as f32 * r.d[0] - x[j]).abs() <= 0.5 * r.d[0] * 1.0001);
        }
    }

    #[test]
    fn the_wide_builds_give_the_scalar_bits() {
        let mut x: Vec<f32> = (0..16 * 96)
            .map(|i| ((i * 7919) % 1013) as f32 * 0.013 - 6.5)
            .collect();
        // Blocks with ties (amax 127: codes are the values, halves round to even), signed
        // zeros, subnormals, huge values, infinities and NaN.
        let ties: Vec<f32> = (0..32).map(|j| j as f32 - 15.5).collect();
        x[..32].copy_from_slice(&ties);
        x[31] = 127.0;
        x[32..64].fill(-0.0);
        x[33] = f32::from_bits(1);
        x[64..96].fill(f32::MIN_POSITIVE / 3.0);
        x[70] = -f32::MIN_POSITIVE / 7.0;
        x[96] = f32::MAX;
        x[97] = -f32::MAX / 3.0;
        x[128] = f32::INFINITY;
        x[160] = f32::NEG_INFINITY;
        x[192] = f32::NAN;
        x[230] = -f32::NAN;
        let mut wide = QuantRows::default();
        wide.quantize(&x, 16, 96);
        let mut plain = QuantRows {
            m: 16,
            k: 96,
            q: vec![0; 16 * 96],
            d: vec![0.0; 48],
            sum: vec![0; 48],
            ds: vec![0.0; 48],
        };
        plain.all_blocks(&x, 0);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(wide.q, plain.q);
        assert_eq!(bits(&wide.d), bits(&plain.d));
        assert_eq!(wide.sum, plain.sum);
        assert_eq!(bits(&wide.ds), bits(&plain.ds));
        assert!(
            plain.d[6].is_nan() && plain.d[4] == f32::INFINITY,
            "special blocks"
        );
    }
}
