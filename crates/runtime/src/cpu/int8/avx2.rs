//! AVX2 int8 kernels, in two flavours: plain AVX2 (`vpmaddubsw` + `vpmaddwd`) and AVX-VNNI
//! (`vpdpbusd` on 256-bit registers). A 16-row panel is handled as two halves of 8 rows.
//!
//! `vpmaddubsw` adds pairs of u8·s8 products into i16 with saturation, so the operands are
//! chosen to never saturate: Q4 nibbles (≤ 15) times codes (|x| ≤ 127) give pairs ≤ 3810 and
//! eight of them still fit i16; Q8_0 weights go in as |w| ≤ 128 with the sign moved onto the
//! activation (pairs ≤ 32512), widened to i32 at once. The integer dot is exact either way,
//! so both flavours give the bits of `reference`.

use std::arch::x86_64::*;

use super::pack::{Int8Format, PANEL};
use super::quantize::QuantRows;
use super::Job;

#[inline(always)]
unsafe fn bcast(p: *const i8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn half(blk: *const u8, t: usize, h: usize) -> __m256i {
    _mm256_loadu_si256(blk.add(64 * t + 32 * h) as *const __m256i)
}

/// The exact integer dot of one block for 8 rows (before the Q4_0/Q8_0 offset correction of
/// the VNNI flavour, which `offset` reports).
#[inline(always)]
unsafe fn dot<const VNNI: bool>(format: Int8Format, w: &[__m256i; 8], xq: *const i8) -> __m256i {
    let zero = _mm256_setzero_si256();
    let ones = _mm256_set1_epi16(1);
    // Operand t pairs with activation codes 4t..4t+4 (Q4: t < 4 the low nibbles, values
    // 4t..4t+4; t >= 4 the high nibbles, values 16 + 4(t − 4)..: offset 4t as well).
    if VNNI {
        let mut s0 = zero;
        let mut s1 = zero;
        for t in 0..4 {
            s0 = _mm256_dpbusd_avx_epi32(s0, w[t], bcast(xq.add(4 * t)));
            s1 = _mm256_dpbusd_avx_epi32(s1, w[t + 4], bcast(xq.add(16 + 4 * t)));
        }
        return _mm256_add_epi32(s0, s1);
    }
    if format == Int8Format::Q8_0 {
        let mut s = zero;
        for (t, wt) in w.iter().enumerate() {
            let x = _mm256_sign_epi8(bcast(xq.add(4 * t)), *wt);
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(*wt), x);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
        }
        return s;
    }
    let mut p = _mm256_maddubs_epi16(w[0], bcast(xq));
    for (t, wt) in w.iter().enumerate().skip(1) {
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(*wt, bcast(xq.add(4 * t))));
    }
    _mm256_madd_epi16(p, ones)
}

/// The float steps of block `bi` (row-major over x's blocks) for one row and 8 outputs, from
/// their exact integer `d`: the Q4_0 (or VNNI Q8_0) offset correction, `acc = fma(dw·dx, D,
/// acc)` with the half's weight scales `dw`, and for Q4_1 `acc = fma(mw, dsx, acc)` with the
/// half's minimums (read at `blk + cb + 32 + 16 h`): `reference`'s steps, in its order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block_step<const VNNI: bool>(
    format: Int8Format,
    x: &QuantRows,
    bi: usize,
    blk: *const u8,
    h: usize,
    dw: __m256,
    mut d: __m256i,
    acc: __m256,
) -> __m256 {
    match format {
        Int8Format::Q4_0 => d = _mm256_sub_epi32(d, _mm256_set1_epi32(8 * x.sum[bi])),
        Int8Format::Q8_0 if VNNI => d = _mm256_sub_epi32(d, _mm256_set1_epi32(128 * x.sum[bi])),
        _ => {}
    }
    let s = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[bi]));
    let acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(d), acc);
    if format != Int8Format::Q4_1 {
        return acc;
    }
    let mw = blk.add(format.code_bytes() + 32 + 16 * h);
    let mw = _mm256_cvtph_ps(_mm_loadu_si128(mw as *const __m128i));
    _mm256_fmadd_ps(mw, _mm256_set1_ps(x.ds[bi]), acc)
}

#[inline(always)]
unsafe fn tile<const F: u8, const VNNI: bool, const MR: usize>(
    job: &Job,
    blk0: *const u8,
    i0: usize,
    col: usize,
) {
    let format = super::format_of(F);
    let (bb, cb) = (format.block_bytes(), format.code_bytes());
    let x = job.x;
    let kb = x.blocks();
    let mask = _mm256_set1_epi8(0x0F);
    let valid = (job.w.rows - col).min(PANEL);
    for h in 0..2 {
        if 8 * h >= valid {
            break;
        }
        let mut acc = [_mm256_setzero_ps(); MR];
        for g in 0..kb {
            let blk = blk0.add(g * bb);
            if h == 0 {
                super::prefetch_ahead(blk, bb);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 16 * h) as *const __m128i));
            let mut w = [_mm256_setzero_si256(); 8];
            if format == Int8Format::Q8_0 {
                for (t, wt) in w.iter_mut().enumerate() {
                    // Maddubs wants the signed code, VNNI the stored unsigned one.
                    *wt = if VNNI {
                        half(blk, t, h)
                    } else {
                        _mm256_xor_si256(half(blk, t, h), _mm256_set1_epi8(-128))
                    };
                }
            } else {
                for t in 0..4 {
                    let c = half(blk, t, h);
                    w[t] = _mm256_and_si256(c, mask);
                    w[t + 4] = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let i = i0 + r;
                let bi = i * kb + g;
                let d = dot::<VNNI>(format, &w, x.q.as_ptr().add(i * x.k + g * 32));
                *a = block_step::<VNNI>(format, x, bi, blk, h, dw, d, *a);
            }
        }
        let n = (valid - 8 * h).min(8);
        for (r, a) in acc.iter().enumerate() {
            let o = job.out.add((i0 + r) * job.out_stride + col + 8 * h);
            if n == 8 {
                _mm256_storeu_ps(o, *a);
            } else {
                let mut tmp = [0f32; 8];
                _mm256_storeu_ps(tmp.as_mut_ptr(), *a);
                std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, n);
            }
        }
    }
}

/// `R` activation rows (1 or 2) against a whole panel of Q4 weights, plain AVX2: a block's
/// four 64-byte code chunks are loaded and split into nibbles once for both halves of the
/// panel, with an i16 sum per row and half (`tile` walks the block once per half). These are
/// the decode step's and a short verify's shapes, where no other rows share the weights'
/// decoding; the block's exact integer and its float steps are `tile`'s, so are the bits.
#[inline(always)]
unsafe fn rows_panel<const F: u8, const R: usize>(job: &Job, panel: usize, i0: usize) {
    let (blk0, col) = (job.w.panel_ptr(panel), panel * PANEL);
    let format = super::format_of(F);
    let (bb, cb) = (format.block_bytes(), format.code_bytes());
    let x = job.x;
    let kb = x.blocks();
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for g in 0..kb {
        let blk = blk0.add(g * bb);
        super::prefetch_ahead(blk, bb);
        let xq = x.q.as_ptr().add(i0 * x.k + g * 32);
        let mut p = [[_mm256_setzero_si256(); 2]; R];
        for t in 0..4 {
            // Chunk t: values 4t.. in the low nibbles, 16 + 4t.. in the high ones.
            for h in 0..2 {
                let c = half(blk, t, h);
                let lo = _mm256_and_si256(c, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), mask);
                for (r, pr) in p.iter_mut().enumerate() {
                    let xr = xq.add(r * x.k + 4 * t);
                    let s = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, bcast(xr)),
                        _mm256_maddubs_epi16(hi, bcast(xr.add(16))),
                    );
                    pr[h] = _mm256_add_epi16(pr[h], s);
                }
            }
        }
        // The halves' weight scales, converted once for all rows.
        let dw = [
            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb) as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(cb + 16) as *const __m128i)),
        ];
        for (r, (ar, pr)) in acc.iter_mut().zip(&p).enumerate() {
            let bi = (i0 + r) * kb + g;
            for (h, a) in ar.iter_mut().enumerate() {
                let d = _mm256_madd_epi16(pr[h], ones);
                *a = block_step::<false>(format, x, bi, blk, h, dw[h], d, *a);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        let o = job.out.add((i0 + r) * job.out_stride + col);
        _mm256_storeu_ps(o, ar[0]);
        _mm256_storeu_ps(o.add(8), ar[1]);
    }
}

#[inline(always)]
unsafe fn run_format<const F: u8, const VNNI: bool>(job: &Job) {
    let m = job.x.m;
    for p in job.panels.clone() {
        let (blk0, col) = (job.w.panel_ptr(p), p * PANEL);
        let mut i = 0;
        while i < m {
            // 16 ymm registers: 8 weight operands, up to 4 accumulators and temporaries.
            let mr = (m - i).min(4);
            // One or two rows of a whole Q4 panel: `rows_panel` (Q8_0 keeps its sign trick in
            // `tile`; the VNNI flavour keeps `tile` too, unmeasured on a VNNI CPU as yet).
            let whole = job.w.rows - col >= PANEL;
            if mr <= 2 && whole && !VNNI && super::format_of(F) != Int8Format::Q8_0 {
                if mr == 1 {
                    rows_panel::<F, 1>(job, p, i);
                } else {
                    rows_panel::<F, 2>(job, p, i);
                }
                i += mr;
                continue;
            }
            match mr {
                1 => tile::<F, VNNI, 1>(job, blk0, i, col),
                2 => tile::<F, VNNI, 2>(job, blk0, i, col),
                3 => tile::<F, VNNI, 3>(job, blk0, i, col),
                _ => tile::<F, VNNI, 4>(job, blk0, i, col),
            }
            i += mr;
        }
    }
}

/// Runs `job` with AVX2 `vpmaddubsw`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C, and `job` must describe valid buffers.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn run(job: &Job) {
    match job.w.format {
        Int8Format::Q4_0 => run_format::<0, false>(job),
        Int8Format::Q4_1 => run_format::<1, false>(job),
        Int8Format::Q8_0 => run_format::<2, false>(job),
    }
}

/// Runs `job` with AVX-VNNI `vpdpbusd`.
///
/// # Safety
/// The CPU must support AVX-VNNI, AVX2, FMA and F16C, and `job` must describe valid buffers.
#[target_feature(enable = "avxvnni,avx2,fma,f16c")]
pub unsafe fn run_vnni(job: &Job) {
    match job.w.format {
        Int8Format::Q4_0 => run_format::<0, true>(job),
        Int8Format::Q4_1 => run_format::<1, true>(job),
        Int8Format::Q8_0 => run_format::<2, true>(job),
    }
}
