//! The q/k/v products of an attention layer with RoPE and the KV write in their epilogue
//! (`EPI_ROPE` in kernels/matmul.cu): one launch where the plain path takes two
//! (`step_matmul_many`, then `rope_kv_write`), with the same bits. A decode step of the
//! default model is ~240 short dependent launches; this takes 30 of them away, and the cos/sin
//! and KV-slot lookups run before the kernel waits for the one before it.

use super::backend::{rope_style_code, CudaBackend, RopeEpi};
use super::device::Epilogue;
use super::kv::CudaKv;
use super::tensor::{CudaMeta, CudaTensor, CudaWeight};
use crate::backend::{Rope, RowSpan};
use crate::kv_type::KvType;

/// Rows of a rope-epilogue warp: one rotary pair.
const PAIR: usize = 2;

impl CudaBackend {
    /// Whether [`Self::qkv_rope_fused`] applies: the fusion is on (`DFLASH_CUDA_FUSE_ROPE`),
    /// no row of the step takes the tensor-core path (prompt pieces keep the separate
    /// launches), the three weights share a format, the rotary pairs cover whole heads
    /// (2 · half = head_dim), the outputs are whole heads of the KV width, and x has a row per
    /// token of the metadata.
    pub(super) fn qkv_rope_fusable(
        &self,
        x: &CudaTensor,
        ws: [&CudaWeight; 3],
        kv: &CudaKv,
        meta: &CudaMeta,
        rope: &Rope<'_, CudaTensor>,
        spans: &[RowSpan],
    ) -> bool {
        let [wq, wk, wv] = ws;
        let half = rope.inv_freq.len();
        self.device().fuse_rope
            && x.rows > 0
            && x.rows == meta.host.len()
            && half > 0
            && PAIR * half == rope.head_dim
            && ws.iter().all(|w| w.kernels() == wq.kernels())
            && wq.rows.is_multiple_of(rope.head_dim)
            && wk.rows == kv.kv_dim
            && wv.rows == kv.kv_dim
            && self
                .row_runs(x.rows, spans)
                .iter()
                .all(|(_, tensor)| !*tensor)
    }

    /// `step_qkv_rope_kv` as one launch (see the module docs); the caller checked
    /// [`Self::qkv_rope_fusable`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope_fused(
        &self,
        x: &CudaTensor,
        ws: [&CudaWeight; 3],
        outs: [&mut CudaTensor; 3],
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        rope: Rope<'_, CudaTensor>,
    ) {
        let half = rope.inv_freq.len();
        Self::check_rope_kv(ws[0].rows, kv, layer, meta, half, rope.head_dim);
        let [q, k, v] = outs;
        let prods = self.store_products(x, &ws, &mut [q, k, v]);
        let rope = RopeEpi {
            meta: self.meta_ptr(meta),
            inv_freq: self.tptr(rope.inv_freq),
            kv_rows: self.ptr(kv.table.as_ref().expect("rows reserved")),
            layer: layer as i32,
            head_dim: rope.head_dim as i32,
            half: half as i32,
            style: rope_style_code(rope.style),
            kv_dim: kv.kv_dim as i32,
            kv_half: i32::from(kv.ty == KvType::F16),
        };
        self.mm_core(
            self.tptr(x),
            x.rows,
            x.cols,
            &prods,
            Epilogue::Rope,
            0,
            rope,
        );
    }
}
