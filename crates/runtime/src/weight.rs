//! Host-side weight tensors: a dtype, a 2-D shape and bytes that stay in their stored form
//! (usually a slice of a memory-mapped model file).

use std::ops::Range;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::RuntimeError;

/// Shared, immutable bytes: an owner (an mmap or a vector) and the range inside it.
#[derive(Clone)]
pub struct WeightBytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl WeightBytes {
    /// A view of `range` inside `owner`. Panics if the range is out of bounds (callers check).
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Self {
        assert!(range.end <= (*owner).as_ref().len() && range.start <= range.end);
        Self { owner, range }
    }

    /// Owns a vector of bytes.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self::new(Arc::new(bytes), 0..len)
    }

    /// Little-endian f32 values.
    pub fn from_f32(values: &[f32]) -> Self {
        Self::from_vec(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    pub fn as_slice(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    pub fn len(&self) -> usize {
        self.range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.len())
    }
}

/// A 2-D weight: `rows` output features, each a row of `cols` values stored as `dtype`.
/// A 1-D tensor (a norm weight, a bias) is a single row.
#[derive(Clone, Debug)]
pub struct HostWeight {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: WeightBytes,
}

impl HostWeight {
    /// Checks that the bytes hold exactly `rows` rows of `cols` values of `dtype`.
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        rows: usize,
        cols: usize,
        bytes: WeightBytes,
    ) -> Result<Self, RuntimeError> {
        let name = name.into();
        let row_bytes = dtype
            .row_bytes(cols)
            .ok_or_else(|| RuntimeError::RaggedBlocks {
                name: name.clone(),
                dtype,
                cols,
                block: dtype.block_len(),
            })?;
        let expected = row_bytes.saturating_mul(rows);
        if bytes.len() != expected {
            return Err(RuntimeError::ByteLength {
                name,
                dtype,
                rows,
                cols,
                expected,
                found: bytes.len(),
            });
        }
        Ok(Self {
            name,
            dtype,
            rows,
            cols,
            bytes,
        })
    }

    /// An f32 weight owning `values` (row-major `rows x cols`).
    pub fn from_f32(name: impl Into<String>, rows: usize, cols: usize, values: &[f32]) -> Self {
        assert_eq!(values.len(), rows * cols);
        Self::new(name, DType::F32, rows, cols, WeightBytes::from_f32(values))
            .expect("f32 weight shape is consistent by construction")
    }

    /// Bytes of one stored row.
    pub fn row_bytes(&self) -> usize {
        self.dtype
            .row_bytes(self.cols)
            .expect("validated on construction")
    }

    /// The stored bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes.as_slice()[r * rb..(r + 1) * rb]
    }

    /// This weight re-encoded as `dtype` (rows decoded to f32, then encoded with
    /// `quant::quantize_row`), or `None` when `dtype` has no encoder here (K-quants) or
    /// `cols` is not a whole number of its blocks.
    pub fn requantized(&self, dtype: DType) -> Option<HostWeight> {
        if matches!(dtype, DType::Q4K | DType::Q6K) || !self.cols.is_multiple_of(dtype.block_len())
        {
            return None;
        }
        let mut row = vec![0f32; self.cols];
        let mut bytes = Vec::with_capacity(self.rows * dtype.row_bytes(self.cols)?);
        for r in 0..self.rows {
            self.dequantize_row(r, &mut row);
            crate::quant::quantize_row(dtype, &row, &mut bytes);
        }
        HostWeight::new(
            self.name.clone(),
            dtype,
            self.rows,
            self.cols,
            WeightBytes::from_vec(bytes),
        )
        .ok()
    }

    /// Dequantizes row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        crate::quant::dequantize_row(self.dtype, self.row(r), out);
    }

    /// All values as f32, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, chunk) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(r, chunk);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requantized_rows_are_the_encoder_of_the_decoded_rows() {
        let (rows, cols) = (3, 64);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let mut bf16 = Vec::new();
        crate::quant::quantize_row(DType::BF16, &values, &mut bf16);
        let w = HostWeight::new("w", DType::BF16, rows, cols, WeightBytes::from_vec(bf16)).unwrap();
        let q = w.requantized(DType::Q8_0).unwrap();
        assert_eq!(
            (q.dtype, q.rows, q.cols, q.name.as_str()),
            (DType::Q8_0, 3, 64, "w")
        );
        let mut want = Vec::new();
        for r in 0..rows {
            let mut row = vec![0f32; cols];
            w.dequantize_row(r, &mut row);
            crate::quant::quantize_row(DType::Q8_0, &row, &mut want);
        }
        assert_eq!(q.bytes.as_slice(), want.as_slice());
        // Q8_0 keeps every value within half a step of its block's scale.
        let back = q.to_f32();
        for (b, v) in back.chunks(32).zip(w.to_f32().chunks(32)) {
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            for (x, y) in b.iter().zip(v) {
                assert!(
                    (x - y).abs() <= amax / 127.0 * 0.5 + 1e-3 * amax,
                    "{x} vs {y}"
                );
            }
        }
        // No encoder for K-quants; rows that are not whole blocks.
        assert!(w.requantized(DType::Q4K).is_none());
        let odd = HostWeight::from_f32("odd", 1, 48, &[0.5; 48]);
        assert!(odd.requantized(DType::Q8_0).is_none());
    }
}
