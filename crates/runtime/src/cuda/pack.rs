//! The packed layout of the weights that take int8 activations on the GPU (`Int8Policy`): each
//! row holds its groups' code bytes (the stored blocks without their scales: 16 bytes per
//! 32-value group for Q4_0 and Q4_1, 32 for Q8_0), then the groups' scale bytes (f16 `d`; Q4_1
//! `d` and `m`), padded to 16 bytes. Code blocks start 16-byte aligned, so the int8 kernels read a
//! group's codes with one or two 16-byte loads where the stored 18/20/34-byte blocks allow only
//! 2- or 4-byte loads. The kernels name these layouts `DT_<FORMAT> + DT_PACKED`
//! (kernels/matmul.cu, "packed layouts").

use crate::dtype::DType;
use crate::quant::GROUP;
use crate::weight::HostWeight;

/// Added to a format's kernel number to name its packed layout (`DT_PACKED` in the kernels).
pub const DT_PACKED: usize = 64;

/// Bytes of a stored block's scales (they lead the block), for the formats that are packed.
fn scale_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::Q4_0 | DType::Q8_0 => Some(2),
        DType::Q4_1 => Some(4),
        _ => None,
    }
}

/// Bytes of one packed row of `cols` values of `dtype` (a multiple of 16), or `None` when the
/// format has no packed layout or `cols` is not whole groups.
pub fn row_bytes(dtype: DType, cols: usize) -> Option<usize> {
    scale_bytes(dtype)?;
    if !cols.is_multiple_of(GROUP) {
        return None;
    }
    Some((cols / GROUP * dtype.block_bytes()).next_multiple_of(16))
}

/// `w` in the packed layout: `w.rows` rows of [`row_bytes`] each.
pub fn pack(w: &HostWeight) -> Option<Vec<u8>> {
    let sb = scale_bytes(w.dtype)?;
    let stride = row_bytes(w.dtype, w.cols)?;
    let (groups, bb) = (w.cols / GROUP, w.dtype.block_bytes());
    let cb = bb - sb;
    let mut out = vec![0u8; w.rows * stride];
    for (n, dst) in out.chunks_exact_mut(stride).enumerate() {
        let src = w.row(n);
        let (codes, rest) = dst.split_at_mut(groups * cb);
        for (g, block) in src.chunks_exact(bb).enumerate() {
            codes[g * cb..(g + 1) * cb].copy_from_slice(&block[sb..]);
            rest[g * sb..(g + 1) * sb].copy_from_slice(&block[..sb]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::WeightBytes;

    fn weight(dtype: DType, rows: usize, cols: usize) -> HostWeight {
        let len = rows * dtype.row_bytes(cols).expect("whole blocks");
        let bytes: Vec<u8> = (0..len).map(|i| (i * 131 + i / 7) as u8).collect();
        HostWeight::new("w", dtype, rows, cols, WeightBytes::from_vec(bytes)).unwrap()
    }

    #[test]
    fn rows_are_codes_then_scales_padded_to_16_bytes() {
        for (dtype, cb, sb) in [
            (DType::Q4_0, 16usize, 2usize),
            (DType::Q4_1, 16, 4),
            (DType::Q8_0, 32, 2),
        ] {
            // 3 groups: 54 / 60 / 102 bytes of data, padded to 64 / 64 / 112.
            let (rows, cols) = (5, 96);
            let w = weight(dtype, rows, cols);
            let stride = row_bytes(dtype, cols).unwrap();
            assert_eq!(stride % 16, 0);
            assert_eq!(stride, (3 * (cb + sb)).next_multiple_of(16));
            let p = pack(&w).unwrap();
            assert_eq!(p.len(), rows * stride);
            for n in 0..rows {
                let (src, dst) = (w.row(n), &p[n * stride..(n + 1) * stride]);
                for g in 0..3 {
                    let block = &src[g * (cb + sb)..(g + 1) * (cb + sb)];
                    assert_eq!(&dst[g * cb..(g + 1) * cb], &block[sb..], "{dtype} codes");
                    let s = 3 * cb + g * sb;
                    assert_eq!(&dst[s..s + sb], &block[..sb], "{dtype} scales");
                }
                assert!(
                    dst[3 * (cb + sb)..].iter().all(|&b| b == 0),
                    "{dtype} padding"
                );
            }
        }
    }

    #[test]
    fn other_formats_and_partial_groups_have_no_packed_layout() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q4K, DType::Q6K] {
            assert_eq!(row_bytes(dtype, 256), None);
            assert!(pack(&weight(dtype, 2, 256)).is_none());
        }
        assert_eq!(row_bytes(DType::Q4_0, 48), None);
    }
}
