//! The DFlash and DFlash2 drafters (published z-lab formats): Qwen3-style layers whose keys
//! and values are extended with the fused target features of every committed token, drafting
//! a whole block in one forward pass. A DFlash2 drafter (`config.kind()`) adds the grouped
//! dynamic convolutions around every sublayer and the candidate selector (`dflash2.rs`), and
//! may window its layers' attention; its draft leaves a [`CandidateLattice`] next to the
//! logits.

use std::path::Path;
use std::sync::Arc;

use dflash_runtime::backend::{
    AttnShape, GraphKey, QkNorm, Rope, RopeStyle, TokenMeta, WeightRole,
};
use dflash_runtime::{Backend, DType};

use crate::config::rope_inv_freq;
use crate::dflash2::{LayerConvs, Selector};
use crate::drafter::Drafter;
pub use crate::drafter_config::{
    build_target_layer_ids, Dflash2Params, DrafterConfig, DrafterKind, LayerAttention,
};
use crate::error::{ModelError, Result};
use crate::kv_usage::KvUsage;
use crate::llama::{load_matrix, load_vector};
use crate::paths::{path_of, ProjectionPath};
use crate::rows::RowTable;
use crate::selector::CandidateLattice;
use crate::source::safetensors_dir::SafetensorsDir;
use crate::source::TensorSource;

struct DraftLayer<B: Backend> {
    input_norm: B::Tensor,
    post_norm: B::Tensor,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    wo: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
    conv: Option<LayerConvs<B>>,
}

struct Workspace<B: Backend> {
    feat: B::Tensor,
    ctx: B::Tensor,
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    att: B::Tensor,
    o: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    sel: B::Tensor,
    logits: B::Tensor,
    /// DFlash2: convolution coefficients and output, projected hidden states.
    dynamic: B::Tensor,
    conv: B::Tensor,
    hproj: B::Tensor,
    /// The context's keys and values: k then v of each layer.
    ctx_kv: Vec<B::Tensor>,
}

/// A DFlash or DFlash2 drafter on backend `B`.
pub struct DflashDrafter<B: Backend> {
    backend: Arc<B>,
    pub cfg: DrafterConfig,
    fc: B::Weight,
    hidden_norm: B::Tensor,
    norm: B::Tensor,
    layers: Vec<DraftLayer<B>>,
    inv_freq: B::Tensor,
    kv: B::Kv,
    rows: RowTable,
    ws: Workspace<B>,
    ids: Vec<u32>,
    meta: Vec<TokenMeta>,
    sel_rows: Vec<u32>,
    /// Step inputs of `extend` and `draft` (each keeps its own device buffer).
    ctx_step: B::Step,
    draft_step: B::Step,
    /// Step inputs of the drafting layers' other attention patterns (DFlash2 windows and
    /// causality): `patterns[i + 1]`'s token metadata, at fixed device addresses.
    pattern_steps: Vec<B::Step>,
    /// Names of this drafter's captured graphs (context extension, drafting).
    graph_owner: [u64; 2],
    /// Distinct layer attention patterns and, per layer, which one it uses.
    patterns: Vec<LayerAttention>,
    layer_pattern: Vec<usize>,
    selector: Option<Selector<B>>,
    /// Drafts read only each slot's largest logit (`Drafter::set_argmax_only`).
    argmax_only: bool,
    lattice: CandidateLattice,
    host_logits: Vec<f32>,
    anchors: Vec<u32>,
    /// A vocabulary shortlist: its target ids and the head made of their rows.
    shortlist: Option<(Vec<u32>, B::Weight)>,
    /// Deferred context (`Drafter::extend_deferred`): the placed tokens whose keys and values
    /// are not written yet, and their features in rows `0..pending.len()` of `pending_feat`
    /// (`[PENDING_MAX, layers x hidden]` once used).
    pending: Vec<TokenMeta>,
    pending_feat: B::Tensor,
}

/// Where [`DflashDrafter::write_context`] reads the features.
enum Features<'a, B: Backend> {
    /// Rows of the target's taps.
    Taps(&'a B::Tensor),
    /// Rows of the deferred features.
    Pending,
}

/// Most deferred context tokens held at once; more are written first (a prompt chunk larger
/// than this is written at once).
const PENDING_MAX: usize = 1024;

/// Longest context extension replayed from a captured graph (a round commits at most a
/// block per row); longer ones (prompt chunks) run eagerly.
const GRAPH_MAX_TOKENS: usize = 256;

/// Finds a tensor under its published name, or the aliases some exports use.
fn resolve(src: &dyn TensorSource, name: &str) -> String {
    let aliases: &[&str] = match name {
        "fc.weight" => &["encoder.fc.weight", "model.fc.weight"],
        "hidden_norm.weight" => &["encoder.output_norm_enc.weight", "model.hidden_norm.weight"],
        _ => &[],
    };
    if src.has(name) {
        return name.to_string();
    }
    let prefixed = format!("model.{name}");
    aliases
        .iter()
        .map(|a| a.to_string())
        .chain(std::iter::once(prefixed))
        .find(|a| src.has(a))
        .unwrap_or_else(|| name.to_string())
}

impl<B: Backend> DflashDrafter<B> {
    /// The numeric path of each of the drafter's own projections (layer 0 stands for every
    /// layer; the vocabulary projection is the target's, reported with the target).
    pub fn matmul_paths(&self) -> Vec<ProjectionPath> {
        let b = &*self.backend;
        let c = &self.cfg;
        let (h, qd, kvd, ff) = (
            c.hidden,
            c.heads * c.head_dim,
            c.kv_heads * c.head_dim,
            c.intermediate,
        );
        let taps = c.target_layer_ids.len();
        let mut v = vec![path_of(b, "draft", "fc", &self.fc, h, taps * h)];
        if let Some(l) = self.layers.first() {
            for (name, w, rows, cols) in [
                ("q", &l.wq, qd, h),
                ("k", &l.wk, kvd, h),
                ("v", &l.wv, kvd, h),
                ("o", &l.wo, h, qd),
                ("gate", &l.w_gate, ff, h),
                ("up", &l.w_up, ff, h),
                ("down", &l.w_down, h, ff),
            ] {
                v.push(path_of(b, "draft", name, w, rows, cols));
            }
        }
        v
    }

    /// Loads a drafter directory (`config.json` + safetensors).
    pub fn open(backend: Arc<B>, dir: &Path) -> Result<Self> {
        Self::open_as(backend, dir, None)
    }

    /// [`Self::open`] with the layers' projection weights re-encoded as `weights` at load
    /// (e.g. Q8_0: about half the bytes of bf16 per draft step; the drafts may differ
    /// slightly, the output never does: the target verifies every draft).
    pub fn open_as(backend: Arc<B>, dir: &Path, weights: Option<DType>) -> Result<Self> {
        let cfg = DrafterConfig::read(dir)?;
        let src = SafetensorsDir::open(dir)?;
        Self::load_as(backend, cfg, &src, weights)
    }

    /// Builds the drafter from tensors in `src`.
    pub fn load(backend: Arc<B>, cfg: DrafterConfig, src: &dyn TensorSource) -> Result<Self> {
        Self::load_as(backend, cfg, src, None)
    }

    /// [`Self::load`] with the projection weights re-encoded as `weights` (see
    /// [`Self::open_as`]).
    pub fn load_as(
        backend: Arc<B>,
        cfg: DrafterConfig,
        src: &dyn TensorSource,
        weights: Option<DType>,
    ) -> Result<Self> {
        cfg.validate()?;
        let b = &*backend;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let (qd, kvd) = (cfg.heads * hd, cfg.kv_heads * hd);
        let taps = cfg.target_layer_ids.len();
        let w = |n: &str, r: usize, c: usize| -> Result<B::Weight> {
            let Some(dtype) = weights else {
                return load_matrix(b, src, &resolve(src, n), [r, c], WeightRole::Draft);
            };
            let stored = src.weight(&resolve(src, n), Some([r, c]))?;
            let w = stored.requantized(dtype).ok_or_else(|| {
                ModelError::Config(format!(
                    "drafter weight {n} ({r} x {c}) cannot be stored as {dtype}"
                ))
            })?;
            Ok(b.upload_weight(&w, WeightRole::Draft)?)
        };
        let vec = |n: &str, len: usize| load_vector(b, src, &resolve(src, n), len);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            layers.push(DraftLayer {
                input_norm: vec(&n("input_layernorm.weight"), h)?,
                post_norm: vec(&n("post_attention_layernorm.weight"), h)?,
                wq: w(&n("self_attn.q_proj.weight"), qd, h)?,
                wk: w(&n("self_attn.k_proj.weight"), kvd, h)?,
                wv: w(&n("self_attn.v_proj.weight"), kvd, h)?,
                wo: w(&n("self_attn.o_proj.weight"), h, qd)?,
                q_norm: vec(&n("self_attn.q_norm.weight"), hd)?,
                k_norm: vec(&n("self_attn.k_norm.weight"), hd)?,
                w_gate: w(&n("mlp.gate_proj.weight"), cfg.intermediate, h)?,
                w_up: w(&n("mlp.up_proj.weight"), cfg.intermediate, h)?,
                w_down: w(&n("mlp.down_proj.weight"), h, cfg.intermediate)?,
                conv: match cfg.dflash2 {
                    Some(_) => Some(LayerConvs::load(b, src, i, &cfg)?),
                    None => None,
                },
            });
        }
        let inv = rope_inv_freq(cfg.rope_theta, hd, None);
        let ws = Workspace {
            feat: b.tensor(0, taps * h),
            ctx: b.tensor(0, h),
            x: b.tensor(0, h),
            h: b.tensor(0, h),
            q: b.tensor(0, qd),
            k: b.tensor(0, kvd),
            v: b.tensor(0, kvd),
            att: b.tensor(0, qd),
            o: b.tensor(0, h),
            gate: b.tensor(0, cfg.intermediate),
            up: b.tensor(0, cfg.intermediate),
            sel: b.tensor(0, h),
            logits: b.tensor(0, 0),
            dynamic: b.tensor(0, 0),
            conv: b.tensor(0, h),
            hproj: b.tensor(0, 0),
            ctx_kv: (0..2 * cfg.layers).map(|_| b.tensor(0, kvd)).collect(),
        };
        let selector = match cfg.dflash2 {
            Some(_) => Some(Selector::load(b, src, &cfg)?),
            None => None,
        };
        let mut patterns: Vec<LayerAttention> = Vec::new();
        let layer_pattern = cfg
            .attention
            .iter()
            .map(|a| match patterns.iter().position(|p| p == a) {
                Some(i) => i,
                None => {
                    patterns.push(*a);
                    patterns.len() - 1
                }
            })
            .collect();
        Ok(Self {
            fc: w("fc.weight", h, taps * h)?,
            hidden_norm: vec("hidden_norm.weight", h)?,
            norm: vec("norm.weight", h)?,
            layers,
            inv_freq: b.upload(&inv, 1, inv.len()),
            kv: b.kv_new(cfg.layers, cfg.kv_heads, hd),
            rows: RowTable::default(),
            ws,
            ids: Vec::new(),
            meta: Vec::new(),
            sel_rows: Vec::new(),
            ctx_step: b.step_new(),
            draft_step: b.step_new(),
            pattern_steps: (1..patterns.len()).map(|_| b.step_new()).collect(),
            graph_owner: [b.graph_owner(), b.graph_owner()],
            patterns,
            layer_pattern,
            selector,
            argmax_only: false,
            lattice: CandidateLattice::default(),
            host_logits: Vec::new(),
            anchors: Vec::new(),
            shortlist: None,
            pending: Vec::new(),
            pending_feat: b.tensor(0, 0),
            backend,
            cfg,
        })
    }

    /// Drafts over the shortlist `ids` only, with `head` (rows `ids` of the target's head,
    /// from [`crate::Target::lm_head_rows`]) in place of the target's head. DFlash2 drafters
    /// keep the full head: their selector reads the whole vocabulary's logits.
    pub fn set_vocab_shortlist(&mut self, ids: Vec<u32>, head: B::Weight) -> Result<()> {
        if self.selector.is_some() {
            return Err(ModelError::Config(
                "a vocabulary shortlist applies to DFlash drafters; a DFlash2 drafter's \
                 selector reads the full vocabulary"
                    .into(),
            ));
        }
        if ids.is_empty() {
            return Err(ModelError::Config("the draft vocabulary is empty".into()));
        }
        // The logits change width: the next draft shapes them anew.
        self.ws.logits = self.backend.tensor(0, 0);
        self.shortlist = Some((ids, head));
        Ok(())
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            n_heads: self.cfg.heads,
            n_kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
        }
    }

    /// Gives the next `count` context positions of each `(row, count)` to its tokens (their
    /// metadata in `self.meta`, in order), counts them in the rows' lengths and makes room for
    /// them; `features` is how many feature rows came with them.
    fn place(&mut self, rows: &[(usize, usize)], features: usize) -> Result<()> {
        let total: usize = rows.iter().map(|r| r.1).sum();
        if total != features {
            return Err(ModelError::Config(format!(
                "drafter context: {total} positions but {features} feature rows"
            )));
        }
        self.meta.clear();
        for &(row, n) in rows {
            let start = self.rows.len_of(row)?;
            self.ensure_capacity(row, start + n + self.cfg.block_size);
            self.meta
                .extend((0..n).map(|i| TokenMeta::causal(row as u32, (start + i) as u32)));
        }
        // Only once every row is known to be open.
        for &(row, n) in rows {
            let len = self.rows.len(row) + n;
            self.rows.set_len(row, len);
        }
        Ok(())
    }

    /// Writes the context keys and values of the tokens `meta` (positions already placed)
    /// from feature rows `tap_rows` of `features` (`[tokens, layers x hidden]`).
    fn write_context(&mut self, meta: &[TokenMeta], features: Features<'_, B>, tap_rows: &[u32]) {
        let total = meta.len();
        if total == 0 {
            return;
        }
        let taps = match features {
            Features::Taps(t) => t,
            Features::Pending => &self.pending_feat,
        };
        let backend = self.backend.clone();
        let b = &*backend;
        let ids = vec![0u32; total];
        b.step_upload(&mut self.ctx_step, meta, &ids, tap_rows);
        let eps = self.cfg.rms_eps;
        let (h, kvd) = (self.cfg.hidden, self.cfg.kv_heads * self.cfg.head_dim);
        let taps_width = self.cfg.target_layer_ids.len() * h;
        let key = GraphKey {
            owner: self.graph_owner[0],
            tokens: total,
            rows: 0,
            variant: taps as *const B::Tensor as usize as u64,
        };
        b.run(|| {
            let ws = &mut self.ws;
            b.reshape(&mut ws.feat, total, taps_width);
            b.reshape(&mut ws.ctx, total, h);
            for t in &mut ws.ctx_kv {
                b.reshape(t, total, kvd);
            }
            let mut work = || {
                let ws = &mut self.ws;
                let meta = b.step_meta(&self.ctx_step);
                b.gather_step(taps, &self.ctx_step, &mut ws.feat);
                b.matmul(&ws.feat, &self.fc, &mut ws.ctx);
                b.rms_norm(&mut ws.ctx, &self.hidden_norm, eps, false, None);
                // Every layer's keys and values come from the same context rows: one call.
                let weights: Vec<&B::Weight> =
                    self.layers.iter().flat_map(|l| [&l.wk, &l.wv]).collect();
                let mut outs: Vec<&mut B::Tensor> = ws.ctx_kv.iter_mut().collect();
                b.matmul_many(&ws.ctx, &weights, &mut outs);
                let rope = Rope {
                    inv_freq: &self.inv_freq,
                    head_dim: self.cfg.head_dim,
                    style: RopeStyle::Neox,
                };
                for (li, (layer, kv)) in
                    self.layers.iter().zip(outs.chunks_exact_mut(2)).enumerate()
                {
                    let [k, v] = kv else {
                        unreachable!("chunks of two")
                    };
                    let norm = (&layer.k_norm, eps);
                    b.k_norm_rope_kv_write(k, v, &mut self.kv, li, meta, norm, rope);
                }
            };
            if total <= GRAPH_MAX_TOKENS {
                b.graph(key, &mut work);
            } else {
                work();
            }
        });
    }

    /// Writes the deferred context tokens (see [`Drafter::extend_deferred`]).
    fn write_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let mut meta = std::mem::take(&mut self.pending);
        let at: Vec<u32> = (0..meta.len() as u32).collect();
        self.write_context(&meta, Features::Pending, &at);
        meta.clear();
        self.pending = meta;
    }

    fn ensure_capacity(&mut self, row: usize, needed: usize) {
        let cap = self.backend.kv_capacity(&self.kv, row);
        if needed > cap {
            let keep = self.rows.len(row);
            self.backend
                .kv_reserve(&mut self.kv, row, needed.max(cap * 2), keep);
        }
    }
}

impl<B: Backend> Drafter for DflashDrafter<B> {
    type B = B;

    fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    fn tap_layers(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    fn new_row(&mut self, capacity: usize) -> Result<usize> {
        let row = self.rows.open();
        self.backend
            .kv_reserve(&mut self.kv, row, capacity.max(1) + self.cfg.block_size, 0);
        Ok(row)
    }

    fn release_row(&mut self, row: usize) {
        // The row's slot may be reused before the next flush: its deferred tokens go now.
        if self.pending.iter().any(|m| m.row as usize == row) {
            self.write_pending();
        }
        self.rows.close(row);
        self.backend.kv_release(&mut self.kv, row);
    }

    fn kv_usage(&self) -> KvUsage {
        let c = &self.cfg;
        KvUsage::of(
            &*self.backend,
            &self.kv,
            &self.rows,
            c.layers,
            c.kv_heads * c.head_dim,
        )
    }

    fn context_len(&self, row: usize) -> usize {
        self.rows.len(row)
    }

    fn extend(
        &mut self,
        rows: &[(usize, usize)],
        taps: &B::Tensor,
        tap_rows: &[u32],
    ) -> Result<()> {
        self.place(rows, tap_rows.len())?;
        let meta = std::mem::take(&mut self.meta);
        self.write_context(&meta, Features::Taps(taps), tap_rows);
        self.meta = meta;
        Ok(())
    }

    fn extend_deferred(
        &mut self,
        rows: &[(usize, usize)],
        taps: &B::Tensor,
        tap_rows: &[u32],
    ) -> Result<()> {
        let total = tap_rows.len();
        if total > PENDING_MAX {
            return self.extend(rows, taps, tap_rows);
        }
        if self.pending.len() + total > PENDING_MAX {
            self.write_pending();
        }
        self.place(rows, total)?;
        let b = &*self.backend;
        let width = self.cfg.target_layer_ids.len() * self.cfg.hidden;
        if b.shape(&self.pending_feat) != (PENDING_MAX, width) {
            self.pending_feat = b.tensor(PENDING_MAX, width);
        }
        b.gather_rows_at(taps, tap_rows, &mut self.pending_feat, self.pending.len());
        self.pending.extend_from_slice(&self.meta);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.write_pending();
        Ok(())
    }

    fn set_argmax_only(&mut self, on: bool) {
        self.argmax_only = on;
    }

    fn draft(
        &mut self,
        rows: &[(usize, u32)],
        block: usize,
        embed: &B::Weight,
        lm_head: &B::Weight,
    ) -> Result<()> {
        if block < 2 || block > self.cfg.block_size {
            return Err(ModelError::Config(format!(
                "block size {block} is outside 2..={} (the drafter's trained block)",
                self.cfg.block_size
            )));
        }
        self.write_pending();
        self.ids.clear();
        self.sel_rows.clear();
        self.anchors.clear();
        let mut metas: Vec<Vec<TokenMeta>> = vec![Vec::new(); self.patterns.len()];
        for &(row, first) in rows {
            let start = self.rows.len_of(row)?;
            self.ensure_capacity(row, start + block);
            self.anchors.push(first);
            for j in 0..block {
                self.ids.push(if j == 0 {
                    first
                } else {
                    self.cfg.mask_token_id
                });
                // Every slot sees the committed context (within a layer's window) and, unless
                // the layer is causal, the whole block.
                let pos = start + j;
                for (m, pattern) in metas.iter_mut().zip(&self.patterns) {
                    let (lo, hi) = pattern.visible(pos, start + block);
                    m.push(TokenMeta {
                        row: row as u32,
                        pos: pos as u32,
                        kv_start: lo as u32,
                        kv_end: hi as u32,
                    });
                }
                if j > 0 {
                    self.sel_rows.push((self.ids.len() - 1) as u32);
                }
            }
        }
        let backend = self.backend.clone();
        let b = &*backend;
        // Pattern 0's metadata also gives the positions (RoPE, KV slots, convolution taps).
        b.step_upload(&mut self.draft_step, &metas[0], &self.ids, &self.sel_rows);
        for (step, m) in self.pattern_steps.iter_mut().zip(&metas[1..]) {
            b.step_upload(step, m, &self.ids, &self.sel_rows);
        }
        let shape = self.shape();
        let eps = self.cfg.rms_eps;
        let hd = self.cfg.head_dim;
        let cfg = &self.cfg;
        let (t, s) = (self.ids.len(), self.sel_rows.len());
        let (h, qd, kvd) = (cfg.hidden, cfg.heads * hd, cfg.kv_heads * hd);
        let embed_scale = cfg.input_embedding_scale;
        let hidden_proj = self.selector.as_ref().map(|s| &s.hidden_proj);
        // DFlash2's selector reads every logit of its candidates.
        let argmax_only = self.argmax_only && self.selector.is_none();
        let lm_head = self.shortlist.as_ref().map_or(lm_head, |s| &s.1);
        // The graph holds the embedding and head weights it was captured with: the key names
        // them (a drafter drafts for one target, whose weights stay where they are).
        let variant = (embed as *const B::Weight as usize as u64)
            ^ (lm_head as *const B::Weight as usize as u64).rotate_left(32);
        let key = GraphKey {
            owner: self.graph_owner[1],
            tokens: t,
            rows: s,
            variant,
        };
        let vocab = b.shape(&self.ws.logits).1;
        // The DFlash2 forward (convolutions, windowed layers, the selector's projection) is
        // device work reading its per-step inputs from the step buffers, so it is captured
        // like the v1 forward; the selector's lattice needs the logits on the host and is built
        // after the graph, outside it.
        b.run(|| {
            let ws = &mut self.ws;
            for (x, cols) in [
                (&mut ws.x, h),
                (&mut ws.h, h),
                (&mut ws.q, qd),
                (&mut ws.k, kvd),
                (&mut ws.v, kvd),
                (&mut ws.att, qd),
                (&mut ws.o, h),
                (&mut ws.gate, cfg.intermediate),
                (&mut ws.up, cfg.intermediate),
            ] {
                b.reshape(x, t, cols);
            }
            b.reshape(&mut ws.sel, s, h);
            if let Some(p) = &cfg.dflash2 {
                let groups = h / p.conv_group_size;
                b.reshape(&mut ws.dynamic, t, 2 * p.conv_kernel_size * groups);
                b.reshape(&mut ws.conv, t, h);
                b.reshape(&mut ws.hproj, s, p.selector_rank);
            }
            // The head's width is known once it has run; a first call shapes it itself.
            if vocab > 0 {
                b.reshape(&mut ws.logits, s, vocab);
            }
            let mut work = || {
                let ws = &mut self.ws;
                let meta = b.step_meta(&self.draft_step);
                b.embed_step(embed, &self.draft_step, &mut ws.x);
                if embed_scale != 1.0 {
                    b.scale(&mut ws.x, embed_scale);
                }
                for (li, layer) in self.layers.iter().enumerate() {
                    let attn_meta = match self.layer_pattern[li] {
                        0 => meta,
                        p => b.step_meta(&self.pattern_steps[p - 1]),
                    };
                    b.rms_norm(&mut ws.x, &layer.input_norm, eps, false, Some(&mut ws.h));
                    if let Some(c) = &layer.conv {
                        c.attn
                            .prepare(b, &ws.h, meta, &mut ws.dynamic, &mut ws.conv);
                    }
                    let attn_in = if layer.conv.is_some() {
                        &ws.conv
                    } else {
                        &ws.h
                    };
                    b.matmul_many(
                        attn_in,
                        &[&layer.wq, &layer.wk, &layer.wv],
                        &mut [&mut ws.q, &mut ws.k, &mut ws.v],
                    );
                    // Block K/V go just past the committed context; the context length is
                    // not advanced, so the next call overwrites them.
                    b.qk_norm_rope_kv_write(
                        &mut ws.q,
                        &mut ws.k,
                        &ws.v,
                        &mut self.kv,
                        li,
                        meta,
                        QkNorm {
                            q: &layer.q_norm,
                            k: &layer.k_norm,
                            eps,
                        },
                        Rope {
                            inv_freq: &self.inv_freq,
                            head_dim: hd,
                            style: RopeStyle::Neox,
                        },
                    );
                    b.attention(&ws.q, &self.kv, li, attn_meta, shape, &mut ws.att);
                    // A convolution sits between the output projection and the residual add,
                    // so only a plain layer fuses the add into the product.
                    match &layer.conv {
                        Some(c) => {
                            b.matmul(&ws.att, &layer.wo, &mut ws.o);
                            c.attn.finish(b, &ws.o, meta, &ws.dynamic, &mut ws.conv);
                            b.add(&mut ws.x, &ws.conv);
                        }
                        None => b.matmul_add(&ws.att, &layer.wo, &mut ws.x, &mut ws.o),
                    }
                    b.rms_norm(&mut ws.x, &layer.post_norm, eps, false, Some(&mut ws.h));
                    if let Some(c) = &layer.conv {
                        c.mlp.prepare(b, &ws.h, meta, &mut ws.dynamic, &mut ws.conv);
                    }
                    let mlp_in = if layer.conv.is_some() {
                        &ws.conv
                    } else {
                        &ws.h
                    };
                    b.matmul_swiglu(mlp_in, &layer.w_gate, &layer.w_up, &mut ws.gate, &mut ws.up);
                    match &layer.conv {
                        Some(c) => {
                            b.matmul(&ws.gate, &layer.w_down, &mut ws.o);
                            c.mlp.finish(b, &ws.o, meta, &ws.dynamic, &mut ws.conv);
                            b.add(&mut ws.x, &ws.conv);
                        }
                        None => b.matmul_add(&ws.gate, &layer.w_down, &mut ws.x, &mut ws.o),
                    }
                }
                b.gather_step(&ws.x, &self.draft_step, &mut ws.sel);
                b.rms_norm(&mut ws.sel, &self.norm, eps, false, None);
                // The graph key does not name this choice: a backend that replays graphs
                // gives `matmul_argmax` the work of `matmul` (the trait's default).
                if argmax_only {
                    b.matmul_argmax(&ws.sel, lm_head, &mut ws.logits);
                } else {
                    b.matmul(&ws.sel, lm_head, &mut ws.logits);
                }
                if let Some(w) = hidden_proj {
                    b.matmul(&ws.sel, w, &mut ws.hproj);
                }
            };
            if t <= GRAPH_MAX_TOKENS {
                b.graph(key, &mut work);
            } else {
                work();
            }
        });
        if let Some(sel) = self.selector.as_mut() {
            let (logits, hproj, anchors) = (&self.ws.logits, &self.ws.hproj, &self.anchors);
            let (host, lattice) = (&mut self.host_logits, &mut self.lattice);
            b.run(|| sel.build(b, logits, host, hproj, anchors, lattice))?;
        }
        Ok(())
    }

    fn logits(&self) -> &B::Tensor {
        &self.ws.logits
    }

    fn vocab_map(&self) -> Option<&[u32]> {
        self.shortlist.as_ref().map(|s| s.0.as_slice())
    }

    fn lattice(&self) -> Option<&CandidateLattice> {
        self.selector.as_ref().map(|_| &self.lattice)
    }
}
