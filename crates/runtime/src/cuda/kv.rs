//! The KV cache on the GPU: per row, one allocation for all layers; a device table of rows.
//!
//! Row r's storage is `2 * layers * cap_r * kv_dim` values of the cache's type ([`KvType`]:
//! f32, or f16 rounded once when written and widened when read): layer l's keys start at
//! `(2l) * cap_r * kv_dim`, its values at `(2l + 1) * cap_r * kv_dim`, position-major, so a
//! row's valid prefix is always contiguous and truncation is a length change in the model.
//! The kernels find a row through a device table of `RowDesc {base, cap}` (two u64 per row,
//! `RowDesc` in kernels/common.cu), updated whenever a row is allocated, grown or released.
//! Growing a row reallocates it and copies the kept positions of every layer in one launch.

use cudarc::driver::CudaSlice;

use crate::kv_type::KvType;

/// The KV cache of one model.
pub struct CudaKv {
    pub(crate) layers: usize,
    pub(crate) kv_dim: usize,
    /// How values are held.
    pub(crate) ty: KvType,
    /// Storage of each row (None: never reserved or released), in u16 words (two a value for
    /// f32, one for f16).
    pub(crate) rows: Vec<Option<CudaSlice<u16>>>,
    /// Positions each row can hold.
    pub(crate) caps: Vec<usize>,
    /// Host mirror of the device table: (base address, capacity) per row.
    pub(crate) table_host: Vec<u64>,
    /// The device table (at least `2 * rows.len()` u64).
    pub(crate) table: Option<CudaSlice<u64>>,
}

impl CudaKv {
    pub(crate) fn new(layers: usize, kv_dim: usize, ty: KvType) -> Self {
        Self {
            layers,
            kv_dim,
            ty,
            rows: Vec::new(),
            caps: Vec::new(),
            table_host: Vec::new(),
            table: None,
        }
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    /// Positions row `row` can hold (0 for a row never reserved).
    pub fn capacity(&self, row: usize) -> usize {
        self.caps.get(row).copied().unwrap_or(0)
    }

    /// How values are held.
    pub fn kv_type(&self) -> KvType {
        self.ty
    }

    /// u16 words of one layer's K (or V) block of a row of `cap` positions.
    pub(crate) fn part_words(&self, cap: usize) -> usize {
        cap * self.kv_dim * self.ty.bytes() / 2
    }

    pub(crate) fn ensure_row(&mut self, row: usize) {
        if self.rows.len() <= row {
            self.rows.resize_with(row + 1, || None);
            self.caps.resize(row + 1, 0);
            self.table_host.resize(2 * (row + 1), 0);
        }
    }
}
