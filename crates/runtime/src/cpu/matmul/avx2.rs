//! AVX2 + FMA + F16C matmul kernels (8 lanes), bit-identical to `portable::matmul::<8>`.
//!
//! Each format decodes a 32-value group into four 8-lane vectors; the tile kernel keeps one
//! accumulator per (x row, weight row) and walks groups in order, so the per-output
//! summation order is the portable one whatever the tile shape.

#![allow(clippy::missing_safety_doc)]

#[cfg(target_arch = "x86")]
use std::arch::x86::*;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use crate::dtype::DType;
use crate::quant::{q4k_group_scale_min, q6k_group_scale};

/// Decodes group `g` of a row into four vectors holding values 0..8, 8..16, 16..24, 24..32.
trait Decode {
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4];
}

#[inline(always)]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline(always)]
unsafe fn bytes_to_f32(q: __m128i) -> (__m256, __m256) {
    // Low 8 bytes and high 8 bytes, zero-extended to i32 then converted.
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
    (lo, hi)
}

#[inline(always)]
unsafe fn nibbles(q: __m128i) -> (__m128i, __m128i) {
    let mask = _mm_set1_epi8(0x0F);
    (
        _mm_and_si128(q, mask),
        _mm_and_si128(_mm_srli_epi16(q, 4), mask),
    )
}

struct Q4_0;
impl Decode for Q4_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let b = row.add(g * 18);
        let d = _mm256_set1_ps(f16_scalar(b));
        let (lo, hi) = nibbles(_mm_loadu_si128(b.add(2) as *const __m128i));
        let eight = _mm_set1_epi8(8);
        let lo = _mm_sub_epi8(lo, eight);
        let hi = _mm_sub_epi8(hi, eight);
        let cvt = |q: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        [
            _mm256_mul_ps(cvt(lo), d),
            _mm256_mul_ps(cvt(_mm_srli_si128(lo, 8)), d),
            _mm256_mul_ps(cvt(hi), d),
            _mm256_mul_ps(cvt(_mm_srli_si128(hi, 8)), d),
        ]
    }
}

struct Q4_1;
impl Decode for Q4_1 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let b = row.add(g * 20);
        let d = _mm256_set1_ps(f16_scalar(b));
        let m = _mm256_set1_ps(f16_scalar(b.add(2)));
        let (lo, hi) = nibbles(_mm_loadu_si128(b.add(4) as *const __m128i));
        let (l0, l1) = bytes_to_f32(lo);
        let (h0, h1) = bytes_to_f32(hi);
        [
            _mm256_fmadd_ps(l0, d, m),
            _mm256_fmadd_ps(l1, d, m),
            _mm256_fmadd_ps(h0, d, m),
            _mm256_fmadd_ps(h1, d, m),
        ]
    }
}

struct Q8_0;
impl Decode for Q8_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let b = row.add(g * 34);
        let d = _mm256_set1_ps(f16_scalar(b));
        let q = b.add(2);
        let cvt = |p: *const u8| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
        };
        [
            _mm256_mul_ps(cvt(q), d),
            _mm256_mul_ps(cvt(q.add(8)), d),
            _mm256_mul_ps(cvt(q.add(16)), d),
            _mm256_mul_ps(cvt(q.add(24)), d),
        ]
    }
}

struct F32;
impl Decode for F32 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let p = row.add(g * 128) as *const f32;
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    }
}

struct F16;
impl Decode for F16 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let p = row.add(g * 64);
        let cvt = |o: usize| _mm256_cvtph_ps(_mm_loadu_si128(p.add(o) as *const __m128i));
        [cvt(0), cvt(16), cvt(32), cvt(48)]
    }
}

struct BF16;
impl Decode for BF16 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let p = row.add(g * 64);
        let cvt = |o: usize| {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(o) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
        };
        [cvt(0), cvt(16), cvt(32), cvt(48)]
    }
}

struct Q4K;
impl Decode for Q4K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        // Group scale/min from the portable helper (scalar bit fiddling, once per group).
        let blk = std::slice::from_raw_parts(row.add((g / 8) * 144), 144);
        let (scale, neg_min) = q4k_group_scale_min(blk, g % 8);
        let sub = g % 8;
        let qs = row.add((g / 8) * 144 + 16 + (sub / 2) * 32);
        let d = _mm256_set1_ps(scale);
        let mn = _mm256_set1_ps(neg_min);
        let mask = _mm_set1_epi8(0x0F);
        let load = |o: usize| {
            let q = _mm_loadu_si128(qs.add(o) as *const __m128i);
            if sub.is_multiple_of(2) {
                _mm_and_si128(q, mask)
            } else {
                _mm_and_si128(_mm_srli_epi16(q, 4), mask)
            }
        };
        let (a0, a1) = bytes_to_f32(load(0));
        let (b0, b1) = bytes_to_f32(load(16));
        [
            _mm256_fmadd_ps(a0, d, mn),
            _mm256_fmadd_ps(a1, d, mn),
            _mm256_fmadd_ps(b0, d, mn),
            _mm256_fmadd_ps(b1, d, mn),
        ]
    }
}

struct Q6K;
impl Decode for Q6K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m256; 4] {
        let blk = std::slice::from_raw_parts(row.add((g / 8) * 210), 210);
        let (s0, s1) = q6k_group_scale(blk, g % 8);
        let sub = g % 8;
        let half = sub / 4;
        let quarter = sub % 4;
        let ql = row.add((g / 8) * 210 + 64 * half + if quarter % 2 == 1 { 32 } else { 0 });
        let qh = row.add((g / 8) * 210 + 128 + 32 * half);
        let mask = _mm_set1_epi8(0x0F);
        let three = _mm_set1_epi8(3);
        let thirty_two = _mm_set1_epi8(32);
        let codes = |o: usize| {
            let l = _mm_loadu_si128(ql.add(o) as *const __m128i);
            let l = if quarter >= 2 {
                _mm_and_si128(_mm_srli_epi16(l, 4), mask)
            } else {
                _mm_and_si128(l, mask)
            };
            let h = _mm_loadu_si128(qh.add(o) as *const __m128i);
            let h = _mm_and_si128(
                _mm_srl_epi16(h, _mm_cvtsi32_si128(2 * quarter as i32)),
                three,
            );
            _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(h, 4)), thirty_two)
        };
        let cvt = |q: __m128i| {
            (
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))),
            )
        };
        let (a0, a1) = cvt(codes(0));
        let (b0, b1) = cvt(codes(16));
        let s0 = _mm256_set1_ps(s0);
        let s1 = _mm256_set1_ps(s1);
        [
            _mm256_mul_ps(a0, s0),
            _mm256_mul_ps(a1, s0),
            _mm256_mul_ps(b0, s1),
            _mm256_mul_ps(b1, s1),
        ]
    }
}

/// Pairwise lane reduction matching `portable::reduce_lanes::<8>`.
#[inline(always)]
unsafe fn reduce(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<D: Decode, const MR: usize, const NR: usize>(
    x: *const f32,
    x_stride: usize,
    w: *const u8,
    row_bytes: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NR]; MR];
    for g in 0..k_groups {
        for n in 0..NR {
            let wv = D::decode(w.add(n * row_bytes), g);
            for (c, wc) in wv.iter().enumerate() {
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(i * x_stride + g * 32 + c * 8));
                    acc_i[n] = _mm256_fmadd_ps(*wc, xv, acc_i[n]);
                }
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (n, a) in acc_i.iter().enumerate() {
            *out.add(i * out_stride + n) = reduce(*a);
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn run<D: Decode>(
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
    const NR: usize = 4;
    const PREFETCH_TILES: usize = 1;
    let mut j = 0;
    while j < n {
        super::prefetch_rows(w, row_bytes, j + PREFETCH_TILES * NR, NR, n);
        let nr = (n - j).min(NR);
        let wj = w.add(j * row_bytes);
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(2);
            let xi = x.add(i * x_stride);
            let oi = out.add(i * out_stride + j);
            macro_rules! go {
                ($mr:literal, $nr:literal) => {
                    tile::<D, $mr, $nr>(xi, x_stride, wj, row_bytes, k_groups, oi, out_stride)
                };
            }
            match (mr, nr) {
                (2, 4) => go!(2, 4),
                (1, 4) => go!(1, 4),
                (2, _) => go!(2, 1),
                _ => go!(1, 1),
            }
            // Partial weight tiles run one weight row at a time.
            i += mr;
        }
        j += if nr == NR { NR } else { 1 };
    }
}

/// See `portable::matmul`; same contract, AVX2 instructions.
///
/// # Safety
/// As `portable::matmul`, and the CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
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
    let a = (x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride);
    match dtype {
        DType::F32 => run::<F32>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::F16 => run::<F16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::BF16 => run::<BF16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_0 => run::<Q4_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_1 => run::<Q4_1>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q8_0 => run::<Q8_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4K => run::<Q4K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q6K => run::<Q6K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
    }
}
