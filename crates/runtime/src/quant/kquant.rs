//! K-quant super-block formats (256 values per block): Q4_K and Q6_K.
//!
//! Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit (scale, min) pairs for 8 sub-blocks,
//! 128 bytes of nibbles. Sub-block s covers values 32s..32s+32; sub-blocks 2p and 2p+1 share
//! bytes 32p..32p+32 (low and high nibbles). Value = fma(q, d·scale_s, −dmin·min_s).
//! Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 signed 8-bit scales, f16 d.
//! Value = (d·scale) · (q − 32) with q the 6-bit code.

use super::{f16_at, GROUP};

const Q4K_BYTES: usize = 144;
const Q6K_BYTES: usize = 210;

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block's packed scale bytes.
#[inline(always)]
fn q4k_scale_min_codes(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The effective (scale, negated min) of group `g` of a Q4_K row: value = fma(q, scale, neg_min).
#[inline(always)]
pub fn q4k_group_scale_min(row: &[u8], g: usize) -> (f32, f32) {
    let blk = &row[(g / 8) * Q4K_BYTES..(g / 8 + 1) * Q4K_BYTES];
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let (sc, m) = q4k_scale_min_codes(g % 8, &blk[4..16]);
    (d * sc as f32, -(dmin * m as f32))
}

pub(super) fn decode_q4k(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let (scale, neg_min) = q4k_group_scale_min(row, g);
    let blk = &row[(g / 8) * Q4K_BYTES..(g / 8 + 1) * Q4K_BYTES];
    let sub = g % 8;
    let qs = &blk[16 + (sub / 2) * 32..16 + (sub / 2) * 32 + 32];
    let shift = if sub.is_multiple_of(2) { 0 } else { 4 };
    for (o, &q) in out.iter_mut().zip(qs) {
        *o = (((q >> shift) & 0x0F) as f32).mul_add(scale, neg_min);
    }
}

/// The effective scale of group `g` of a Q6_K row, for the two 16-value halves of the group.
#[inline(always)]
pub fn q6k_group_scale(row: &[u8], g: usize) -> (f32, f32) {
    let blk = &row[(g / 8) * Q6K_BYTES..(g / 8 + 1) * Q6K_BYTES];
    let d = f16_at(blk, 208);
    let sub = g % 8;
    // Group `sub` covers values 32·sub..32·sub+32; scales cover 16 values each.
    let s0 = blk[192 + 2 * q6k_scale_slot(sub)] as i8;
    let s1 = blk[192 + 2 * q6k_scale_slot(sub) + 1] as i8;
    (d * s0 as f32, d * s1 as f32)
}

/// Q6_K stores its 16 scales in the order the reference dequantizer walks them: half h
/// (values 128h..) uses scales 8h..8h+8, and within a half, quarter q (32 values) uses
/// scales 8h+2q and 8h+2q+1 for its two 16-value runs.
#[inline(always)]
fn q6k_scale_slot(sub: usize) -> usize {
    let half = sub / 4;
    let quarter = sub % 4;
    4 * half + quarter
}

pub(super) fn decode_q6k(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let blk = &row[(g / 8) * Q6K_BYTES..(g / 8 + 1) * Q6K_BYTES];
    let (s0, s1) = q6k_group_scale(row, g);
    let sub = g % 8;
    let half = sub / 4;
    let quarter = sub % 4;
    let ql = &blk[64 * half..64 * half + 64];
    let qh = &blk[128 + 32 * half..128 + 32 * half + 32];
    for l in 0..32 {
        let low = match quarter {
            0 => ql[l] & 0x0F,
            1 => ql[l + 32] & 0x0F,
            2 => ql[l] >> 4,
            _ => ql[l + 32] >> 4,
        };
        let high = (qh[l] >> (2 * quarter)) & 3;
        let q = ((low | (high << 4)) as i32 - 32) as f32;
        out[l] = q * if l < 16 { s0 } else { s1 };
    }
}
