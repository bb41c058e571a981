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
