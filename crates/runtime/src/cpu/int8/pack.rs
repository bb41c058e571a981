//! Weights repacked for the int8 kernels: 16 output rows interleaved per 32-value block.
//!
//! A *panel* is 16 consecutive weight rows (the last one padded with zero rows). For each
//! block `g` of a panel the bytes are, in order:
//!
//! - codes, in chunks of 64 bytes: chunk `t`, row `r`, byte `b` sits at `64·t + 4·r + b`.
//!   Q4_0/Q4_1: 4 chunks; the low nibble is the code of value `4t + b`, the high nibble the
//!   code of value `16 + 4t + b` (codes 0..15, as stored). Q8_0: 8 chunks holding
//!   `code + 128` of value `4t + b` as an unsigned byte.
//! - the 16 rows' scales `d` (f16), and for Q4_1 the 16 minimums `m` (f16).
//!
//! So one 64-byte load gives, for 16 rows at once, the 4 consecutive codes that one 32-bit
//! lane of an int8 dot-product instruction multiplies with 4 activation codes. Values are
//! only moved, never re-rounded: the packed weight decodes to exactly the stored one.

use crate::cpu::huge::HugeBytes;
use crate::dtype::DType;
use crate::quant::GROUP;
use crate::weight::HostWeight;

/// Weight rows per panel.
pub const PANEL: usize = 16;

/// A weight format the int8 kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int8Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Int8Format {
    /// The packed format of a stored one, if the int8 kernels handle it.
    pub fn of(dtype: DType) -> Option<Int8Format> {
        match dtype {
            DType::Q4_0 => Some(Int8Format::Q4_0),
            DType::Q4_1 => Some(Int8Format::Q4_1),
            DType::Q8_0 => Some(Int8Format::Q8_0),
            _ => None,
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            Int8Format::Q4_0 => DType::Q4_0,
            Int8Format::Q4_1 => DType::Q4_1,
            Int8Format::Q8_0 => DType::Q8_0,
        }
    }

    /// Bytes of codes per block of a panel.
    pub const fn code_bytes(self) -> usize {
        match self {
            Int8Format::Q4_0 | Int8Format::Q4_1 => 256,
            Int8Format::Q8_0 => 512,
        }
    }

    /// Bytes of one block of a panel (codes, then scales, then Q4_1 minimums).
    pub const fn block_bytes(self) -> usize {
        match self {
            Int8Format::Q4_0 => 256 + 32,
            Int8Format::Q4_1 => 256 + 64,
            Int8Format::Q8_0 => 512 + 32,
        }
    }
}

/// A weight matrix in panel order (see the module docs).
pub struct PackedWeight {
    pub format: Int8Format,
    /// Output rows (`n`; the storage holds whole panels).
    pub rows: usize,
    /// Inner dimension (`k`).
    pub cols: usize,
    /// The panels, 64-byte aligned, on huge pages where the system allows.
    bytes: HugeBytes,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedWeight({:?}, {}x{})",
            self.format, self.rows, self.cols
        )
    }
}

impl PackedWeight {
    /// Repacks `w`, or `None` when its format or shape has no int8 kernel.
    pub fn pack(w: &HostWeight) -> Option<PackedWeight> {
        let format = Int8Format::of(w.dtype)?;
        if w.rows == 0 || !w.cols.is_multiple_of(GROUP) {
            return None;
        }
        let (kb, panels) = (w.cols / GROUP, w.rows.div_ceil(PANEL));
        let bb = format.block_bytes();
        let total = panels * kb * bb;
        let src_block = w.dtype.block_bytes();
        let bytes = HugeBytes::with(total, |out| {
            for r in 0..w.rows {
                let row = w.row(r);
                let (p, lane) = (r / PANEL, r % PANEL);
                for g in 0..kb {
                    let src = &row[g * src_block..(g + 1) * src_block];
                    let dst = &mut out[(p * kb + g) * bb..(p * kb + g + 1) * bb];
                    let cb = format.code_bytes();
                    match format {
                        Int8Format::Q4_0 | Int8Format::Q4_1 => {
                            let nib = if format == Int8Format::Q4_0 { 2 } else { 4 };
                            for t in 0..4 {
                                for b in 0..4 {
                                    // Stored byte j: value j (low) and j + 16 (high).
                                    let (lo, hi) =
                                        (src[nib + 4 * t + b] & 0x0F, src[nib + 4 * t + b] >> 4);
                                    dst[64 * t + 4 * lane + b] = lo | (hi << 4);
                                }
                            }
                            dst[cb + 2 * lane..cb + 2 * lane + 2].copy_from_slice(&src[0..2]);
                            if format == Int8Format::Q4_1 {
                                dst[cb + 32 + 2 * lane..cb + 32 + 2 * lane + 2]
                                    .copy_from_slice(&src[2..4]);
                            }
                        }
                        Int8Format::Q8_0 => {
                            for t in 0..8 {
                                for b in 0..4 {
                                    dst[64 * t + 4 * lane + b] = src[2 + 4 * t + b] ^ 0x80;
                                }
                            }
                            dst[cb + 2 * lane..cb + 2 * lane + 2].copy_from_slice(&src[0..2]);
                        }
                    }
                }
            }
        });
        Some(PackedWeight {
            format,
            rows: w.rows,
            cols: w.cols,
            bytes,
        })
    }

    /// Blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols / GROUP
    }

    /// Number of 16-row panels.
    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }

    /// Bytes of one panel (all its blocks).
    pub fn panel_bytes(&self) -> usize {
        self.blocks() * self.format.block_bytes()
    }

    /// Bytes the kernels stream per product (all panels).
    pub fn bytes_len(&self) -> usize {
        self.panels() * self.panel_bytes()
    }

    /// The first byte of panel `p`.
    pub fn panel_ptr(&self, p: usize) -> *const u8 {
        assert!(p < self.panels());
        // SAFETY: in bounds of the storage, checked above.
        unsafe { self.bytes.as_slice().as_ptr().add(p * self.panel_bytes()) }
    }
}
