//! Plain float rows: f32, f16 and bf16, little-endian.

use super::GROUP;
use crate::dtype::DType;

pub(super) fn decode_f32(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let base = g * GROUP * 4;
    for (i, o) in out.iter_mut().enumerate() {
        let b = base + 4 * i;
        *o = f32::from_le_bytes([row[b], row[b + 1], row[b + 2], row[b + 3]]);
    }
}

pub(super) fn decode_f16(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let base = g * GROUP * 2;
    for (i, o) in out.iter_mut().enumerate() {
        *o = super::f16_at(row, base + 2 * i);
    }
}

pub(super) fn decode_bf16(row: &[u8], g: usize, out: &mut [f32; GROUP]) {
    let base = g * GROUP * 2;
    for (i, o) in out.iter_mut().enumerate() {
        let b = base + 2 * i;
        *o = half::bf16::from_bits(u16::from_le_bytes([row[b], row[b + 1]])).to_f32();
    }
}

/// Element-wise conversion for plain float rows of any length.
pub(super) fn dequantize_any(dtype: DType, row: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::F16 => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = super::f16_at(row, 2 * i);
            }
        }
        DType::BF16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        other => panic!("{other} rows must be a whole number of {GROUP}-value groups"),
    }
}
