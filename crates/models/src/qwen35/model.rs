//! The Qwen 3.5 hybrid decoder on any backend: Gated DeltaNet layers and gated full-attention
//! layers, batched over rows with their own positions, KV lengths and recurrent states.
//!
//! Per layer: `h = x + mixer(norm(x)); x = h + mlp(norm(h))`, every RMS norm zero-centred
//! (`1 + w`) except the GDN output norm. GDN mixer: qkv/z/b/a projections, causal conv +
//! SiLU, gated delta rule (L2-normalised q/k, β = σ(b), g = A·softplus(a + dt_bias) with
//! A = −exp(A_log)), RMS norm gated by SiLU(z), out projection. Attention mixer: q (with an
//! output gate per head), k, v; q/k norm; partial RoPE; softmax attention; output ⊙ σ(gate).
//!
//! Rollback: a row can be truncated into its last forward step only (the engine truncates a
//! verified block to the accepted prefix). Attention KV is cut by length; each GDN layer's
//! state is rebuilt by the backend from the checkpoint taken at the start of the step.

use std::sync::Arc;

use dflash_runtime::backend::{AttnShape, WeightRole};
use dflash_runtime::{Backend, HostWeight, WeightBytes};

use super::config::{LayerKind, Qwen35Config};
use crate::draft_vocab::gather_rows;
use crate::error::{ModelError, Result};
use crate::kv_usage::KvUsage;
use crate::llama::{load_matrix, load_vector};
use crate::paths::{path_of, ProjectionPath};
use crate::rows::RowTable;
use crate::source::TensorSource;
use crate::step::StepPlan;
use crate::target::{LogitRows, RowStep, Target};

/// Most tokens of a row's last step it can be rolled back into (a verify block is at most the
/// drafter's block, 16 for the published drafters).
pub const MAX_ROLLBACK: usize = 64;
/// Rows of a step with at least this many tokens run the gated delta rule in chunked form
/// (prefill), unless the step asks for every token's logits (verification, which must equal
/// token-by-token decoding bit for bit).
pub const CHUNKED_MIN_TOKENS: usize = 64;

/// How the tensors of a source are named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Naming {
    /// llama.cpp's `qwen35` GGUF names; zero-centred norm weights are stored as `1 + w`.
    Gguf,
    /// HF names under `prefix` (`model.` or `model.language_model.`).
    HuggingFace { prefix: String },
}

impl Naming {
    /// HF naming for `src`: official checkpoints use `model.language_model.`, text-only
    /// `save_pretrained` output `model.`.
    pub fn detect_hf(src: &dyn TensorSource) -> Self {
        let prefix = if src.has("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        Naming::HuggingFace {
            prefix: prefix.into(),
        }
    }

    fn global(&self, what: &str) -> String {
        match self {
            Naming::Gguf => match what {
                "embed" => "token_embd.weight",
                "norm" => "output_norm.weight",
                _ => "output.weight",
            }
            .into(),
            Naming::HuggingFace { prefix } => match what {
                "embed" => format!("{prefix}embed_tokens.weight"),
                "norm" => format!("{prefix}norm.weight"),
                _ => "lm_head.weight".into(),
            },
        }
    }

    fn layer(&self, i: usize, what: &str) -> String {
        let (gguf, hf) = match what {
            "attn_norm" => ("attn_norm.weight", "input_layernorm.weight"),
            "ffn_norm" => (
                "post_attention_norm.weight",
                "post_attention_layernorm.weight",
            ),
            "gate" => ("ffn_gate.weight", "mlp.gate_proj.weight"),
            "up" => ("ffn_up.weight", "mlp.up_proj.weight"),
            "down" => ("ffn_down.weight", "mlp.down_proj.weight"),
            "q" => ("attn_q.weight", "self_attn.q_proj.weight"),
            "k" => ("attn_k.weight", "self_attn.k_proj.weight"),
            "v" => ("attn_v.weight", "self_attn.v_proj.weight"),
            "o" => ("attn_output.weight", "self_attn.o_proj.weight"),
            "q_norm" => ("attn_q_norm.weight", "self_attn.q_norm.weight"),
            "k_norm" => ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            "qkv" => ("attn_qkv.weight", "linear_attn.in_proj_qkv.weight"),
            "z" => ("attn_gate.weight", "linear_attn.in_proj_z.weight"),
            "b" => ("ssm_beta.weight", "linear_attn.in_proj_b.weight"),
            "a" => ("ssm_alpha.weight", "linear_attn.in_proj_a.weight"),
            "conv" => ("ssm_conv1d.weight", "linear_attn.conv1d.weight"),
            "dt_bias" => ("ssm_dt.bias", "linear_attn.dt_bias"),
            "a_log" => ("ssm_a", "linear_attn.A_log"),
            "gdn_norm" => ("ssm_norm.weight", "linear_attn.norm.weight"),
            "out" => ("ssm_out.weight", "linear_attn.out_proj.weight"),
            _ => unreachable!("unknown layer tensor {what}"),
        };
        match self {
            Naming::Gguf => format!("blk.{i}.{gguf}"),
            Naming::HuggingFace { prefix } => format!("{prefix}layers.{i}.{hf}"),
        }
    }

    /// Whether the stored decoder norms still need the `1 +`.
    fn zero_centred(&self) -> bool {
        matches!(self, Naming::HuggingFace { .. })
    }
}

/// Rows `[k·chunk, (k+1)·chunk)` of `w` for even k (`first`) and odd k (`second`): splits
/// the per-head interleaved `[q_h, gate_h]` rows of a gated q projection.
fn split_interleaved(w: &HostWeight, chunk: usize) -> Result<(HostWeight, HostWeight)> {
    let rb = w.row_bytes();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (k, rows) in w.bytes.as_slice().chunks(chunk * rb).enumerate() {
        if k % 2 == 0 { &mut a } else { &mut b }.extend_from_slice(rows);
    }
    let half = w.rows / 2;
    Ok((
        HostWeight::new(
            format!("{} (query)", w.name),
            w.dtype,
            half,
            w.cols,
            WeightBytes::from_vec(a),
        )?,
        HostWeight::new(
            format!("{} (gate)", w.name),
            w.dtype,
            half,
            w.cols,
            WeightBytes::from_vec(b),
        )?,
    ))
}

struct Attn<B: Backend> {
    wq: B::Weight,
    wgate: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
    wo: B::Weight,
    /// Index among the full-attention layers (the KV cache's layer).
    kv_layer: usize,
}

struct Gdn<B: Backend> {
    w_qkv: B::Weight,
    w_z: B::Weight,
    w_b: B::Weight,
    w_a: B::Weight,
    conv: B::Tensor,
    /// A = −exp(A_log).
    a_neg: B::Tensor,
    dt_bias: B::Tensor,
    norm: B::Tensor,
    w_out: B::Weight,
    /// Index among the GDN layers (the recurrent state's layer).
    state_layer: usize,
}

enum Mixer<B: Backend> {
    Attn(Attn<B>),
    Gdn(Gdn<B>),
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    mixer: Mixer<B>,
    ffn_norm: B::Tensor,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
}

/// Activation buffers reused across steps.
struct Workspace<B: Backend> {
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    qgate: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    att: B::Tensor,
    o: B::Tensor,
    qkv: B::Tensor,
    conv: B::Tensor,
    z: B::Tensor,
    ga: B::Tensor,
    gb: B::Tensor,
    core: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
    sel: B::Tensor,
    logits: B::Tensor,
    taps: B::Tensor,
}

/// A Qwen 3.5 text model on backend `B`.
pub struct Qwen35Model<B: Backend> {
    backend: Arc<B>,
    pub cfg: Qwen35Config,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    lm_head: B::Weight,
    /// The head as stored (a view of the model file), for reduced heads.
    head_host: HostWeight,
    inv_freq: B::Tensor,
    zero_centred: bool,
    kv: B::Kv,
    gdn: B::Gdn,
    rows: RowTable,
    /// Tokens of each row's last step still applied (how far it can be rolled back).
    last_step: Vec<usize>,
    tap_layers: Vec<usize>,
    ws: Workspace<B>,
    plan: StepPlan,
}

impl<B: Backend> Qwen35Model<B> {
    /// The numeric path of each projection (the first attention layer and the first GDN layer
    /// stand for their kind; the MLP of layer 0 for all) and the head.
    pub fn matmul_paths(&self) -> Vec<ProjectionPath> {
        let b = &*self.backend;
        let c = &self.cfg;
        let h = c.hidden;
        let (qd, kvd, ff) = (c.heads * c.head_dim, c.kv_dim(), c.intermediate);
        let (cd, vd, hv) = (c.gdn.conv_dim(), c.gdn.value_dim(), c.gdn.v_heads);
        let mut v = Vec::new();
        if let Some(a) = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Attn(a) => Some(a),
            Mixer::Gdn(_) => None,
        }) {
            for (name, w, rows, cols) in [
                ("q", &a.wq, qd, h),
                ("q_gate", &a.wgate, qd, h),
                ("k", &a.wk, kvd, h),
                ("v", &a.wv, kvd, h),
                ("o", &a.wo, h, qd),
            ] {
                v.push(path_of(b, "target", name, w, rows, cols));
            }
        }
        if let Some(g) = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Gdn(g) => Some(g),
            Mixer::Attn(_) => None,
        }) {
            for (name, w, rows, cols) in [
                ("gdn_qkv", &g.w_qkv, cd, h),
                ("gdn_z", &g.w_z, vd, h),
                ("gdn_b", &g.w_b, hv, h),
                ("gdn_a", &g.w_a, hv, h),
                ("gdn_out", &g.w_out, h, vd),
            ] {
                v.push(path_of(b, "target", name, w, rows, cols));
            }
        }
        if let Some(l) = self.layers.first() {
            for (name, w, rows, cols) in [
                ("gate", &l.w_gate, ff, h),
                ("up", &l.w_up, ff, h),
                ("down", &l.w_down, h, ff),
            ] {
                v.push(path_of(b, "target", name, w, rows, cols));
            }
        }
        v.push(path_of(b, "target", "lm_head", &self.lm_head, c.vocab, h));
        v
    }

    /// Builds the model from `src` (named per `naming`) with shapes from `cfg`.
    pub fn load(
        backend: Arc<B>,
        cfg: Qwen35Config,
        src: &dyn TensorSource,
        naming: Naming,
    ) -> Result<Self> {
        let b = &*backend;
        let h = cfg.hidden;
        let (hd, kvd, qd) = (cfg.head_dim, cfg.kv_dim(), cfg.heads * cfg.head_dim);
        let g = cfg.gdn;
        let (cd, vd, hv) = (g.conv_dim(), g.value_dim(), g.v_heads);
        let embed_w = src.weight(&naming.global("embed"), Some([cfg.vocab, h]))?;
        let embed = b.upload_weight(&embed_w, WeightRole::Embedding)?;
        let head_name = naming.global("lm_head");
        let head_host = if !cfg.tied_embeddings {
            if !src.has(&head_name) {
                return Err(ModelError::MissingTensor { name: head_name });
            }
            src.weight(&head_name, Some([cfg.vocab, h]))?
        } else {
            embed_w
        };
        let lm_head = b.upload_weight(&head_host, WeightRole::Vocab)?;
        let (mut n_attn, mut n_gdn) = (0, 0);
        let mut layers = Vec::with_capacity(cfg.layers());
        for (i, kind) in cfg.kinds.iter().enumerate() {
            let n = |w: &str| naming.layer(i, w);
            let mixer = match kind {
                LayerKind::FullAttention => {
                    let wq = src.weight(&n("q"), Some([2 * qd, h]))?;
                    let (q, gate) = split_interleaved(&wq, hd)?;
                    n_attn += 1;
                    Mixer::Attn(Attn {
                        wq: b.upload_weight(&q, WeightRole::Projection)?,
                        wgate: b.upload_weight(&gate, WeightRole::Projection)?,
                        wk: load_matrix(b, src, &n("k"), [kvd, h], WeightRole::Projection)?,
                        wv: load_matrix(b, src, &n("v"), [kvd, h], WeightRole::Projection)?,
                        q_norm: load_vector(b, src, &n("q_norm"), hd)?,
                        k_norm: load_vector(b, src, &n("k_norm"), hd)?,
                        wo: load_matrix(b, src, &n("o"), [h, qd], WeightRole::Projection)?,
                        kv_layer: n_attn - 1,
                    })
                }
                LayerKind::LinearAttention => {
                    let conv = src.weight(&n("conv"), Some([cd, g.conv_kernel]))?.to_f32();
                    let raw_a = src.weight(&n("a_log"), Some([1, hv]))?.to_f32();
                    let a_neg: Vec<f32> = match naming {
                        // llama.cpp stores A = −exp(A_log) itself.
                        Naming::Gguf => raw_a,
                        Naming::HuggingFace { .. } => raw_a.iter().map(|x| -x.exp()).collect(),
                    };
                    n_gdn += 1;
                    Mixer::Gdn(Gdn {
                        w_qkv: load_matrix(b, src, &n("qkv"), [cd, h], WeightRole::Projection)?,
                        w_z: load_matrix(b, src, &n("z"), [vd, h], WeightRole::Projection)?,
                        w_b: load_matrix(b, src, &n("b"), [hv, h], WeightRole::Projection)?,
                        w_a: load_matrix(b, src, &n("a"), [hv, h], WeightRole::Projection)?,
                        conv: b.upload(&conv, cd, g.conv_kernel),
                        a_neg: b.upload(&a_neg, 1, hv),
                        dt_bias: load_vector(b, src, &n("dt_bias"), hv)?,
                        norm: load_vector(b, src, &n("gdn_norm"), g.v_dim)?,
                        w_out: load_matrix(b, src, &n("out"), [h, vd], WeightRole::Projection)?,
                        state_layer: n_gdn - 1,
                    })
                }
            };
            layers.push(Layer {
                attn_norm: load_vector(b, src, &n("attn_norm"), h)?,
                mixer,
                ffn_norm: load_vector(b, src, &n("ffn_norm"), h)?,
                w_gate: load_matrix(
                    b,
                    src,
                    &n("gate"),
                    [cfg.intermediate, h],
                    WeightRole::Projection,
                )?,
                w_up: load_matrix(
                    b,
                    src,
                    &n("up"),
                    [cfg.intermediate, h],
                    WeightRole::Projection,
                )?,
                w_down: load_matrix(
                    b,
                    src,
                    &n("down"),
                    [h, cfg.intermediate],
                    WeightRole::Projection,
                )?,
            });
        }
        let norm = load_vector(b, src, &naming.global("norm"), h)?;
        let inv = cfg.inv_freq();
        let inv_freq = b.upload(&inv, 1, inv.len());
        let kv = b.kv_new(n_attn, cfg.kv_heads, cfg.head_dim);
        let gdn = b.gdn_new(n_gdn, g, MAX_ROLLBACK);
        let t = |c: usize| b.tensor(0, c);
        let ws = Workspace {
            x: t(h),
            h: t(h),
            q: t(qd),
            qgate: t(qd),
            k: t(kvd),
            v: t(kvd),
            att: t(qd),
            o: t(h),
            qkv: t(cd),
            conv: t(cd),
            z: t(vd),
            ga: t(hv),
            gb: t(hv),
            core: t(vd),
            gate: t(cfg.intermediate),
            up: t(cfg.intermediate),
            sel: t(h),
            logits: t(cfg.vocab),
            taps: t(0),
        };
        Ok(Self {
            zero_centred: naming.zero_centred(),
            backend,
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            head_host,
            inv_freq,
            kv,
            gdn,
            rows: RowTable::default(),
            last_step: Vec::new(),
            tap_layers: Vec::new(),
            ws,
            plan: StepPlan::default(),
        })
    }

    /// The recurrent state of every row (for inspection in tests).
    pub fn gdn_state(&self) -> &B::Gdn {
        &self.gdn
    }

    fn run_layers(&mut self, meta: &B::Meta) {
        let b = &*self.backend;
        let cfg = &self.cfg;
        let ws = &mut self.ws;
        let spans = &self.plan.spans;
        let t = self.plan.ids.len();
        let zc = self.zero_centred;
        let eps = cfg.rms_eps;
        let shape = AttnShape {
            n_heads: cfg.heads,
            n_kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        let hidden = cfg.hidden;
        b.reshape(&mut ws.taps, t, hidden * self.tap_layers.len());
        for (li, layer) in self.layers.iter().enumerate() {
            b.rms_norm(&mut ws.x, &layer.attn_norm, eps, zc, Some(&mut ws.h));
            match &layer.mixer {
                Mixer::Attn(a) => {
                    b.step_matmul_many(
                        &ws.h,
                        &[&a.wq, &a.wgate, &a.wk, &a.wv],
                        &mut [&mut ws.q, &mut ws.qgate, &mut ws.k, &mut ws.v],
                        spans,
                    );
                    b.rms_norm(&mut ws.q, &a.q_norm, eps, zc, None);
                    b.rms_norm(&mut ws.k, &a.k_norm, eps, zc, None);
                    let style = dflash_runtime::backend::RopeStyle::Neox;
                    b.rope(&mut ws.q, meta, &self.inv_freq, cfg.head_dim, style);
                    b.rope(&mut ws.k, meta, &self.inv_freq, cfg.head_dim, style);
                    b.kv_write(&mut self.kv, a.kv_layer, &ws.k, &ws.v, meta);
                    b.attention(&ws.q, &self.kv, a.kv_layer, meta, shape, &mut ws.att);
                    b.sigmoid_mul(&mut ws.att, &ws.qgate);
                    b.step_matmul_many(&ws.att, &[&a.wo], &mut [&mut ws.o], spans);
                }
                Mixer::Gdn(g) => {
                    b.step_matmul_many(
                        &ws.h,
                        &[&g.w_qkv, &g.w_z, &g.w_b, &g.w_a],
                        &mut [&mut ws.qkv, &mut ws.z, &mut ws.gb, &mut ws.ga],
                        spans,
                    );
                    let sl = g.state_layer;
                    b.causal_conv(&mut self.gdn, sl, &ws.qkv, &g.conv, spans, &mut ws.conv);
                    b.gdn_gates(&mut ws.ga, &mut ws.gb, &g.a_neg, &g.dt_bias);
                    b.gated_delta(
                        &mut self.gdn,
                        sl,
                        &ws.conv,
                        &ws.ga,
                        &ws.gb,
                        spans,
                        &mut ws.core,
                    );
                    b.rms_norm_gated(&mut ws.core, &ws.z, &g.norm, eps);
                    b.step_matmul_many(&ws.core, &[&g.w_out], &mut [&mut ws.o], spans);
                }
            }
            b.add(&mut ws.x, &ws.o);
            b.rms_norm(&mut ws.x, &layer.ffn_norm, eps, zc, Some(&mut ws.h));
            b.step_matmul_many(
                &ws.h,
                &[&layer.w_gate, &layer.w_up],
                &mut [&mut ws.gate, &mut ws.up],
                spans,
            );
            b.silu_mul(&mut ws.gate, &ws.up);
            b.step_matmul_many(&ws.gate, &[&layer.w_down], &mut [&mut ws.o], spans);
            b.add(&mut ws.x, &ws.o);
            for (slot, _) in self.tap_layers.iter().enumerate().filter(|(_, &l)| l == li) {
                b.copy_columns(&ws.x, &mut ws.taps, slot * hidden);
            }
        }
    }
}

impl<B: Backend> Target for Qwen35Model<B> {
    type B = B;

    fn backend(&self) -> &B {
        &self.backend
    }

    fn vocab(&self) -> usize {
        self.cfg.vocab
    }

    fn hidden(&self) -> usize {
        self.cfg.hidden
    }

    fn n_layers(&self) -> usize {
        self.cfg.layers()
    }

    fn context_length(&self) -> usize {
        self.cfg.context_length
    }

    fn new_row(&mut self, capacity: usize) -> Result<usize> {
        let row = self.rows.open();
        let cap = capacity.clamp(1, self.cfg.context_length);
        self.backend.kv_reserve(&mut self.kv, row, cap, 0);
        self.backend.gdn_open_row(&mut self.gdn, row);
        if self.last_step.len() <= row {
            self.last_step.resize(row + 1, 0);
        }
        self.last_step[row] = 0;
        Ok(row)
    }

    fn release_row(&mut self, row: usize) {
        if self.rows.is_live(row) {
            self.rows.close(row);
            self.backend.kv_release(&mut self.kv, row);
            self.backend.gdn_release_row(&mut self.gdn, row);
        }
    }

    fn row_len(&self, row: usize) -> usize {
        self.rows.len(row)
    }

    fn truncate_row(&mut self, row: usize, len: usize) -> Result<()> {
        let cur = self.rows.len_of(row)?;
        if len >= cur {
            return Ok(());
        }
        let last = self.last_step[row];
        let start = cur - last;
        if len < start {
            return Err(ModelError::Config(format!(
                "row {row}: a Qwen 3.5 row can be rolled back only into its last step \
                 (positions {start}..{cur}), not to {len}"
            )));
        }
        self.backend.gdn_rollback(&mut self.gdn, row, len - start)?;
        self.rows.truncate(row, len);
        self.last_step[row] = len - start;
        Ok(())
    }

    /// Pieces of [`CHUNKED_MIN_TOKENS`] (the chunk of the GDN chunked form) and a shorter tail
    /// (token by token) give the same state whatever the schedule.
    fn prefill_granule(&self) -> usize {
        CHUNKED_MIN_TOKENS
    }

    fn kv_usage(&self) -> KvUsage {
        let c = &self.cfg;
        let attn = c
            .kinds
            .iter()
            .filter(|k| **k == LayerKind::FullAttention)
            .count();
        KvUsage::of(&*self.backend, &self.kv, &self.rows, attn, c.kv_dim())
    }

    fn fork_row(&mut self, src: usize, capacity: usize) -> Result<usize> {
        let len = self.rows.len_of(src)?;
        let row = self.rows.open();
        let cap = capacity.max(len).clamp(1, self.cfg.context_length.max(len));
        self.backend.kv_reserve(&mut self.kv, row, cap, 0);
        self.backend.kv_copy_row(&mut self.kv, src, row, len);
        self.backend.gdn_copy_row(&mut self.gdn, src, row);
        self.rows.set_len(row, len);
        if self.last_step.len() <= row {
            self.last_step.resize(row + 1, 0);
        }
        self.last_step[row] = 0;
        Ok(row)
    }

    fn set_tap_layers(&mut self, layers: &[usize]) -> Result<()> {
        if let Some(&bad) = layers.iter().find(|&&l| l >= self.cfg.layers()) {
            return Err(ModelError::IncompatibleDrafter(format!(
                "tapped layer {bad} does not exist (the target has {} layers)",
                self.cfg.layers()
            )));
        }
        self.tap_layers = layers.to_vec();
        Ok(())
    }

    fn forward(&mut self, steps: &[RowStep<'_>]) -> Result<()> {
        self.plan.build(
            steps,
            &self.rows,
            self.cfg.vocab,
            self.cfg.context_length,
            |s| s.tokens.len() >= CHUNKED_MIN_TOKENS && s.logits != LogitRows::All,
        )?;
        if self.plan.ids.is_empty() {
            return Ok(());
        }
        let backend = self.backend.clone();
        let b = &*backend;
        for s in steps {
            let start = self.rows.len(s.row);
            let end = start + s.tokens.len();
            let cap = b.kv_capacity(&self.kv, s.row);
            if end > cap {
                let new_cap = end.max(cap * 2).min(self.cfg.context_length.max(end));
                b.kv_reserve(&mut self.kv, s.row, new_cap, start);
            }
        }
        let meta = b.upload_meta(&self.plan.meta);
        b.gdn_begin(&mut self.gdn, &self.plan.spans);
        b.run(|| {
            b.embed(&self.embed, &self.plan.ids, &mut self.ws.x);
            self.run_layers(&meta);
            let ws = &mut self.ws;
            b.gather_rows(&ws.x, &self.plan.sel_rows, &mut ws.sel);
            if !self.plan.sel_rows.is_empty() {
                b.rms_norm(
                    &mut ws.sel,
                    &self.norm,
                    self.cfg.rms_eps,
                    self.zero_centred,
                    None,
                );
                if self.plan.argmax_only {
                    b.matmul_argmax(&ws.sel, &self.lm_head, &mut ws.logits);
                } else {
                    b.matmul(&ws.sel, &self.lm_head, &mut ws.logits);
                }
            } else {
                b.reshape(&mut ws.logits, 0, self.cfg.vocab);
            }
        });
        for s in steps {
            let len = self.rows.len(s.row) + s.tokens.len();
            self.rows.set_len(s.row, len);
            if !s.tokens.is_empty() {
                self.last_step[s.row] = s.tokens.len();
            }
        }
        Ok(())
    }

    fn logits(&self) -> &B::Tensor {
        &self.ws.logits
    }

    fn taps(&self) -> &B::Tensor {
        &self.ws.taps
    }

    fn embedding(&self) -> &B::Weight {
        &self.embed
    }

    fn lm_head(&self) -> &B::Weight {
        &self.lm_head
    }

    fn lm_head_rows(&self, ids: &[u32]) -> Result<B::Weight> {
        let w = gather_rows(&self.head_host, ids)?;
        Ok(self.backend.upload_weight(&w, WeightRole::Vocab)?)
    }
}
