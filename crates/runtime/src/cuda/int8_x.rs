//! The int8 copy of an activation handed from the kernel that wrote it to the int8 product
//! that reads it next, so that product needs no quantizer launch.
//!
//! An int8 product (`mmq_*`, `mmqt_*`) multiplies x quantized per row and 32-value block
//! (`q8_block` in common.cu): codes, then a (d, d·Σq) pair per block; with two-term
//! activations (`Int8Policy::TwoTerms`) each row of x is two int8 rows, its codes then its
//! residual's (`q8_terms`), so a copy of m rows holds 2m int8 rows. A copy is stored in one of
//! two forms ([`X8Form`]): by rows for the dp4a kernels (`mmq_*`, a lane reads a block of a
//! row), or in the tensor cores' A-fragment tiles for the `mmqt_*` kernels (a lane reads its
//! whole fragment of a block of 16 int8 rows in one 16-byte load). The RMS norm, the
//! attention merge and the int8 SwiGLU product of few rows can write that copy of their output
//! in the same launch (same bits as the quantizer). The device remembers the one copy written
//! by the last launch ([`FreshX`]); any later launch or host copy forgets it, so a product only
//! reads a copy when the kernel just before it wrote both x and the copy. A product that keeps
//! x intact hands the copy on to the next product of the same x.

use std::sync::Mutex;

use super::device::QT_BM;
use crate::quant::GROUP;

/// The flag of the tiled form in the form word the kernels take (`X8_TILED`, common.cu); the
/// bits below it hold the terms per row.
pub(crate) const X8_TILED: usize = 4;

/// How an int8 copy is stored: `terms` int8 rows per row of x (1, or 2 with two-term
/// activations), and
/// - by rows (`tiled` false): int8 rows interleaved (row i's are int8 rows `terms · i ..`), the
///   codes row-major, then the pairs row-major, one per 32-value block;
/// - tiled: per tile of `QT_BM` int8 rows (rows of x, or half as many rows' two terms: int8 row
///   r of a tile is term r / (QT_BM / terms) of row r mod (QT_BM / terms)) and 32-value block,
///   512 bytes of codes in which lane l = 4g + t of a warp finds the A fragment of
///   `mma.m16n8k32` (matmul_qtc.cu) as 16 bytes at 16 l: tile rows g and g + 8 at values
///   4t..4t+3, then at 16 + 4t..; then 16 pairs per tile, rows g and g + 8 side by side at
///   2g. Tiles run over the blocks of K, then over the rows. The int8 tensor-core kernels read
///   this form, the rest the other; each code and pair is the same in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct X8Form {
    pub terms: usize,
    pub tiled: bool,
}

impl X8Form {
    /// The form word of the kernels' `form` arguments (`q8_terms` in common.cu).
    pub fn word(self) -> i32 {
        (self.terms | if self.tiled { X8_TILED } else { 0 }) as i32
    }

    /// Bytes of the copy of `rows` rows of `k` values: the codes (padded to 16 bytes; tiled,
    /// to whole tiles), then 8 bytes (two f32) per 32-value block. Returns (offset of the
    /// pairs, total bytes).
    pub fn bytes(self, rows: usize, k: usize) -> (usize, usize) {
        let mut int8_rows = self.terms * rows;
        if self.tiled {
            int8_rows = int8_rows.next_multiple_of(QT_BM);
        }
        let codes = (int8_rows * k).next_multiple_of(16);
        (codes, codes + 8 * (int8_rows * k / GROUP))
    }
}

/// An int8 copy of `rows` rows of `k` f32 values at device address `x`, in form `form`: codes
/// at `codes`, pairs at `pairs` (the layout of [`X8Form::bytes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QuantizedX {
    pub x: u64,
    pub rows: usize,
    pub k: usize,
    pub form: X8Form,
    pub codes: u64,
    pub pairs: u64,
}

impl QuantizedX {
    /// The codes and pairs of `m` rows of `k` values starting at address `x` in form `form`,
    /// when they are rows of this copy: any of its rows by rows, the whole copy tiled (its
    /// tiles start at its first row).
    pub fn rows_at(&self, x: u64, m: usize, k: usize, form: X8Form) -> Option<(u64, u64)> {
        if form != self.form || k != self.k || k == 0 || x < self.x {
            return None;
        }
        if form.tiled {
            return (x == self.x && m == self.rows).then_some((self.codes, self.pairs));
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
        let q0 = form.terms * r0;
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

    const ROWS: X8Form = X8Form {
        terms: 1,
        tiled: false,
    };
    const TILED: X8Form = X8Form {
        terms: 1,
        tiled: true,
    };

    #[test]
    fn layout_matches_the_quantizer_scratch() {
        // 3 rows of 64: 192 codes (a multiple of 16), 6 blocks of 8 bytes.
        assert_eq!(ROWS.bytes(3, 64), (192, 192 + 48));
        // 1 row of 32: the codes are padded to 16 bytes, so the pairs stay 8-byte aligned.
        assert_eq!(ROWS.bytes(1, 32), (32, 40));
        assert_eq!(ROWS.bytes(5, 96).0 % 16, 0);
        // Two terms: twice the int8 rows.
        let two = X8Form { terms: 2, ..ROWS };
        assert_eq!(two.bytes(3, 64), (384, 384 + 96));
        // Tiled: whole tiles of 16 int8 rows (5 rows: one tile; 17: two; two terms of 9: two).
        assert_eq!(TILED.bytes(5, 64), (16 * 64, 16 * 64 + 8 * 32));
        assert_eq!(TILED.bytes(17, 64), (32 * 64, 32 * 64 + 8 * 64));
        let two_tiled = X8Form { terms: 2, ..TILED };
        assert_eq!(two_tiled.bytes(8, 64), TILED.bytes(16, 64));
        assert_eq!(two_tiled.bytes(9, 64), TILED.bytes(32, 64));
    }

    #[test]
    fn form_words_carry_terms_and_the_tiled_flag() {
        assert_eq!(ROWS.word(), 1);
        assert_eq!(X8Form { terms: 2, ..ROWS }.word(), 2);
        assert_eq!(TILED.word(), 1 | X8_TILED as i32);
        assert_eq!(X8Form { terms: 2, ..TILED }.word(), 2 | X8_TILED as i32);
        // The terms fit below the flag.
        assert!(2 < X8_TILED && X8_TILED.is_power_of_two());
    }

    #[test]
    fn rows_are_found_only_inside_the_copy() {
        let q = QuantizedX {
            x: 0x1000,
            rows: 4,
            k: 64,
            form: ROWS,
            codes: 0x9000,
            pairs: 0x9100,
        };
        assert_eq!(q.rows_at(0x1000, 4, 64, ROWS), Some((0x9000, 0x9100)));
        // Rows 1..3: 64 codes and 2 pairs (16 bytes) per row in.
        assert_eq!(q.rows_at(0x1000 + 256, 2, 64, ROWS), Some((0x9040, 0x9110)));
        assert_eq!(
            q.rows_at(0x1000 + 3 * 256, 1, 64, ROWS),
            Some((0x90c0, 0x9130))
        );
        // Past the last row, another width, a misaligned start, before the start.
        assert_eq!(q.rows_at(0x1000 + 256, 4, 64, ROWS), None);
        assert_eq!(q.rows_at(0x1000, 2, 32, ROWS), None);
        assert_eq!(q.rows_at(0x1000 + 4, 1, 64, ROWS), None);
        assert_eq!(q.rows_at(0x0f00, 1, 64, ROWS), None);
        // Another form: never (the kernel would read the wrong layout).
        assert_eq!(q.rows_at(0x1000, 4, 64, TILED), None);
        // Two terms: row r's int8 rows are 2r and 2r + 1, so rows 1.. start two int8 rows in.
        let two = X8Form { terms: 2, ..ROWS };
        let q2 = QuantizedX { form: two, ..q };
        assert_eq!(q2.rows_at(0x1000, 4, 64, two), Some((0x9000, 0x9100)));
        assert_eq!(q2.rows_at(0x1000 + 256, 2, 64, two), Some((0x9080, 0x9120)));
        assert_eq!(q2.rows_at(0x1000 + 256, 4, 64, two), None);
        assert_eq!(q2.rows_at(0x1000, 4, 64, ROWS), None);
        // Tiled: only the whole copy, whose tiles start at its first row.
        let qt = QuantizedX { form: TILED, ..q };
        assert_eq!(qt.rows_at(0x1000, 4, 64, TILED), Some((0x9000, 0x9100)));
        assert_eq!(qt.rows_at(0x1000, 3, 64, TILED), None);
        assert_eq!(qt.rows_at(0x1000 + 256, 3, 64, TILED), None);
        assert_eq!(qt.rows_at(0x1000, 4, 64, ROWS), None);
    }

    #[test]
    fn overlap_is_any_shared_byte() {
        let q = QuantizedX {
            x: 0x1000,
            rows: 2,
            k: 32,
            form: ROWS,
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
            form: X8Form {
                terms: 2,
                tiled: true,
            },
            codes: 2,
            pairs: 3,
        };
        f.note(q);
        assert_eq!(f.get(), Some(q));
        f.forget();
        assert_eq!(f.get(), None);
    }
}
