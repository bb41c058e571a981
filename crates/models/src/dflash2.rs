//! What DFlash2 adds to the DFlash drafter (reference `DFlash2DraftModel`): a grouped dynamic
//! causal convolution around both sublayers of every layer, and the candidate selector that
//! turns each block slot's logits into a lattice of candidates and path scores.
//!
//! Convolution (`GroupedDynamicCausalConv`): one projection of the normalised sublayer input
//! gives per-token coefficients for both sides, `[side][tap][group]`; side 0 convolves the
//! sublayer's input, side 1 its output (before the residual add), each with its own static
//! per-channel `base_kernel[side]`. Only block tokens are convolved, and only within their own
//! block (the context K/V never pass through it).

use dflash_runtime::backend::WeightRole;
use dflash_runtime::Backend;

use crate::drafter_config::{Dflash2Params, DrafterConfig};
use crate::error::{ModelError, Result};
use crate::llama::load_matrix;
use crate::selector::{top_k_indices, CandidateLattice};
use crate::source::TensorSource;

/// One sublayer's convolution.
pub(crate) struct Conv<B: Backend> {
    /// `[taps, hidden]` static taps of side 0 (input) and side 1 (output).
    base: [B::Tensor; 2],
    /// `[2 · taps · groups, hidden]`.
    proj: B::Weight,
    taps: usize,
    group: usize,
    groups: usize,
}

/// The two convolutions of a layer.
pub(crate) struct LayerConvs<B: Backend> {
    pub attn: Conv<B>,
    pub mlp: Conv<B>,
}

impl<B: Backend> Conv<B> {
    fn load(b: &B, src: &dyn TensorSource, prefix: &str, cfg: &DrafterConfig) -> Result<Self> {
        let p = cfg.dflash2.as_ref().expect("DFlash2 configuration");
        let (h, taps, group) = (cfg.hidden, p.conv_kernel_size, p.conv_group_size);
        let groups = h / group;
        let base_name = format!("{prefix}.base_kernel");
        if let Some(d) = src.dims(&base_name) {
            if d != [2, taps, h] {
                return Err(ModelError::TensorShape {
                    name: base_name,
                    expected: vec![2, taps, h],
                    found: d,
                });
            }
        }
        let base = src.weight(&base_name, Some([2 * taps, h]))?.to_f32();
        let half = taps * h;
        Ok(Self {
            base: [
                b.upload(&base[..half], taps, h),
                b.upload(&base[half..], taps, h),
            ],
            proj: load_matrix(
                b,
                src,
                &format!("{prefix}.kernel_projection.weight"),
                [2 * taps * groups, h],
                WeightRole::Draft,
            )?,
            taps,
            group,
            groups,
        })
    }

    /// Side 0: coefficients of both sides from `x` into `dynamic`, `out = conv(x)`.
    pub fn prepare(
        &self,
        b: &B,
        x: &B::Tensor,
        meta: &B::Meta,
        dynamic: &mut B::Tensor,
        out: &mut B::Tensor,
    ) {
        b.matmul(x, &self.proj, dynamic);
        b.grouped_conv(x, &self.base[0], dynamic, 0, self.group, meta, out);
    }

    /// Side 1 on the sublayer's output, with the coefficients `prepare` left in `dynamic`.
    pub fn finish(
        &self,
        b: &B,
        x: &B::Tensor,
        meta: &B::Meta,
        dynamic: &B::Tensor,
        out: &mut B::Tensor,
    ) {
        let col = self.taps * self.groups;
        b.grouped_conv(x, &self.base[1], dynamic, col, self.group, meta, out);
    }
}

impl<B: Backend> LayerConvs<B> {
    pub fn load(b: &B, src: &dyn TensorSource, layer: usize, cfg: &DrafterConfig) -> Result<Self> {
        Ok(Self {
            attn: Conv::load(b, src, &format!("layers.{layer}.attention_conv"), cfg)?,
            mlp: Conv::load(b, src, &format!("layers.{layer}.mlp_conv"), cfg)?,
        })
    }
}

/// The candidate selector's weights and host scratch.
pub(crate) struct Selector<B: Backend> {
    pred: B::Weight,
    succ: B::Weight,
    /// `[rank, hidden]`.
    pub hidden_proj: B::Weight,
    params: Dflash2Params,
    rank: usize,
    gathered: B::Tensor,
    transformed: Vec<f32>,
    order: Vec<u32>,
    cand: Vec<u32>,
    unary: Vec<f32>,
    pred_ids: Vec<u32>,
    pred_rows: Vec<f32>,
    succ_rows: Vec<f32>,
    hp: Vec<f32>,
    ctx: Vec<f32>,
}

/// The codebooks are stored without `.weight` in the published format; accept both.
fn codebook<B: Backend>(
    b: &B,
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<B::Weight> {
    let bare = format!("candidate_selector.{name}");
    let with_suffix = format!("{bare}.weight");
    let n = if src.has(&bare) || !src.has(&with_suffix) {
        bare
    } else {
        with_suffix
    };
    load_matrix(b, src, &n, [rows, cols], WeightRole::Draft)
}

impl<B: Backend> Selector<B> {
    pub fn load(b: &B, src: &dyn TensorSource, cfg: &DrafterConfig) -> Result<Self> {
        let p = *cfg.dflash2.as_ref().expect("DFlash2 configuration");
        let (v, r) = (p.vocab_size, p.selector_rank);
        Ok(Self {
            pred: codebook(b, src, "predecessor_codebook", v, r)?,
            succ: codebook(b, src, "successor_codebook", v, r)?,
            hidden_proj: load_matrix(
                b,
                src,
                "candidate_selector.hidden_projection.weight",
                [r, cfg.hidden],
                WeightRole::Draft,
            )?,
            params: p,
            rank: r,
            gathered: b.tensor(0, r),
            transformed: Vec::new(),
            order: Vec::new(),
            cand: Vec::new(),
            unary: Vec::new(),
            pred_ids: Vec::new(),
            pred_rows: Vec::new(),
            succ_rows: Vec::new(),
            hp: Vec::new(),
            ctx: Vec::new(),
        })
    }

    /// Builds the lattice of `anchors.len()` rows of proposals from the slots' raw logits
    /// (`[rows · slots, vocab]`) and projected hidden states (`hproj`, `[rows · slots, rank]`),
    /// both on the device. The candidates are the top-k of the transformed logits: ranked on
    /// the device ([`Backend::top_k_rows`]) where the transform is the identity (it then
    /// keeps the order), else, or where the backend declines, on the host after copying the
    /// logits into `host`.
    pub fn build(
        &mut self,
        b: &B,
        logits: &B::Tensor,
        host: &mut Vec<f32>,
        hproj: &B::Tensor,
        anchors: &[u32],
        out: &mut CandidateLattice,
    ) -> Result<()> {
        let (n, vocab) = b.shape(logits);
        let slots = n / anchors.len().max(1);
        let (k, r) = (self.params.selector_top_k, self.rank);
        if vocab > self.params.vocab_size || k > vocab {
            return Err(ModelError::IncompatibleDrafter(format!(
                "the target's vocabulary has {vocab} tokens; the drafter's selector covers {} \
                 with {k} candidates",
                self.params.vocab_size
            )));
        }
        if let Some(bad) = anchors
            .iter()
            .find(|&&a| a as usize >= self.params.vocab_size)
        {
            return Err(ModelError::Config(format!(
                "token {bad} is outside the drafter's selector vocabulary"
            )));
        }
        let rows = anchors.len();
        // Candidates: top-k of the transformed logits of every slot.
        self.cand.clear();
        self.unary.clear();
        let on_device = if self.params.transform_is_identity() && n == rows * slots {
            b.top_k_rows(logits, k)
        } else {
            None
        };
        if let Some((ids, vals)) = on_device {
            self.cand = ids;
            self.unary = vals;
        } else {
            b.copy_to_host(logits, host);
            for slot_logits in host.chunks_exact(vocab).take(rows * slots) {
                self.transformed.clear();
                self.transformed
                    .extend(slot_logits.iter().map(|&l| self.params.transform(l)));
                top_k_indices(&self.transformed, k, &mut self.order);
                self.cand.extend_from_slice(&self.order);
                self.unary
                    .extend(self.order.iter().map(|&i| self.transformed[i as usize]));
            }
        }
        // Predecessors: each row's anchor, then its candidates of every slot but the last.
        self.pred_ids.clear();
        for (row, &anchor) in anchors.iter().enumerate() {
            self.pred_ids.push(anchor);
            let c = &self.cand[row * slots * k..(row + 1) * slots * k];
            self.pred_ids.extend_from_slice(&c[..(slots - 1) * k]);
        }
        b.embed(&self.pred, &self.pred_ids, &mut self.gathered);
        b.copy_to_host(&self.gathered, &mut self.pred_rows);
        b.embed(&self.succ, &self.cand, &mut self.gathered);
        b.copy_to_host(&self.gathered, &mut self.succ_rows);
        b.copy_to_host(hproj, &mut self.hp);
        out.reset(k, slots);
        self.ctx.resize(r, 0.0);
        let per_row_pred = 1 + (slots - 1) * k;
        for row in 0..rows {
            let (ids, scores) = out.push_row_mut();
            ids.copy_from_slice(&self.cand[row * slots * k..(row + 1) * slots * k]);
            for slot in 0..slots {
                let at = row * slots + slot;
                let h = &self.hp[at * r..(at + 1) * r];
                let unary = &self.unary[at * k..(at + 1) * k];
                let succ = &self.succ_rows[at * k * r..(at + 1) * k * r];
                let n_prev = if slot == 0 { 1 } else { k };
                for prev in 0..n_prev {
                    let pi = row * per_row_pred
                        + if slot == 0 {
                            0
                        } else {
                            1 + (slot - 1) * k + prev
                        };
                    let p = &self.pred_rows[pi * r..(pi + 1) * r];
                    for ((c, &pv), &hv) in self.ctx.iter_mut().zip(p).zip(h) {
                        *c = pv * hv;
                    }
                    let dst = &mut scores[(slot * k + prev) * k..(slot * k + prev + 1) * k];
                    for (ci, d) in dst.iter_mut().enumerate() {
                        let s = &succ[ci * r..(ci + 1) * r];
                        let t: f32 = self.ctx.iter().zip(s).map(|(a, b)| a * b).sum();
                        *d = unary[ci] + t;
                    }
                }
            }
        }
        Ok(())
    }
}
