//! Which numeric path each projection of a model takes: the stored weight format, the
//! activation type and the kernel family (reported by `dflash bench` and in the stats).

use dflash_runtime::{Backend, WeightPath};

/// One projection's path. Per-layer projections are reported once (every layer of a model
/// has the same shapes and formats in the files we read; layer 0 stands for all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectionPath {
    /// `target` or `draft`.
    pub model: &'static str,
    /// `q`, `k`, `v`, `o`, `gate`, `up`, `down`, `fc` or `lm_head`.
    pub name: &'static str,
    /// Output rows (N) and inner dimension (K).
    pub rows: usize,
    pub cols: usize,
    pub path: WeightPath,
}

/// The path of `w` (`rows x cols`) on `b`.
pub(crate) fn path_of<B: Backend>(
    b: &B,
    model: &'static str,
    name: &'static str,
    w: &B::Weight,
    rows: usize,
    cols: usize,
) -> ProjectionPath {
    ProjectionPath {
        model,
        name,
        rows,
        cols,
        path: b.weight_path(w),
    }
}
