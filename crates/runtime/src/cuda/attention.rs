//! Softmax attention on the GPU (`kernels/attention.cu`): the split kernel over each token's
//! keys (flash-decoding), then the merge of its splits, either as a launch of its own or
//! inside the split kernel (the last split block of each token and KV head merges).
//!
//! The merge inside the split kernel gives the same bits and saves the merge's pass over
//! the partial states for prompt rows (on the H200: prefill of 512 tokens of the default
//! model's shapes 55.7k → 59.0–60.0k tok/s, Qwen3-4B's 128 tokens 3.50k → 3.99–4.00k), but
//! costs a decode step 6–8% (the last block's fence, count and reads of every split's state
//! lie on the step's critical path, where the merge launch overlaps its wait with the split
//! kernel through programmatic dependent launch), so it is taken from
//! [`FUSE_MERGE_MIN_ROWS`] tokens (`DFLASH_CUDA_FUSE_MERGE`). Launches of a few tokens take
//! the split kernel's variant with early loads (`ATT_EARLY_MAX_ROWS`). Every variant gives
//! the same bits.

use super::backend::CudaBackend;
use super::device::{
    ensure, rows_setting, ATT_GM, ATT_MAX_GHD, ATT_MAX_SPLITS, ATT_NARROW_WARPS, ATT_PER, ATT_SLOTS,
};
use super::kv::CudaKv;
use super::l2_ahead::L2Ahead;
use super::tensor::{CudaMeta, CudaTensor};
use crate::backend::{AttnShape, Backend};
use crate::quant::GROUP;

/// Fewest tokens of one attention launch that merge inside the split kernel by default: the
/// rows of a prompt (decode and verify blocks of up to 16 keep the merge launch).
pub const FUSE_MERGE_MIN_ROWS: usize = 17;

/// Most tokens of one attention launch that take the split kernel with early loads (its
/// first tile's keys and values requested before q is staged): on the H200 a decode step of
/// the default model's shapes 0.729–0.735 → 0.705–0.713 ms and a verify of 8 1.11–1.13 →
/// 1.08–1.10 ms, but a verify of 16 1.26–1.29 → 1.30–1.32 ms and prefill of 512 tokens 6%
/// slower (more registers, fewer blocks per SM once the grid passes a wave).
const ATT_EARLY_MAX_ROWS: usize = 8;

/// Most tokens of one attention launch whose split blocks prefetch their keys and values
/// into L2 before they wait for the kernel before (ATT_PREFETCH_MAX_TOKENS in attention.cu):
/// decode and verify blocks; a prompt's blocks share most of their rows, and prefill lost
/// 3-5% with the prefetch on the H200.
pub(crate) const ATT_PREFETCH_MAX_TOKENS: usize = 16;

/// Most tokens of one attention launch whose split blocks get a warp per slot (ATT_SLOTS
/// warps) by default: a decode step's blocks then have every tile of their split in flight at
/// once (on an H100, default model's shapes: decode at depth 4,000 +17%, its step 1.42x →
/// 1.19x the step at depth 128; a verify of 4 −2.5% up to depth 512, +7.5% at 4,000); larger
/// launches fill the SMs with [`ATT_NARROW_WARPS`] warps a block (two slots each), and more of
/// them fit an SM (a verify of 16 with a warp per slot: −7% at depth 4,000, +17% at 512).
/// docs/benchmarks/2026-12-05-h100-h200-attention-slots.md.
pub const ATT_WIDE_MAX_ROWS: usize = 4;

/// `DFLASH_CUDA_ATT_WIDE`: `auto` (or unset, empty) [`ATT_WIDE_MAX_ROWS`], `0` / `off` never,
/// or the most tokens.
pub fn att_wide_max_rows(v: Option<&str>) -> Result<usize, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(ATT_WIDE_MAX_ROWS),
        Some("off") => Ok(0),
        Some(s) => s.parse::<usize>().map_err(|_| {
            format!("DFLASH_CUDA_ATT_WIDE={s:?}: expected auto, 0 or the most tokens (1, 2, ...)")
        }),
    }
}

/// `DFLASH_CUDA_FUSE_MERGE`: `auto` (or unset, empty) [`FUSE_MERGE_MIN_ROWS`], `0` / `off`
/// never, or the fewest tokens.
pub fn fuse_merge_min_rows(v: Option<&str>) -> Result<usize, String> {
    rows_setting("DFLASH_CUDA_FUSE_MERGE", v, FUSE_MERGE_MIN_ROWS)
}

/// `AttParams` in attention.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct AttParams {
    q: u64,
    meta: u64,
    rows: u64,
    part: u64,
    out: u64,
    layer: i32,
    t: i32,
    n_heads: i32,
    n_kv_heads: i32,
    head_dim: i32,
    kv_dim: i32,
    scale: f32,
    /// The form word of the int8 copy of out (cuda/int8_x.rs `X8Form`), or 0 with none.
    form: i32,
    /// The merge's int8 copy of out (codes, pairs), or zeros.
    qc: u64,
    qs: u64,
    /// Arrival counts per (token, KV head) when the split kernel merges by itself, else 0.
    count: u64,
    /// Weights of the products after this attention, requested into L2 by the split kernel.
    ahead: L2Ahead,
}

impl CudaBackend {
    /// [`Backend::attention`] (checked; see the module docs).
    pub(super) fn cuda_attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        meta: &CudaMeta,
        shape: AttnShape,
        out: &mut CudaTensor,
    ) {
        let dev = self.device();
        // Taken whatever happens below, so a hint never outlives the attention it was named for.
        let ahead = dev.ahead.take(dev.l2_ahead);
        let AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale,
        } = shape;
        assert_eq!(q.cols, n_heads * head_dim);
        assert_eq!(q.rows, meta.host.len());
        assert!(n_kv_heads > 0 && n_heads % n_kv_heads == 0);
        assert!(
            n_kv_heads * head_dim <= kv.kv_dim,
            "attention: KV heads exceed the cache's width"
        );
        let group = n_heads / n_kv_heads;
        let per = ATT_PER.iter().position(|&p| 32 * p >= head_dim);
        let gm = ATT_GM.iter().position(|&g| g == group);
        let (Some(pi), Some(gi)) = (per, gm) else {
            panic!(
                "attention: head_dim {head_dim} with {group} query heads per KV head is not \
                 supported (head_dim <= 256, group <= 8, group x head_dim <= {ATT_MAX_GHD})"
            )
        };
        let fs = dev.k.attention_split[pi][gi].as_ref().unwrap_or_else(|| {
            panic!(
                "attention: {group} query heads per KV head of dimension {head_dim} exceed \
                 {ATT_MAX_GHD} values per block"
            )
        });
        assert!(layer < kv.layers, "KV layer {layer} out of range");
        assert_eq!(
            kv.ty, dev.kv_type,
            "attention: a {} KV cache on a device whose attention kernels read {}",
            kv.ty, dev.kv_type
        );
        for m in &meta.host {
            assert!(
                (m.row as usize) < kv.rows.len(),
                "KV row {} was never reserved",
                m.row
            );
            let cap = kv.capacity(m.row as usize);
            assert!(
                m.kv_end as usize <= cap || m.kv_start >= m.kv_end,
                "attention reads positions up to {} of row {}, which holds {cap}",
                m.kv_end,
                m.row
            );
        }
        self.reshape(out, q.rows, q.cols);
        let t = q.rows;
        if t == 0 || n_heads == 0 || head_dim == 0 {
            return;
        }
        dev.bind();
        let fuse = t >= dev.fuse_merge_min_rows;
        let (part, count) = {
            let mut s = dev.scratch.lock().expect("scratch lock");
            let part = ensure(
                &dev.stream,
                &dev.epoch,
                &mut s.att_part,
                t * n_heads * ATT_MAX_SPLITS * (head_dim + 2),
            );
            // Zeroed at allocation; the kernel leaves every count at zero again.
            let count = if fuse {
                ensure(&dev.stream, &dev.epoch, &mut s.att_count, t * n_kv_heads)
            } else {
                0
            };
            (part, count)
        };
        // The merge also writes the int8 copy of out for an int8 output projection (whole
        // blocks of 32 values within each head).
        let k = n_heads * head_dim;
        let out_ptr = self.tptr(out);
        let copy = head_dim
            .is_multiple_of(GROUP)
            .then(|| self.int8_copy_for(out_ptr, t, k))
            .flatten();
        let (qc, qs, form) = copy.map_or((0, 0, 0), |q| (q.codes, q.pairs, q.form.word()));
        let p = AttParams {
            q: self.tptr(q),
            meta: self.meta_ptr(meta),
            rows: self.ptr(kv.table.as_ref().expect("rows reserved")),
            part,
            out: out_ptr,
            layer: layer as i32,
            t: t as i32,
            n_heads: n_heads as i32,
            n_kv_heads: n_kv_heads as i32,
            head_dim: head_dim as i32,
            kv_dim: kv.kv_dim as i32,
            scale,
            form,
            qc,
            qs,
            count,
            ahead,
        };
        let warps = if t <= dev.att_wide_max_rows {
            ATT_SLOTS
        } else {
            ATT_NARROW_WARPS
        };
        // Splits past a token's key count leave at once; the grid does not depend on the
        // context length, so a captured step stays valid as the context grows. From
        // `fuse_merge_min_rows` tokens, the last split block of each (token, KV head) merges.
        dev.launch_with(
            &fs[usize::from(t <= ATT_EARLY_MAX_ROWS)],
            "attention",
            (t as u32, n_kv_heads as u32, ATT_MAX_SPLITS as u32),
            (32 * warps as u32, 1, 1),
            &p,
        );
        if !fuse {
            let merge = match copy {
                Some(_) => &dev.k.attention_merge_q8,
                None => &dev.k.attention_merge,
            };
            dev.launch_with(
                merge,
                "attention merge",
                (t as u32, n_heads as u32, 1),
                (head_dim.next_multiple_of(32) as u32, 1, 1),
                &p,
            );
        }
        if let Some(q) = copy {
            dev.fresh_x.note(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuse_merge_setting_parses() {
        assert_eq!(fuse_merge_min_rows(None), Ok(FUSE_MERGE_MIN_ROWS));
        assert_eq!(fuse_merge_min_rows(Some(" auto ")), Ok(FUSE_MERGE_MIN_ROWS));
        assert_eq!(fuse_merge_min_rows(Some("0")), Ok(usize::MAX));
        assert_eq!(fuse_merge_min_rows(Some("off")), Ok(usize::MAX));
        assert_eq!(fuse_merge_min_rows(Some("1")), Ok(1));
        assert!(fuse_merge_min_rows(Some("yes"))
            .unwrap_err()
            .contains("DFLASH_CUDA_FUSE_MERGE"));
    }

    #[test]
    fn wide_setting_parses() {
        assert_eq!(att_wide_max_rows(None), Ok(ATT_WIDE_MAX_ROWS));
        assert_eq!(att_wide_max_rows(Some("auto")), Ok(ATT_WIDE_MAX_ROWS));
        assert_eq!(att_wide_max_rows(Some(" 0 ")), Ok(0));
        assert_eq!(att_wide_max_rows(Some("off")), Ok(0));
        assert_eq!(att_wide_max_rows(Some("4")), Ok(4));
        assert!(att_wide_max_rows(Some("-1"))
            .unwrap_err()
            .contains("DFLASH_CUDA_ATT_WIDE"));
    }
}
