//! Where weights come from: a GGUF file or a Hugging Face directory of safetensors.
//!
//! Both expose tensors as [`HostWeight`]s that stay views of the memory-mapped files.

pub mod gguf;
pub mod gguf_writer;
pub mod safetensors_dir;

use dflash_runtime::HostWeight;

use crate::error::Result;

/// A set of named tensors.
pub trait TensorSource {
    /// Tensor `name` as `[rows, cols]`, checked against `expect` when given.
    fn weight(&self, name: &str, expect: Option<[usize; 2]>) -> Result<HostWeight>;
    fn has(&self, name: &str) -> bool;
    /// The stored shape of `name` when the source keeps more than two dimensions (a
    /// tensor of rank 3 or more is read as `[product of leading dims, last dim]`).
    fn dims(&self, _name: &str) -> Option<Vec<usize>> {
        None
    }
}

impl TensorSource for gguf::GgufFile {
    fn weight(&self, name: &str, expect: Option<[usize; 2]>) -> Result<HostWeight> {
        gguf::GgufFile::weight(self, name, expect)
    }
    fn has(&self, name: &str) -> bool {
        self.has_tensor(name)
    }
}
