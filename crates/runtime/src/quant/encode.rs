//! Encoding f32 rows into stored formats (for synthetic models and tests), following the
//! GGML reference quantizers.

use crate::dtype::DType;

fn f16(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Encodes `row` (a whole number of blocks) as `dtype`, appending to `out`.
/// K-quant encoding is not provided; asking for it panics.
pub fn quantize_row(dtype: DType, row: &[f32], out: &mut Vec<u8>) {
    match dtype {
        DType::F32 => out.extend(row.iter().flat_map(|v| v.to_le_bytes())),
        DType::F16 => out.extend(row.iter().flat_map(|v| f16(*v))),
        DType::BF16 => out.extend(
            row.iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()),
        ),
        DType::Q8_0 => {
            for b in row.chunks_exact(32) {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        DType::Q4_0 => {
            for b in row.chunks_exact(32) {
                let max = b
                    .iter()
                    .copied()
                    .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                for j in 0..16 {
                    let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        DType::Q4_1 => {
            for b in row.chunks_exact(32) {
                let min = b.iter().copied().fold(f32::INFINITY, f32::min);
                let max = b.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16(d));
                out.extend(f16(min));
                for j in 0..16 {
                    let q = |v: f32| (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(q(b[j]) | (q(b[j + 16]) << 4));
                }
            }
        }
        DType::Q4K | DType::Q6K => panic!("encoding {dtype} is not provided"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;

    #[test]
    fn round_trips_within_quantization_error() {
        let row: Vec<f32> = (0..64).map(|i| ((i as f32) * 0.37).sin()).collect();
        for (dtype, tol) in [
            (DType::F32, 0.0),
            (DType::F16, 1e-3),
            (DType::BF16, 1e-2),
            (DType::Q8_0, 1e-2),
            (DType::Q4_1, 0.08),
            (DType::Q4_0, 0.15),
        ] {
            let mut bytes = Vec::new();
            quantize_row(dtype, &row, &mut bytes);
            assert_eq!(Some(bytes.len()), dtype.row_bytes(64));
            let mut back = vec![0f32; 64];
            dequantize_row(dtype, &bytes, &mut back);
            let err = row
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol, "{dtype}: {err}");
        }
    }
}
