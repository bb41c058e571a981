//! AVX-512-VNNI int8 kernels: one `vpdpbusd` multiplies 4 codes of 16 weight rows (one
//! 64-byte chunk of a packed block) with 4 broadcast activation codes.
//!
//! Weight codes are the unsigned operand (Q4 nibbles 0..15; Q8_0 stored as `code + 128`, the
//! offset removed with the block's exact code sum), activation codes the signed one. A tile
//! is `MR` activation rows against one 16-row panel: each block is loaded and split into
//! nibbles once and used by all `MR` rows, whose integer dots are independent dependency
//! chains kept in registers. Float steps follow `reference` exactly.

use std::arch::x86_64::*;

use super::pack::{Int8Format, PANEL};
use super::quantize::QuantRows;
use super::Job;

#[inline(always)]
unsafe fn bcast(p: *const i8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn chunk(blk: *const u8, t: usize) -> __m512i {
    _mm512_loadu_si512(blk.add(64 * t) as *const __m512i)
}

/// The exact integer dot of one block for the panel's 16 rows: chunk `t` pairs with
/// activation codes `4t..4t+4` (for Q4, chunks 4..8 are the high nibbles, values
/// `16 + 4(t − 4)..`, which is offset `4t` as well). One dependency chain; integer sums are
/// exact in any order.
#[inline(always)]
unsafe fn block_dot(w: &[__m512i; 8], xq: *const i8) -> __m512i {
    let mut s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast(xq));
    s = _mm512_dpbusd_epi32(s, w[1], bcast(xq.add(4)));
    s = _mm512_dpbusd_epi32(s, w[2], bcast(xq.add(8)));
    s = _mm512_dpbusd_epi32(s, w[3], bcast(xq.add(12)));
    s = _mm512_dpbusd_epi32(s, w[4], bcast(xq.add(16)));
    s = _mm512_dpbusd_epi32(s, w[5], bcast(xq.add(20)));
    s = _mm512_dpbusd_epi32(s, w[6], bcast(xq.add(24)));
    _mm512_dpbusd_epi32(s, w[7], bcast(xq.add(28)))
}

/// The 16 rows' weight scales `dw` of a packed block.
#[inline(always)]
pub(super) unsafe fn scales<const F: u8>(blk: *const u8) -> __m512 {
    let cb = super::format_of(F).code_bytes();
    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb) as *const __m256i))
}

/// The 16 rows' Q4_1 minimums `mw` of a packed block (zero for the other formats).
#[inline(always)]
pub(super) unsafe fn q4_1_mins<const F: u8>(blk: *const u8) -> __m512 {
    let format = super::format_of(F);
    if format == Int8Format::Q4_1 {
        _mm512_cvtph_ps(_mm256_loadu_si256(
            blk.add(format.code_bytes() + 32) as *const __m256i
        ))
    } else {
        _mm512_setzero_ps()
    }
}

/// Where x row `i0`'s codes and its blocks' scales `d`, code sums and `d · sum` start; row
/// `i0 + r` of a tile adds `r · k` to the first, `r · k / 32` to the others.
#[inline(always)]
pub(super) unsafe fn x_rows_at(
    x: &QuantRows,
    i0: usize,
) -> (*const i8, *const f32, *const i32, *const f32) {
    let kb = x.blocks();
    (
        x.q.as_ptr().add(i0 * x.k),
        x.d.as_ptr().add(i0 * kb),
        x.sum.as_ptr().add(i0 * kb),
        x.ds.as_ptr().add(i0 * kb),
    )
}

/// The float step of one block for one activation row (see `reference`): the exact integer
/// dots `dot` of the panel's 16 weight rows with the row's codes, the block's weight scales
/// `dw` (minimums `mw`) and the row's block scale `d`, code sum `sum` and `ds` enter `acc`.
/// Every AVX-512 int8 kernel (VNNI and AMX) goes through this one function.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate<const F: u8>(
    acc: __m512,
    dot: __m512i,
    dw: __m512,
    mw: __m512,
    d: f32,
    sum: i32,
    ds: f32,
) -> __m512 {
    let format = super::format_of(F);
    let dot = match format {
        Int8Format::Q4_0 => _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * sum)),
        Int8Format::Q8_0 => _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * sum)),
        Int8Format::Q4_1 => dot,
    };
    let s = _mm512_mul_ps(dw, _mm512_set1_ps(d));
    let acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot), acc);
    if format == Int8Format::Q4_1 {
        _mm512_fmadd_ps(mw, _mm512_set1_ps(ds), acc)
    } else {
        acc
    }
}

/// The 16 weight rows' codes of block `blk` as 8 operands: operand `t` pairs with activation
/// codes `4t..4t+4` (Q4: the low nibbles of chunks 0..4, then their high nibbles).
#[inline(always)]
pub(super) unsafe fn operands<const F: u8>(blk: *const u8) -> [__m512i; 8] {
    let mut w = [_mm512_setzero_si512(); 8];
    if super::format_of(F) == Int8Format::Q8_0 {
        for (t, wt) in w.iter_mut().enumerate() {
            *wt = chunk(blk, t);
        }
    } else {
        let mask = _mm512_set1_epi8(0x0F);
        for t in 0..4 {
            let c = chunk(blk, t);
            w[t] = _mm512_and_si512(c, mask);
            w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
        }
    }
    w
}

/// Stores the accumulators of rows `i0..` for the panel starting at output `col` (the last
/// panel's padding rows left out).
#[inline(always)]
pub(super) unsafe fn store_rows(job: &Job, acc: &[__m512], i0: usize, col: usize) {
    let valid = (job.w.rows - col).min(PANEL);
    let keep: __mmask16 = if valid == PANEL {
        !0
    } else {
        (1u16 << valid) - 1
    };
    for (r, a) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(job.out.add((i0 + r) * job.out_stride + col), keep, *a);
    }
}

#[inline(always)]
unsafe fn tile<const F: u8, const MR: usize>(job: &Job, blk0: *const u8, i0: usize, col: usize) {
    let bb = super::format_of(F).block_bytes();
    let x = job.x;
    let kb = x.blocks();
    debug_assert!((i0 + MR) * kb <= x.d.len() && (i0 + MR) * x.k <= x.q.len());
    let (q0, d0, sum0, ds0) = x_rows_at(x, i0);
    let mut acc = [_mm512_setzero_ps(); MR];
    for g in 0..kb {
        let blk = blk0.add(g * bb);
        super::prefetch_ahead(blk, bb);
        let dw = scales::<F>(blk);
        let w = operands::<F>(blk);
        // All rows' integer dots first: MR independent chains for the out-of-order core.
        let mut dots = [_mm512_setzero_si512(); MR];
        for (r, dot) in dots.iter_mut().enumerate() {
            *dot = block_dot(&w, q0.add(r * x.k + g * 32));
        }
        let mw = q4_1_mins::<F>(blk);
        for (r, a) in acc.iter_mut().enumerate() {
            let bi = r * kb + g;
            *a = accumulate::<F>(
                *a,
                dots[r],
                dw,
                mw,
                *d0.add(bi),
                *sum0.add(bi),
                *ds0.add(bi),
            );
        }
    }
    store_rows(job, &acc, i0, col);
}

#[inline(always)]
unsafe fn run_format<const F: u8>(job: &Job) {
    let m = job.x.m;
    for p in job.panels.clone() {
        let (blk0, col) = (job.w.panel_ptr(p), p * PANEL);
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(8);
            match mr {
                1 => tile::<F, 1>(job, blk0, i, col),
                2 => tile::<F, 2>(job, blk0, i, col),
                3 => tile::<F, 3>(job, blk0, i, col),
                4 => tile::<F, 4>(job, blk0, i, col),
                5 => tile::<F, 5>(job, blk0, i, col),
                6 => tile::<F, 6>(job, blk0, i, col),
                7 => tile::<F, 7>(job, blk0, i, col),
                _ => tile::<F, 8>(job, blk0, i, col),
            }
            i += mr;
        }
    }
}

/// Runs `job` (see [`Job`]).
///
/// # Safety
/// The CPU must support AVX-512F/BW/VNNI and F16C, and `job` must describe valid buffers.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn run(job: &Job) {
    match job.w.format {
        Int8Format::Q4_0 => run_format::<0>(job),
        Int8Format::Q4_1 => run_format::<1>(job),
        Int8Format::Q8_0 => run_format::<2>(job),
    }
}
