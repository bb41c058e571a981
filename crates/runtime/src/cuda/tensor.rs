//! Device-side tensors, weights and step metadata.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;

use crate::backend::TokenMeta;
use crate::dtype::DType;

/// An f32 `rows x cols` matrix on the GPU, row-major. The buffer may be larger than
/// `rows * cols` (its capacity), so that reshapes within it never reallocate.
pub struct CudaTensor {
    pub(crate) buf: CudaSlice<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl CudaTensor {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Elements the buffer can hold without reallocating.
    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn len(&self) -> usize {
        self.rows * self.cols
    }
}

/// A weight matrix in its stored format (the exact bytes of the host weight).
pub struct CudaWeight {
    pub name: String,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) buf: CudaSlice<u8>,
    /// Multiplied with int8-quantized activations (the `mmq_*` kernels), fixed at upload.
    pub(crate) int8: bool,
    /// Multiplied on TF32 tensor cores with x split in two terms (the `mmx2_*` kernels: the
    /// vocabulary projection of a packed format, `Device::float_mma`), fixed at upload.
    pub(crate) float_mma: bool,
}

impl CudaWeight {
    /// What picks this weight's CUDA-core kernels: its format and activation type. Products
    /// share a launch only when this is the same.
    pub(crate) fn kernels(&self) -> (DType, bool, bool) {
        (self.dtype, self.int8, self.float_mma)
    }
}

/// The token metadata of one step: a host copy (for bounds checks) and a device copy
/// (`[T][4]` u32: row, pos, kv_start, kv_end). The device buffer goes back to the backend's
/// pool when dropped, so a steady decode loop allocates nothing for it.
pub struct CudaMeta {
    pub(crate) host: Vec<TokenMeta>,
    pub(crate) buf: Option<CudaSlice<u32>>,
    pub(crate) pool: Arc<Mutex<Vec<CudaSlice<u32>>>>,
}

impl CudaMeta {
    pub fn tokens(&self) -> &[TokenMeta] {
        &self.host
    }
}

/// Buffers kept for reuse at most.
const META_POOL_MAX: usize = 32;

impl Drop for CudaMeta {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            if let Ok(mut pool) = self.pool.lock() {
                if pool.len() < META_POOL_MAX {
                    pool.push(b);
                }
            }
        }
    }
}

/// A model's step inputs on the device: one buffer of `[T][4]` metadata, `T` token ids and
/// `S` selected rows (in that order), written from a pinned host buffer with one copy per
/// step. Its device address only changes when a step needs more room than it has (the
/// backend's epoch is then bumped, so that graphs captured with the old address are rebuilt).
pub struct CudaStep {
    /// The metadata view of the buffer (its host copy is the last upload's).
    pub(crate) meta: CudaMeta,
    /// Host staging for the copy.
    pub(crate) pinned: Option<cudarc::driver::PinnedHostSlice<u32>>,
    /// Recorded after the last copy out of `pinned`: waited for before `pinned` is rewritten.
    pub(crate) copied: Option<cudarc::driver::CudaEvent>,
    /// Tokens and selected rows of the last upload.
    pub(crate) tokens: usize,
    pub(crate) sel: usize,
    /// u32 values the buffers hold.
    pub(crate) cap: usize,
}

impl CudaStep {
    /// Offset (in u32) of the token ids in the buffer.
    pub(crate) fn ids_offset(&self) -> usize {
        4 * self.tokens
    }

    /// Offset (in u32) of the selected rows in the buffer.
    pub(crate) fn sel_offset(&self) -> usize {
        5 * self.tokens
    }
}
