//! Stored weight formats, decoded group by group.
//!
//! Every format is read in groups of [`GROUP`] consecutive values of one row. The scalar
//! decoders here define the exact arithmetic (including where fused multiply-adds are used);
//! the SIMD matmul kernels reproduce it bit for bit, and dequantization for embeddings and
//! tests uses it directly.

mod encode;
mod float;
mod kquant;
mod legacy;

use crate::dtype::DType;

/// Values per decode group. Every supported block format is a whole number of groups.
pub const GROUP: usize = 32;

/// Decodes values `g*32 .. g*32+32` of a row stored as `dtype`.
///
/// `row` holds the whole row; panics if it is too short (callers validate shapes on load).
#[inline]
pub fn decode_group(dtype: DType, row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    match dtype {
        DType::F32 => float::decode_f32(row, g, out),
        DType::F16 => float::decode_f16(row, g, out),
        DType::BF16 => float::decode_bf16(row, g, out),
        DType::Q4_0 => legacy::decode_q4_0(row, g, out),
        DType::Q4_1 => legacy::decode_q4_1(row, g, out),
        DType::Q8_0 => legacy::decode_q8_0(row, g, out),
        DType::Q4K => kquant::decode_q4k(row, g, out),
        DType::Q6K => kquant::decode_q6k(row, g, out),
    }
}

/// Dequantizes one whole row into `out` (whose length is the row's column count).
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    if dtype == DType::F32 || !out.len().is_multiple_of(GROUP) {
        return float::dequantize_any(dtype, row, out);
    }
    let mut buf = [0f32; GROUP];
    for (g, chunk) in out.chunks_exact_mut(GROUP).enumerate() {
        decode_group(dtype, row, g, &mut buf);
        chunk.copy_from_slice(&buf);
    }
}

pub use encode::quantize_row;
pub use kquant::{q4k_group_scale_min, q6k_group_scale};

/// Reads a little-endian f16 at `off` as f32.
#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[off], bytes[off + 1]])).to_f32()
}

#[cfg(test)]
mod tests;
