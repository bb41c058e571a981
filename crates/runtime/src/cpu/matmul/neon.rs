//! NEON matmul kernels for aarch64 (4 lanes), bit-identical to `portable::matmul::<4>`.
//!
//! A 32-value group decodes into eight 4-lane vectors; one accumulator per
//! (x row, weight row), groups walked in order, fused multiply-adds throughout.

#![allow(clippy::missing_safety_doc)]

use std::arch::aarch64::*;

use crate::dtype::DType;
use crate::quant::{f16_at, q4k_group_scale_min, q6k_group_scale};

type Group = [float32x4_t; 8];

trait Decode {
    unsafe fn decode(row: *const u8, g: usize) -> Group;
}

/// 16 unsigned bytes to four f32 vectors.
#[inline(always)]
unsafe fn u8x16_to_f32(q: uint8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_u8(vget_low_u8(q));
    let hi = vmovl_u8(vget_high_u8(q));
    [
        vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))),
        vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
        vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))),
        vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi))),
    ]
}

/// 16 signed bytes to four f32 vectors.
#[inline(always)]
unsafe fn i8x16_to_f32(q: int8x16_t) -> [float32x4_t; 4] {
    let lo = vmovl_s8(vget_low_s8(q));
    let hi = vmovl_s8(vget_high_s8(q));
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi))),
    ]
}

#[inline(always)]
unsafe fn join(a: [float32x4_t; 4], b: [float32x4_t; 4]) -> Group {
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

#[inline(always)]
unsafe fn map(g: Group, f: impl Fn(float32x4_t) -> float32x4_t) -> Group {
    [
        f(g[0]),
        f(g[1]),
        f(g[2]),
        f(g[3]),
        f(g[4]),
        f(g[5]),
        f(g[6]),
        f(g[7]),
    ]
}

#[inline(always)]
unsafe fn bytes(row: *const u8, len: usize) -> &'static [u8] {
    std::slice::from_raw_parts(row, len)
}

struct Q4_0;
impl Decode for Q4_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let b = row.add(g * 18);
        let d = vdupq_n_f32(f16_at(bytes(b, 2), 0));
        let q = vld1q_u8(b.add(2));
        let eight = vdupq_n_s8(8);
        let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F))), eight);
        let hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), eight);
        map(join(i8x16_to_f32(lo), i8x16_to_f32(hi)), |v| {
            vmulq_f32(v, d)
        })
    }
}

struct Q4_1;
impl Decode for Q4_1 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let b = row.add(g * 20);
        let d = vdupq_n_f32(f16_at(bytes(b, 4), 0));
        let m = vdupq_n_f32(f16_at(bytes(b, 4), 2));
        let q = vld1q_u8(b.add(4));
        let lo = vandq_u8(q, vdupq_n_u8(0x0F));
        let hi = vshrq_n_u8(q, 4);
        map(join(u8x16_to_f32(lo), u8x16_to_f32(hi)), |v| {
            vfmaq_f32(m, v, d)
        })
    }
}

struct Q8_0;
impl Decode for Q8_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let b = row.add(g * 34);
        let d = vdupq_n_f32(f16_at(bytes(b, 2), 0));
        let lo = vld1q_s8(b.add(2) as *const i8);
        let hi = vld1q_s8(b.add(18) as *const i8);
        map(join(i8x16_to_f32(lo), i8x16_to_f32(hi)), |v| {
            vmulq_f32(v, d)
        })
    }
}

struct F32;
impl Decode for F32 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let p = row.add(g * 128) as *const f32;
        [
            vld1q_f32(p),
            vld1q_f32(p.add(4)),
            vld1q_f32(p.add(8)),
            vld1q_f32(p.add(12)),
            vld1q_f32(p.add(16)),
            vld1q_f32(p.add(20)),
            vld1q_f32(p.add(24)),
            vld1q_f32(p.add(28)),
        ]
    }
}

/// Plain half-precision rows go through the exact scalar conversion (no FP16 extension needed).
struct Halves<const BF: bool>;
impl<const BF: bool> Decode for Halves<BF> {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let src = bytes(row.add(g * 64), 64);
        let mut vals = [0f32; 32];
        for (i, v) in vals.iter_mut().enumerate() {
            let bits = u16::from_le_bytes([src[2 * i], src[2 * i + 1]]);
            *v = if BF {
                half::bf16::from_bits(bits).to_f32()
            } else {
                half::f16::from_bits(bits).to_f32()
            };
        }
        let p = vals.as_ptr();
        [
            vld1q_f32(p),
            vld1q_f32(p.add(4)),
            vld1q_f32(p.add(8)),
            vld1q_f32(p.add(12)),
            vld1q_f32(p.add(16)),
            vld1q_f32(p.add(20)),
            vld1q_f32(p.add(24)),
            vld1q_f32(p.add(28)),
        ]
    }
}

struct Q4K;
impl Decode for Q4K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let blk = bytes(row.add((g / 8) * 144), 144);
        let (scale, neg_min) = q4k_group_scale_min(blk, g % 8);
        let sub = g % 8;
        let qs = row.add((g / 8) * 144 + 16 + (sub / 2) * 32);
        let codes = |o: usize| {
            let q = vld1q_u8(qs.add(o));
            if sub % 2 == 0 {
                vandq_u8(q, vdupq_n_u8(0x0F))
            } else {
                vshrq_n_u8(q, 4)
            }
        };
        let d = vdupq_n_f32(scale);
        let mn = vdupq_n_f32(neg_min);
        map(join(u8x16_to_f32(codes(0)), u8x16_to_f32(codes(16))), |v| {
            vfmaq_f32(mn, v, d)
        })
    }
}

struct Q6K;
impl Decode for Q6K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> Group {
        let blk = bytes(row.add((g / 8) * 210), 210);
        let (s0, s1) = q6k_group_scale(blk, g % 8);
        let sub = g % 8;
        let half = sub / 4;
        let quarter = sub % 4;
        let ql = row.add((g / 8) * 210 + 64 * half + if quarter % 2 == 1 { 32 } else { 0 });
        let qh = row.add((g / 8) * 210 + 128 + 32 * half);
        let shift = vdupq_n_s8(-(2 * quarter as i8));
        let codes = |o: usize| {
            let l = vld1q_u8(ql.add(o));
            let l = if quarter >= 2 {
                vshrq_n_u8(l, 4)
            } else {
                vandq_u8(l, vdupq_n_u8(0x0F))
            };
            let h = vandq_u8(vshlq_u8(vld1q_u8(qh.add(o)), shift), vdupq_n_u8(3));
            let q = vorrq_u8(l, vshlq_n_u8(h, 4));
            vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8(32))
        };
        let a = i8x16_to_f32(codes(0));
        let b = i8x16_to_f32(codes(16));
        let (s0, s1) = (vdupq_n_f32(s0), vdupq_n_f32(s1));
        [
            vmulq_f32(a[0], s0),
            vmulq_f32(a[1], s0),
            vmulq_f32(a[2], s0),
            vmulq_f32(a[3], s0),
            vmulq_f32(b[0], s1),
            vmulq_f32(b[1], s1),
            vmulq_f32(b[2], s1),
            vmulq_f32(b[3], s1),
        ]
    }
}

/// Pairwise lane reduction matching `portable::reduce_lanes::<4>`.
#[inline(always)]
unsafe fn reduce(v: float32x4_t) -> f32 {
    vpadds_f32(vadd_f32(vget_low_f32(v), vget_high_f32(v)))
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile<D: Decode, const MR: usize, const NR: usize>(
    x: *const f32,
    x_stride: usize,
    w: *const u8,
    row_bytes: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[vdupq_n_f32(0.0); NR]; MR];
    for g in 0..k_groups {
        for n in 0..NR {
            let wv = D::decode(w.add(n * row_bytes), g);
            for (c, wc) in wv.iter().enumerate() {
                for (i, acc_i) in acc.iter_mut().enumerate() {
                    let xv = vld1q_f32(x.add(i * x_stride + g * 32 + c * 4));
                    acc_i[n] = vfmaq_f32(acc_i[n], *wc, xv);
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
    let mut j = 0;
    while j < n {
        let full = n - j >= NR;
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
            match (mr, full) {
                (2, true) => go!(2, 4),
                (1, true) => go!(1, 4),
                (2, false) => go!(2, 1),
                _ => go!(1, 1),
            }
            i += mr;
        }
        j += if full { NR } else { 1 };
    }
}

/// See `portable::matmul`; same contract, NEON instructions.
///
/// # Safety
/// As `portable::matmul`.
#[target_feature(enable = "neon")]
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
        DType::F16 => run::<Halves<false>>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::BF16 => run::<Halves<true>>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_0 => run::<Q4_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_1 => run::<Q4_1>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q8_0 => run::<Q8_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4K => run::<Q4K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q6K => run::<Q6K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
    }
}
