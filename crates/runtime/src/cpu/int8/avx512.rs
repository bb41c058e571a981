//! AVX-512-VNNI int8 kernels: one `vpdpbusd` multiplies 4 codes of 16 weight rows (one
//! 64-byte chunk of a packed block) with 4 broadcast activation codes.
//!
//! Weight codes are the unsigned operand (Q4 nibbles 0..15; Q8_0 stored as `code + 128`, the
//! offset removed with the block's exact code sum), activation codes the signed one. A tile
//! is `MR` activation rows against one 16-row panel: each block is loaded and split into
//! nibbles once and used by all `MR` rows. Float steps follow `reference` exactly.

use std::arch::x86_64::*;

use super::pack::{Int8Format, PANEL};
use super::Job;

#[inline(always)]
unsafe fn bcast(p: *const i8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn chunk(blk: *const u8, t: usize) -> __m512i {
    _mm512_loadu_si512(blk.add(64 * t) as *const __m512i)
}

#[inline(always)]
unsafe fn tile<const F: u8, const MR: usize>(job: &Job, blk0: *const u8, i0: usize, col: usize) {
    let format = super::format_of(F);
    let (bb, cb) = (format.block_bytes(), format.code_bytes());
    let x = job.x;
    let kb = x.blocks();
    let zero = _mm512_setzero_si512();
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); MR];
    for g in 0..kb {
        let blk = blk0.add(g * bb);
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb) as *const __m256i));
        // Eight 64-byte operands: chunk t pairs with activation codes 4t..4t+4.
        let mut w = [zero; 8];
        if format == Int8Format::Q8_0 {
            for (t, wt) in w.iter_mut().enumerate() {
                *wt = chunk(blk, t);
            }
        } else {
            for t in 0..4 {
                let c = chunk(blk, t);
                w[t] = _mm512_and_si512(c, mask);
                w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask);
            }
        }
        let mw = if format == Int8Format::Q4_1 {
            _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(cb + 32) as *const __m256i))
        } else {
            _mm512_setzero_ps()
        };
        for (r, a) in acc.iter_mut().enumerate() {
            let i = i0 + r;
            let xq = x.q.as_ptr().add(i * x.k + g * 32);
            // Two independent chains keep the dot-product latency off the critical path.
            let mut s0 = _mm512_dpbusd_epi32(zero, w[0], bcast(xq));
            let mut s1 = _mm512_dpbusd_epi32(zero, w[4], bcast(xq.add(16)));
            for t in 1..4 {
                s0 = _mm512_dpbusd_epi32(s0, w[t], bcast(xq.add(4 * t)));
                s1 = _mm512_dpbusd_epi32(s1, w[t + 4], bcast(xq.add(16 + 4 * t)));
            }
            let mut dot = _mm512_add_epi32(s0, s1);
            let bi = i * kb + g;
            match format {
                Int8Format::Q4_0 => dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(8 * x.sum[bi])),
                Int8Format::Q8_0 => dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x.sum[bi])),
                Int8Format::Q4_1 => {}
            }
            let s = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[bi]));
            *a = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(dot), *a);
            if format == Int8Format::Q4_1 {
                *a = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.ds[bi]), *a);
            }
        }
    }
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
