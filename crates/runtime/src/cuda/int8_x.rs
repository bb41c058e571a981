//! The int8 copy of an activation handed from the kernel that wrote it to the int8 product
//! that reads it next, so that product needs no quantizer launch.
//!
//! An int8 product (`mmq_*`, `mmqt_*`) multiplies x quantized per row and 32-value block
//! (`q8_block` in common.cu): codes, then a (d, d·Σq) pair per block; with two-term
//! activations (`Int8Policy::TwoTerms`) each row of x is two int8 rows, its codes then its
//! residual's (`q8_terms`), so a copy of m rows holds 2m int8 rows. The RMS norm, the
//! attention merge and the int8 SwiGLU product of few rows can write that copy of their output
//! in the same launch (same bits as the quantizer). The device remembers the one copy written
//! by the last launch ([`FreshX`]); any later launch or host copy forgets it, so a product only
//! reads a copy when the kernel just before it wrote both x and the copy. A product that keeps
//! x intact hands the copy on to the next product of the same x.

use std::sync::Mutex;

use crate::quant::GROUP;

/// Bytes of the int8 copy of `m` int8 rows of `k` values (rows of x times their terms): the
/// codes (padded to 16 bytes), then 8 bytes (two f32) per 32-value block. Returns (offset of
/// the pairs, total bytes).
pub(crate) fn int8_x_bytes(m: usize, k: usize) -> (usize, usize) {
    let codes = (m * k).next_multiple_of(16);
    (codes, codes + 8 * (m * k / GROUP))
}

/// An int8 copy of `rows` rows of `k` f32 values at device address `x`, `terms` int8 rows per
/// row (interleaved: row i's are int8 rows `terms · i ..`): codes at `codes`, pairs at `pairs`
/// (the layout of [`int8_x_bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuantizedX {
    pub x: u64,
    pub rows: usize,
    pub k: usize,
    pub terms: usize,
    pub codes: u64,
    pub pairs: u64,
}

impl QuantizedX {
    /// The codes and pairs of `m` rows of `k` values starting at address `x`, when they are
    /// rows of this copy.
    pub fn rows_at(&self, x: u64, m: usize, k: usize) -> Option<(u64, u64)> {
        if k != self.k || k == 0 || x < self.x {
            return None;
        }
        let row_bytes = 4 * k as u64;
        let off = x - self.x;
        if !off.is_multiple_of(row_bytes) {
            return None;
        }
        let r0 = usize::try_from(off / row_bytes).ok()?;
        if r0.checked_add(m)? > self.rows {
            return None;
        }
        let q0 = self.terms * r0;
        Some((
            self.codes + (q0 * k) as u64,
            self.pairs + (8 * q0 * (k / GROUP)) as u64,
        ))
    }

    /// Whether `bytes` bytes at `ptr` overlap the f32 rows this copy was made from.
    pub fn overlaps(&self, ptr: u64, bytes: u64) -> bool {
        let end = self.x + 4 * (self.rows * self.k) as u64;
        ptr < end && self.x < ptr + bytes
    }
}

/// The int8 copy written by the last launch, if it wrote one.
#[derive(Default)]
pub(crate) struct FreshX(Mutex<Option<QuantizedX>>);

impl FreshX {
    /// Forgets the copy: called before every launch and host-to-device copy.
    pub fn forget(&self) {
        *self.0.lock().expect("fresh x lock") = None;
    }

    /// Records the copy the launch just made wrote.
    pub fn note(&self, q: QuantizedX) {
        *self.0.lock().expect("fresh x lock") = Some(q);
    }

    /// The copy, if the last launch wrote one.
    pub fn get(&self) -> Option<QuantizedX> {
        *self.0.lock().expect("fresh x lock")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_quantizer_scratch() {
        // 3 rows of 64: 192 codes (a multiple of 16), 6 blocks of 8 bytes.
        assert_eq!(int8_x_bytes(3, 64), (192, 192 + 48));
        // 1 row of 32: the codes are padded to 16 bytes, so the pairs stay 8-byte aligned.
        assert_eq!(int8_x_bytes(1, 32), (32, 40));
        assert_eq!(int8_x_bytes(5, 96).0 % 16, 0);
    }

    #[test]
    fn rows_are_found_only_inside_the_copy() {
        let q = QuantizedX {
            x: 0x1000,
            rows: 4,
            k: 64,
            terms: 1,
            codes: 0x9000,
            pairs: 0x9100,
        };
        assert_eq!(q.rows_at(0x1000, 4, 64), Some((0x9000, 0x9100)));
        // Rows 1..3: 64 codes and 2 pairs (16 bytes) per row in.
        assert_eq!(q.rows_at(0x1000 + 256, 2, 64), Some((0x9040, 0x9110)));
        assert_eq!(q.rows_at(0x1000 + 3 * 256, 1, 64), Some((0x90c0, 0x9130)));
        // Past the last row, another width, a misaligned start, before the start.
        assert_eq!(q.rows_at(0x1000 + 256, 4, 64), None);
        assert_eq!(q.rows_at(0x1000, 2, 32), None);
        assert_eq!(q.rows_at(0x1000 + 4, 1, 64), None);
        assert_eq!(q.rows_at(0x0f00, 1, 64), None);
        // Two terms: row r's int8 rows are 2r and 2r + 1, so rows 1.. start two int8 rows in.
        let q2 = QuantizedX { terms: 2, ..q };
        assert_eq!(q2.rows_at(0x1000, 4, 64), Some((0x9000, 0x9100)));
        assert_eq!(q2.rows_at(0x1000 + 256, 2, 64), Some((0x9080, 0x9120)));
        assert_eq!(q2.rows_at(0x1000 + 256, 4, 64), None);
    }

    #[test]
    fn overlap_is_any_shared_byte() {
        let q = QuantizedX {
            x: 0x1000,
            rows: 2,
            k: 32,
            terms: 1,
            codes: 0,
            pairs: 0,
        };
        // The rows span 0x1000..0x1100.
        assert!(q.overlaps(0x1000, 4));
        assert!(q.overlaps(0x10fc, 4));
        assert!(q.overlaps(0x0f00, 0x104));
        assert!(!q.overlaps(0x1100, 64));
        assert!(!q.overlaps(0x0f00, 0x100));
    }

    #[test]
    fn forgetting_clears_the_copy() {
        let f = FreshX::default();
        assert_eq!(f.get(), None);
        let q = QuantizedX {
            x: 1,
            rows: 1,
            k: 32,
            terms: 2,
            codes: 2,
            pairs: 3,
        };
        f.note(q);
        assert_eq!(f.get(), Some(q));
        f.forget();
        assert_eq!(f.get(), None);
    }
}
