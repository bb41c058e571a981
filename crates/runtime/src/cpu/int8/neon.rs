//! NEON dot-product (`sdot`) int8 kernels: a 16-row panel is handled as four quarters of 4
//! rows; one `sdot` multiplies 4 codes of 4 weight rows with 4 broadcast activation codes.
//!
//! Both operands are signed: Q4 nibbles (0..15) fit, Q8_0 codes are restored from their
//! stored `code + 128`. The integer dot is exact, the float steps follow `reference`.

use std::arch::aarch64::*;

use super::pack::{Int8Format, PANEL};
use super::Job;

/// `acc + sdot(a, b)`: per 32-bit lane, the sum of 4 signed byte products. (The intrinsic
/// `vdotq_s32` is not stable Rust yet; the instruction is, through `asm!`.)
#[inline(always)]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    std::arch::asm!(
        ".arch_extension dotprod",
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags),
    );
    acc
}

#[inline(always)]
unsafe fn bcast(p: *const i8) -> int8x16_t {
    vreinterpretq_s8_s32(vdupq_n_s32(std::ptr::read_unaligned(p as *const i32)))
}

/// Four f16 scales (exactly converted) as a vector.
#[inline(always)]
unsafe fn scales4(p: *const u8) -> float32x4_t {
    let mut s = [0f32; 4];
    for (i, v) in s.iter_mut().enumerate() {
        *v = half::f16::from_le_bytes([*p.add(2 * i), *p.add(2 * i + 1)]).to_f32();
    }
    vld1q_f32(s.as_ptr())
}

#[inline(always)]
unsafe fn tile<const F: u8, const MR: usize>(job: &Job, blk0: *const u8, i0: usize, col: usize) {
    let format = super::format_of(F);
    let (bb, cb) = (format.block_bytes(), format.code_bytes());
    let x = job.x;
    let kb = x.blocks();
    let valid = (job.w.rows - col).min(PANEL);
    let zero = vdupq_n_s32(0);
    for qd in 0..4 {
        if 4 * qd >= valid {
            break;
        }
        let mut acc = [vdupq_n_f32(0.0); MR];
        for g in 0..kb {
            let blk = blk0.add(g * bb);
            let dw = scales4(blk.add(cb + 8 * qd));
            let mut w = [vdupq_n_s8(0); 8];
            if format == Int8Format::Q8_0 {
                for (t, wt) in w.iter_mut().enumerate() {
                    let c = vld1q_s8(blk.add(64 * t + 16 * qd) as *const i8);
                    *wt = veorq_s8(c, vdupq_n_s8(-128));
                }
            } else {
                for t in 0..4 {
                    let c = vld1q_u8(blk.add(64 * t + 16 * qd));
                    w[t] = vreinterpretq_s8_u8(vandq_u8(c, vdupq_n_u8(0x0F)));
                    w[t + 4] = vreinterpretq_s8_u8(vshrq_n_u8::<4>(c));
                }
            }
            let mw = if format == Int8Format::Q4_1 {
                scales4(blk.add(cb + 32 + 8 * qd))
            } else {
                vdupq_n_f32(0.0)
            };
            for (r, a) in acc.iter_mut().enumerate() {
                let i = i0 + r;
                let bi = i * kb + g;
                let xq = x.q.as_ptr().add(i * x.k + g * 32);
                let mut s0 = sdot(zero, w[0], bcast(xq));
                let mut s1 = sdot(zero, w[4], bcast(xq.add(16)));
                for t in 1..4 {
                    s0 = sdot(s0, w[t], bcast(xq.add(4 * t)));
                    s1 = sdot(s1, w[t + 4], bcast(xq.add(16 + 4 * t)));
                }
                let mut d = vaddq_s32(s0, s1);
                if format == Int8Format::Q4_0 {
                    d = vsubq_s32(d, vdupq_n_s32(8 * x.sum[bi]));
                }
                let s = vmulq_f32(dw, vdupq_n_f32(x.d[bi]));
                *a = vfmaq_f32(*a, s, vcvtq_f32_s32(d));
                if format == Int8Format::Q4_1 {
                    *a = vfmaq_f32(*a, mw, vdupq_n_f32(x.ds[bi]));
                }
            }
        }
        let n = (valid - 4 * qd).min(4);
        for (r, a) in acc.iter().enumerate() {
            let o = job.out.add((i0 + r) * job.out_stride + col + 4 * qd);
            let mut tmp = [0f32; 4];
            vst1q_f32(tmp.as_mut_ptr(), *a);
            std::ptr::copy_nonoverlapping(tmp.as_ptr(), o, n);
        }
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
/// The CPU must support NEON with the dot-product extension, and `job` must describe valid
/// buffers.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn run(job: &Job) {
    match job.w.format {
        Int8Format::Q4_0 => run_format::<0>(job),
        Int8Format::Q4_1 => run_format::<1>(job),
        Int8Format::Q8_0 => run_format::<2>(job),
    }
}
