//! RoPE of q and k with the KV write of k and v in one launch (`rope_kv_f32`, ops.cu), and the
//! same with the per-head q/k norms of Qwen3-style layers in front (`qk_norm_rope_kv_f32`):
//! one launch where the separate ops take three (two `rms_norm`, then `rope_kv`), with the
//! same bits. A Qwen3-4B-shaped decode step has 36 attention layers, so this takes 72 short
//! dependent launches away (and as many from every draft step of a DFlash drafter).

use super::backend::{rope_style_code, CudaBackend};
use super::kv::CudaKv;
use super::tensor::{CudaMeta, CudaTensor};
use crate::backend::{QkNorm, Rope};
use crate::kv_type::KvType;

/// Warps per block of `qk_norm_rope_kv_f32` (QKN_WARPS in ops.cu): a warp per head.
pub(super) const QKN_WARPS: usize = 4;
/// Largest head size of `qk_norm_rope_kv_f32` (QKN_MAX_DIM in ops.cu: 8 values per lane).
pub(super) const QKN_MAX_DIM: usize = 256;

/// `RopeKvParams` in ops.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct RopeKvParams {
    q: u64,
    k: u64,
    v: u64,
    meta: u64,
    inv_freq: u64,
    rows: u64,
    q_norm: u64,
    k_norm: u64,
    t: i32,
    q_cols: i32,
    kv_dim: i32,
    head_dim: i32,
    half: i32,
    style: i32,
    layer: i32,
    eps: f32,
    /// The KV cache holds f16 (1) or f32 (0).
    kv_half: i32,
    pad: i32,
}

/// The per-head norms `qk_norm_rope_kv_f32` applies before RoPE: q's (none for a keys-only
/// write, whose q has no columns), k's, and their epsilon.
#[derive(Clone, Copy)]
pub(super) struct HeadNorms<'a> {
    pub q: Option<&'a CudaTensor>,
    pub k: &'a CudaTensor,
    pub eps: f32,
}

impl<'a> From<QkNorm<'a, CudaTensor>> for HeadNorms<'a> {
    fn from(n: QkNorm<'a, CudaTensor>) -> Self {
        Self {
            q: Some(n.q),
            k: n.k,
            eps: n.eps,
        }
    }
}

impl CudaBackend {
    /// Whether `qk_norm_rope_kv_f32` takes these norms: one weight of `head_dim` values each,
    /// and a head size the kernel holds (a multiple of 32 up to 256).
    pub(super) fn qk_norm_fusable(norm: HeadNorms<'_>, rope: &Rope<'_, CudaTensor>) -> bool {
        let hd = rope.head_dim;
        hd.is_multiple_of(32)
            && hd <= QKN_MAX_DIM
            && norm.q.is_none_or(|q| q.len() == hd)
            && norm.k.len() == hd
    }

    /// Launches `rope_kv_f32`, or `qk_norm_rope_kv_f32` when `norm` is given (the caller
    /// checked [`Self::qk_norm_fusable`]); without `q` (only with `norm`), the keys alone.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rope_kv_launch(
        &self,
        q: Option<&mut CudaTensor>,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        norm: Option<HeadNorms<'_>>,
        rope: Rope<'_, CudaTensor>,
    ) {
        let t = meta.host.len();
        let half = rope.inv_freq.len();
        let dim = kv.kv_dim;
        let head_dim = rope.head_dim;
        let (q_ptr, q_cols) = match &q {
            Some(q) => {
                assert_eq!(q.rows, t);
                (self.tptr(q), q.cols)
            }
            None => {
                assert!(norm.is_some(), "a keys-only write needs the fused kernel");
                (0, 0)
            }
        };
        assert!(k.rows >= t && v.rows >= t);
        assert_eq!(k.cols, dim);
        assert_eq!(v.cols, dim);
        Self::check_rope_kv(q_cols, kv, layer, meta, half, head_dim);
        if t == 0 {
            return;
        }
        self.device().bind();
        let p = RopeKvParams {
            q: q_ptr,
            k: self.tptr(k),
            v: self.tptr(v),
            meta: self.meta_ptr(meta),
            inv_freq: self.tptr(rope.inv_freq),
            rows: self.ptr(kv.table.as_ref().expect("rows reserved")),
            q_norm: norm.and_then(|n| n.q).map_or(0, |q| self.tptr(q)),
            k_norm: norm.map_or(0, |n| self.tptr(n.k)),
            t: t as i32,
            q_cols: q_cols as i32,
            kv_dim: dim as i32,
            head_dim: head_dim as i32,
            half: half as i32,
            style: rope_style_code(rope.style),
            layer: layer as i32,
            eps: norm.map_or(0.0, |n| n.eps),
            kv_half: i32::from(kv.ty == KvType::F16),
            pad: 0,
        };
        let k = &self.device().k;
        match norm {
            None => {
                self.device()
                    .launch_with(&k.rope_kv, "rope_kv", (t as u32, 1, 1), (128, 1, 1), &p)
            }
            Some(_) => {
                let heads = (q_cols + dim) / head_dim;
                self.device().launch_with(
                    &k.qk_norm_rope_kv,
                    "qk_norm_rope_kv",
                    (t as u32, heads.div_ceil(QKN_WARPS) as u32, 1),
                    ((QKN_WARPS * 32) as u32, 1, 1),
                    &p,
                );
            }
        }
    }
}
