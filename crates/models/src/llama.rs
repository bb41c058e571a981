//! Llama-family decoder (Llama, SmolLM2, Qwen2 with qkv bias, Qwen3 with q/k norm) on any
//! backend, batched over rows with their own positions and KV lengths.

use dflash_runtime::backend::{AttnShape, GraphKey, QkNorm, Rope, RowSpan, TokenMeta, WeightRole};
use dflash_runtime::{Backend, HostWeight};

use crate::config::LlamaConfig;
use crate::draft_vocab::gather_rows;
use crate::error::{ModelError, Result};
use crate::kv_usage::KvUsage;
use crate::paths::{path_of, ProjectionPath};
use crate::rows::RowTable;
use crate::source::TensorSource;
use crate::target::{argmax_only, LogitRows, RowStep, Target};

/// Steps of at most this many tokens (decode, verify blocks, batched decode) may be replayed
/// from captured graphs; longer ones (prompt chunks, whose lengths vary) run eagerly.
const GRAPH_MAX_TOKENS: usize = 256;

/// How the tensors of a source are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// `token_embd.weight`, `blk.N.attn_q.weight`, ...
    Gguf,
    /// `model.embed_tokens.weight`, `model.layers.N.self_attn.q_proj.weight`, ...
    HuggingFace,
}

impl Naming {
    fn global(self, what: &str) -> &'static str {
        match (self, what) {
            (Naming::Gguf, "embed") => "token_embd.weight",
            (Naming::Gguf, "norm") => "output_norm.weight",
            (Naming::Gguf, "lm_head") => "output.weight",
            (Naming::HuggingFace, "embed") => "model.embed_tokens.weight",
            (Naming::HuggingFace, "norm") => "model.norm.weight",
            (Naming::HuggingFace, "lm_head") => "lm_head.weight",
            _ => unreachable!("unknown global tensor {what}"),
        }
    }

    fn layer(self, i: usize, what: &str) -> String {
        let (gguf, hf) = match what {
            "attn_norm" => ("attn_norm.weight", "input_layernorm.weight"),
            "q" => ("attn_q.weight", "self_attn.q_proj.weight"),
            "k" => ("attn_k.weight", "self_attn.k_proj.weight"),
            "v" => ("attn_v.weight", "self_attn.v_proj.weight"),
            "q_bias" => ("attn_q.bias", "self_attn.q_proj.bias"),
            "k_bias" => ("attn_k.bias", "self_attn.k_proj.bias"),
            "v_bias" => ("attn_v.bias", "self_attn.v_proj.bias"),
            "q_norm" => ("attn_q_norm.weight", "self_attn.q_norm.weight"),
            "k_norm" => ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            "o" => ("attn_output.weight", "self_attn.o_proj.weight"),
            "ffn_norm" => ("ffn_norm.weight", "post_attention_layernorm.weight"),
            "gate" => ("ffn_gate.weight", "mlp.gate_proj.weight"),
            "up" => ("ffn_up.weight", "mlp.up_proj.weight"),
            "down" => ("ffn_down.weight", "mlp.down_proj.weight"),
            _ => unreachable!("unknown layer tensor {what}"),
        };
        match self {
            Naming::Gguf => format!("blk.{i}.{gguf}"),
            Naming::HuggingFace => format!("model.layers.{i}.{hf}"),
        }
    }
}

/// Loads a 1-D tensor of `len` values as an f32 row on the device.
pub(crate) fn load_vector<B: Backend>(
    b: &B,
    src: &dyn TensorSource,
    name: &str,
    len: usize,
) -> Result<B::Tensor> {
    let w = src.weight(name, Some([1, len]))?;
    Ok(b.upload(&w.to_f32(), 1, len))
}

/// Loads a `rows x cols` weight for `role` (which picks its numeric path on the backend).
pub(crate) fn load_matrix<B: Backend>(
    b: &B,
    src: &dyn TensorSource,
    name: &str,
    [rows, cols]: [usize; 2],
    role: WeightRole,
) -> Result<B::Weight> {
    let w = src.weight(name, Some([rows, cols]))?;
    Ok(b.upload_weight(&w, role)?)
}

struct Layer<B: Backend> {
    attn_norm: B::Tensor,
    wq: B::Weight,
    wk: B::Weight,
    wv: B::Weight,
    bias: Option<[B::Tensor; 3]>,
    qk_norm: Option<[B::Tensor; 2]>,
    wo: B::Weight,
    ffn_norm: B::Tensor,
    w_gate: B::Weight,
    w_up: B::Weight,
    w_down: B::Weight,
}

/// Activation buffers reused across steps (resized, never reallocated once large enough).
struct Workspace<B: Backend> {
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
    taps: B::Tensor,
}

/// A Llama-family model on backend `B`.
pub struct LlamaModel<B: Backend> {
    backend: std::sync::Arc<B>,
    pub cfg: LlamaConfig,
    embed: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Tensor,
    lm_head: B::Weight,
    /// The head as stored (a view of the model file), for reduced heads.
    head_host: HostWeight,
    inv_freq: B::Tensor,
    kv: B::Kv,
    rows: RowTable,
    tap_layers: Vec<usize>,
    ws: Workspace<B>,
    ids: Vec<u32>,
    meta: Vec<TokenMeta>,
    /// Each row's tokens in the step; prompt pieces are marked (their products may take the
    /// backend's prefill path, `Backend::step_matmul_*`).
    spans: Vec<RowSpan>,
    sel_rows: Vec<u32>,
    /// The planned step's rows read their logits only for greedy choices.
    argmax_only: bool,
    /// The step inputs on the device (metadata, ids, selected rows).
    step: B::Step,
    /// This model's name for its captured step graphs.
    graph_owner: u64,
    /// Bumped when the tapped layers change (the step then launches other copies).
    tap_gen: u64,
}

impl<B: Backend> LlamaModel<B> {
    /// The numeric path of each projection (layer 0 stands for every layer) and the head.
    pub fn matmul_paths(&self) -> Vec<ProjectionPath> {
        let b = &*self.backend;
        let c = &self.cfg;
        let (h, qd, kvd, ff) = (c.hidden, c.heads * c.head_dim, c.kv_dim(), c.intermediate);
        let mut v = Vec::new();
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
                v.push(path_of(b, "target", name, w, rows, cols));
            }
        }
        v.push(path_of(b, "target", "lm_head", &self.lm_head, c.vocab, h));
        v
    }

    /// Builds the model from `src` (named per `naming`) with shapes from `cfg`.
    pub fn load(
        backend: std::sync::Arc<B>,
        cfg: LlamaConfig,
        src: &dyn TensorSource,
        naming: Naming,
    ) -> Result<Self> {
        let b = &*backend;
        let (h, kvd, hd) = (cfg.hidden, cfg.kv_dim(), cfg.head_dim);
        let qd = cfg.heads * hd;
        let embed_w = src.weight(naming.global("embed"), Some([cfg.vocab, h]))?;
        let embed = b.upload_weight(&embed_w, WeightRole::Embedding)?;
        let head_host = if src.has(naming.global("lm_head")) {
            src.weight(naming.global("lm_head"), Some([cfg.vocab, h]))?
        } else {
            embed_w
        };
        let lm_head = b.upload_weight(&head_host, WeightRole::Vocab)?;
        let proj = |name: &str, rows, cols| {
            load_matrix(b, src, name, [rows, cols], WeightRole::Projection)
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let n = |w: &str| naming.layer(i, w);
            let bias = if cfg.qkv_bias {
                Some([
                    load_vector(b, src, &n("q_bias"), qd)?,
                    load_vector(b, src, &n("k_bias"), kvd)?,
                    load_vector(b, src, &n("v_bias"), kvd)?,
                ])
            } else {
                None
            };
            let qk_norm = if cfg.qk_norm {
                Some([
                    load_vector(b, src, &n("q_norm"), hd)?,
                    load_vector(b, src, &n("k_norm"), hd)?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: load_vector(b, src, &n("attn_norm"), h)?,
                wq: proj(&n("q"), qd, h)?,
                wk: proj(&n("k"), kvd, h)?,
                wv: proj(&n("v"), kvd, h)?,
                bias,
                qk_norm,
                wo: proj(&n("o"), h, qd)?,
                ffn_norm: load_vector(b, src, &n("ffn_norm"), h)?,
                w_gate: proj(&n("gate"), cfg.intermediate, h)?,
                w_up: proj(&n("up"), cfg.intermediate, h)?,
                w_down: proj(&n("down"), h, cfg.intermediate)?,
            });
        }
        let norm = load_vector(b, src, naming.global("norm"), h)?;
        let mut inv = cfg.inv_freq();
        // Llama-3.x GGUF files carry their RoPE scaling as per-frequency divisors.
        if naming == Naming::Gguf && src.has("rope_freqs.weight") {
            let f = src.weight("rope_freqs.weight", Some([1, hd / 2]))?.to_f32();
            for (x, d) in inv.iter_mut().zip(f) {
                *x /= d;
            }
        }
        let inv_freq = b.upload(&inv, 1, inv.len());
        let kv = b.kv_new(cfg.layers, cfg.kv_heads, cfg.head_dim);
        let ws = Workspace {
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
            logits: b.tensor(0, cfg.vocab),
            taps: b.tensor(0, 0),
        };
        let (step, graph_owner) = (b.step_new(), b.graph_owner());
        Ok(Self {
            backend,
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            head_host,
            inv_freq,
            kv,
            rows: RowTable::default(),
            tap_layers: Vec::new(),
            ws,
            ids: Vec::new(),
            meta: Vec::new(),
            spans: Vec::new(),
            sel_rows: Vec::new(),
            argmax_only: false,
            step,
            graph_owner,
            tap_gen: 0,
        })
    }

    /// Checks a step batch and lays out its tokens, metadata and logit rows.
    fn plan(&mut self, steps: &[RowStep<'_>]) -> Result<()> {
        self.ids.clear();
        self.meta.clear();
        self.spans.clear();
        self.sel_rows.clear();
        self.argmax_only = argmax_only(steps);
        for s in steps {
            let start = self.rows.len_of(s.row)?;
            let end = start + s.tokens.len();
            if end > self.cfg.context_length {
                return Err(ModelError::Config(format!(
                    "row {} would reach {end} tokens, beyond the model's context of {}",
                    s.row, self.cfg.context_length
                )));
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
                return Err(ModelError::Config(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.cfg.vocab
                )));
            }
            let cap = self.backend.kv_capacity(&self.kv, s.row);
            if end > cap {
                let new_cap = end.max(cap * 2).min(self.cfg.context_length.max(end));
                self.backend.kv_reserve(&mut self.kv, s.row, new_cap, start);
            }
            let first = self.ids.len();
            if !s.tokens.is_empty() {
                self.spans.push(RowSpan {
                    row: s.row as u32,
                    first: first as u32,
                    count: s.tokens.len() as u32,
                    chunked: false,
                    prompt: s.prompt,
                });
            }
            for (i, &t) in s.tokens.iter().enumerate() {
                self.ids.push(t);
                self.meta
                    .push(TokenMeta::causal(s.row as u32, (start + i) as u32));
            }
            match s.logits {
                LogitRows::None => {}
                LogitRows::Last if !s.tokens.is_empty() => {
                    self.sel_rows.push((self.ids.len() - 1) as u32)
                }
                LogitRows::Last => {}
                LogitRows::All => self
                    .sel_rows
                    .extend((first..self.ids.len()).map(|i| i as u32)),
            }
        }
        Ok(())
    }

    /// The planned step's [`GraphKey::variant`]: the tap layout's generation and the first
    /// row of the step's prompt pieces (its products launch other kernels for them), which
    /// the engines put after every decode and verify row. `None` when prompt rows come before
    /// other rows: such a step runs eagerly.
    fn graph_variant(&self) -> Option<u64> {
        let t = self.ids.len();
        let from = self
            .spans
            .iter()
            .find(|s| s.prompt)
            .map_or(t, |s| s.first as usize);
        let suffix = self
            .spans
            .iter()
            .filter(|s| s.first as usize >= from)
            .all(|s| s.prompt);
        suffix.then(|| self.tap_gen * (GRAPH_MAX_TOKENS as u64 + 1) + from as u64)
    }

    /// Sets every workspace tensor to its shape for a step of `t` tokens and `s` logit rows,
    /// before the step's device work (which a graph replay runs without host code).
    fn shape_workspace(&mut self, t: usize, s: usize) {
        let b = &*self.backend;
        let cfg = &self.cfg;
        let ws = &mut self.ws;
        let (h, qd, kvd) = (cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_dim());
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
            (&mut ws.taps, h * self.tap_layers.len()),
        ] {
            b.reshape(x, t, cols);
        }
        b.reshape(&mut ws.sel, s, h);
        b.reshape(&mut ws.logits, s, cfg.vocab);
    }

    /// The step's device work: embedding, layers, final norm and output head of the
    /// selected rows. Reads its inputs from `self.step` only (see [`Backend::graph`]).
    fn device_step(&mut self) {
        let backend = self.backend.clone();
        let b = &*backend;
        b.embed_step(&self.embed, &self.step, &mut self.ws.x);
        self.run_layers();
        let ws = &mut self.ws;
        if b.shape(&ws.sel).0 > 0 {
            b.gather_step(&ws.x, &self.step, &mut ws.sel);
            b.rms_norm(&mut ws.sel, &self.norm, self.cfg.rms_eps, false, None);
            // Graphs are not keyed on this choice: a backend that replays them gives
            // `matmul_argmax` the work of `matmul` (the trait's default).
            if self.argmax_only {
                b.matmul_argmax(&ws.sel, &self.lm_head, &mut ws.logits);
            } else {
                b.matmul(&ws.sel, &self.lm_head, &mut ws.logits);
            }
        }
    }

    fn run_layers(&mut self) {
        let b = &*self.backend;
        let cfg = &self.cfg;
        let ws = &mut self.ws;
        let spans = &self.spans;
        let meta = b.step_meta(&self.step);
        let shape = AttnShape {
            n_heads: cfg.heads,
            n_kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            scale: 1.0 / (cfg.head_dim as f32).sqrt(),
        };
        let hidden = cfg.hidden;
        for (li, layer) in self.layers.iter().enumerate() {
            b.rms_norm(
                &mut ws.x,
                &layer.attn_norm,
                cfg.rms_eps,
                false,
                Some(&mut ws.h),
            );
            let qkv = [&layer.wq, &layer.wk, &layer.wv];
            let rope = Rope {
                inv_freq: &self.inv_freq,
                head_dim: cfg.head_dim,
                style: cfg.rope_style,
            };
            if layer.bias.is_none() && layer.qk_norm.is_none() {
                b.step_qkv_rope_kv(
                    &ws.h,
                    qkv,
                    [&mut ws.q, &mut ws.k, &mut ws.v],
                    &mut self.kv,
                    li,
                    meta,
                    rope,
                    spans,
                );
            } else {
                b.step_matmul_many(&ws.h, &qkv, &mut [&mut ws.q, &mut ws.k, &mut ws.v], spans);
                if let Some([bq, bk, bv]) = &layer.bias {
                    b.add_bias(&mut ws.q, bq);
                    b.add_bias(&mut ws.k, bk);
                    b.add_bias(&mut ws.v, bv);
                }
                match &layer.qk_norm {
                    Some([qn, kn]) => b.qk_norm_rope_kv_write(
                        &mut ws.q,
                        &mut ws.k,
                        &ws.v,
                        &mut self.kv,
                        li,
                        meta,
                        QkNorm {
                            q: qn,
                            k: kn,
                            eps: cfg.rms_eps,
                        },
                        rope,
                    ),
                    None => {
                        b.rope_kv_write(&mut ws.q, &mut ws.k, &ws.v, &mut self.kv, li, meta, rope)
                    }
                }
            }
            // Weights ahead into L2 (a hint, `Backend::weights_ahead`): attention brings the
            // o, gate and up weights, the gate/up product the down weights, the down product
            // the next layer's q, k and v.
            b.weights_ahead(&[&layer.wo, &layer.w_gate, &layer.w_up]);
            b.attention(&ws.q, &self.kv, li, meta, shape, &mut ws.att);
            b.step_matmul_add(&ws.att, &layer.wo, &mut ws.x, &mut ws.o, spans);
            b.rms_norm(
                &mut ws.x,
                &layer.ffn_norm,
                cfg.rms_eps,
                false,
                Some(&mut ws.h),
            );
            b.weights_ahead(&[&layer.w_down]);
            b.step_matmul_swiglu(
                &ws.h,
                &layer.w_gate,
                &layer.w_up,
                &mut ws.gate,
                &mut ws.up,
                spans,
            );
            if let Some(next) = self.layers.get(li + 1) {
                b.weights_ahead(&[&next.wq, &next.wk, &next.wv]);
            }
            b.step_matmul_add(&ws.gate, &layer.w_down, &mut ws.x, &mut ws.o, spans);
            for (slot, _) in self.tap_layers.iter().enumerate().filter(|(_, &l)| l == li) {
                b.copy_columns(&ws.x, &mut ws.taps, slot * hidden);
            }
        }
    }
}

impl<B: Backend> Target for LlamaModel<B> {
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
        self.cfg.layers
    }

    fn context_length(&self) -> usize {
        self.cfg.context_length
    }

    fn new_row(&mut self, capacity: usize) -> Result<usize> {
        let row = self.rows.open();
        let cap = capacity.clamp(1, self.cfg.context_length);
        self.backend.kv_reserve(&mut self.kv, row, cap, 0);
        Ok(row)
    }

    fn release_row(&mut self, row: usize) {
        self.rows.close(row);
        self.backend.kv_release(&mut self.kv, row);
    }

    fn row_len(&self, row: usize) -> usize {
        self.rows.len(row)
    }

    fn kv_usage(&self) -> KvUsage {
        let c = &self.cfg;
        KvUsage::of(&*self.backend, &self.kv, &self.rows, c.layers, c.kv_dim())
    }

    fn truncate_row(&mut self, row: usize, len: usize) -> Result<()> {
        self.rows.truncate(row, len);
        Ok(())
    }

    fn fork_row(&mut self, src: usize, capacity: usize) -> Result<usize> {
        let len = self.rows.len_of(src)?;
        let row = self.new_row(capacity.max(len))?;
        self.backend.kv_copy_row(&mut self.kv, src, row, len);
        self.rows.set_len(row, len);
        Ok(row)
    }

    fn set_tap_layers(&mut self, layers: &[usize]) -> Result<()> {
        if let Some(&bad) = layers.iter().find(|&&l| l >= self.cfg.layers) {
            return Err(ModelError::IncompatibleDrafter(format!(
                "tapped layer {bad} does not exist (the target has {} layers)",
                self.cfg.layers
            )));
        }
        self.tap_layers = layers.to_vec();
        self.tap_gen += 1;
        Ok(())
    }

    fn forward(&mut self, steps: &[RowStep<'_>]) -> Result<()> {
        self.plan(steps)?;
        if self.ids.is_empty() {
            return Ok(());
        }
        let backend = self.backend.clone();
        let b = &*backend;
        b.step_upload(&mut self.step, &self.meta, &self.ids, &self.sel_rows);
        let (tokens, rows) = (self.ids.len(), self.sel_rows.len());
        let variant = self.graph_variant();
        b.run(|| {
            self.shape_workspace(tokens, rows);
            match variant {
                Some(variant) if tokens <= GRAPH_MAX_TOKENS => {
                    let key = GraphKey {
                        owner: self.graph_owner,
                        tokens,
                        rows,
                        variant,
                    };
                    b.graph(key, &mut || self.device_step())
                }
                _ => self.device_step(),
            }
        });
        for s in steps {
            let len = self.rows.len(s.row) + s.tokens.len();
            self.rows.set_len(s.row, len);
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
