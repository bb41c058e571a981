//! [`TargetModel`]: any target architecture the loader builds, behind one type.

use dflash_runtime::Backend;

use crate::error::Result;
use crate::kv_usage::KvUsage;
use crate::llama::LlamaModel;
use crate::qwen35::Qwen35Model;
use crate::target::{RowStep, Target};

/// A loaded target: a Llama-family model or a Qwen 3.5 hybrid.
pub enum TargetModel<B: Backend> {
    Llama(LlamaModel<B>),
    Qwen35(Qwen35Model<B>),
}

macro_rules! each {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            TargetModel::Llama($m) => $e,
            TargetModel::Qwen35($m) => $e,
        }
    };
}

impl<B: Backend> TargetModel<B> {
    /// The architecture's name, for logs.
    pub fn arch(&self) -> &'static str {
        match self {
            TargetModel::Llama(_) => "llama",
            TargetModel::Qwen35(_) => "qwen35",
        }
    }

    /// The numeric path of each projection (see `paths`).
    pub fn matmul_paths(&self) -> Vec<crate::paths::ProjectionPath> {
        each!(self, m => m.matmul_paths())
    }
}

impl<B: Backend> Target for TargetModel<B> {
    type B = B;

    fn backend(&self) -> &B {
        each!(self, m => m.backend())
    }
    fn vocab(&self) -> usize {
        each!(self, m => m.vocab())
    }
    fn hidden(&self) -> usize {
        each!(self, m => m.hidden())
    }
    fn n_layers(&self) -> usize {
        each!(self, m => m.n_layers())
    }
    fn context_length(&self) -> usize {
        each!(self, m => m.context_length())
    }
    fn new_row(&mut self, capacity: usize) -> Result<usize> {
        each!(self, m => m.new_row(capacity))
    }
    fn release_row(&mut self, row: usize) {
        each!(self, m => m.release_row(row))
    }
    fn kv_usage(&self) -> KvUsage {
        each!(self, m => m.kv_usage())
    }
    fn prefill_granule(&self) -> usize {
        each!(self, m => m.prefill_granule())
    }
    fn row_len(&self, row: usize) -> usize {
        each!(self, m => m.row_len(row))
    }
    fn truncate_row(&mut self, row: usize, len: usize) -> Result<()> {
        each!(self, m => m.truncate_row(row, len))
    }
    fn fork_row(&mut self, src: usize, capacity: usize) -> Result<usize> {
        each!(self, m => m.fork_row(src, capacity))
    }
    fn set_tap_layers(&mut self, layers: &[usize]) -> Result<()> {
        each!(self, m => m.set_tap_layers(layers))
    }
    fn forward(&mut self, steps: &[RowStep<'_>]) -> Result<()> {
        each!(self, m => m.forward(steps))
    }
    fn logits(&self) -> &B::Tensor {
        each!(self, m => m.logits())
    }
    fn taps(&self) -> &B::Tensor {
        each!(self, m => m.taps())
    }
    fn embedding(&self) -> &B::Weight {
        each!(self, m => m.embedding())
    }
    fn lm_head(&self) -> &B::Weight {
        each!(self, m => m.lm_head())
    }
    fn lm_head_rows(&self, ids: &[u32]) -> Result<B::Weight> {
        each!(self, m => m.lm_head_rows(ids))
    }
    fn per_row_commit(&self) -> bool {
        each!(self, m => m.per_row_commit())
    }
}
