//! The DFlash drafter (published z-lab format): Qwen3-style layers whose keys and values are
//! extended with the fused target features of every committed token, drafting a whole block
//! in one bidirectional forward pass.

use std::path::Path;
use std::sync::Arc;

use dflash_runtime::backend::{AttnShape, GraphKey, RopeStyle, TokenMeta, WeightRole};
use dflash_runtime::Backend;
use serde_json::Value;

use crate::config::rope_inv_freq;
use crate::drafter::Drafter;
use crate::error::{ModelError, Result};
use crate::llama::{load_matrix, load_vector};
use crate::paths::{path_of, ProjectionPath};
use crate::rows::RowTable;
use crate::source::safetensors_dir::SafetensorsDir;
use crate::source::TensorSource;

/// Drafter hyper-parameters from its `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct DrafterConfig {
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: Option<usize>,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
}

/// The published default for which target layers to tap: one in the middle for a single
/// draft layer, else `n` points evenly spaced from 1 to `n_target - 3`, rounded half to even
/// (Python's `round`).
pub fn build_target_layer_ids(n_target: usize, n: usize) -> Vec<usize> {
    if n <= 1 {
        return vec![n_target / 2];
    }
    let (start, end) = (1.0f64, n_target as f64 - 3.0);
    (0..n)
        .map(|i| {
            let x = start + (end - start) * i as f64 / (n - 1) as f64;
            let r = x.round();
            // Ties go to the even neighbour.
            let r = if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
                r - 1.0
            } else {
                r
            };
            r as usize
        })
        .collect()
}

fn cfg_err(m: impl Into<String>) -> ModelError {
    ModelError::IncompatibleDrafter(m.into())
}

impl DrafterConfig {
    /// Reads `config.json` of a drafter directory.
    pub fn read(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| cfg_err(format!("{} is not valid JSON: {e}", cfg_path.display())))?;
        Self::from_json(&v)
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        let dc = v.get("dflash_config");
        let num = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
        let req = |k: &str| num(k).ok_or_else(|| cfg_err(format!("config.json: `{k}` is missing")));
        let hidden = req("hidden_size")?;
        let heads = req("num_attention_heads")?;
        let layers = req("num_hidden_layers")?;
        let num_target_layers = num("num_target_layers");
        let block_size = num("block_size")
            .or_else(|| {
                dc.and_then(|d| d.get("block_size"))
                    .and_then(Value::as_u64)
                    .map(|x| x as usize)
            })
            .unwrap_or(16);
        let mask_token_id = dc
            .and_then(|d| d.get("mask_token_id"))
            .and_then(Value::as_u64)
            .ok_or_else(|| cfg_err("config.json: `dflash_config.mask_token_id` is missing"))?
            as u32;
        let target_layer_ids = match dc.and_then(|d| d.get("target_layer_ids")) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| cfg_err("`dflash_config.target_layer_ids` must be integers"))?,
            Some(_) => return Err(cfg_err("`dflash_config.target_layer_ids` must be a list")),
            None => {
                let n_target = num_target_layers.ok_or_else(|| {
                    cfg_err("config.json gives neither `target_layer_ids` nor `num_target_layers`")
                })?;
                build_target_layer_ids(n_target, layers)
            }
        };
        if target_layer_ids.is_empty() {
            return Err(cfg_err("`target_layer_ids` is empty"));
        }
        if v.get("attention_bias").and_then(Value::as_bool) == Some(true) {
            return Err(cfg_err("drafters with attention biases are not supported"));
        }
        let scaling = v.get("rope_scaling").filter(|s| !s.is_null());
        if let Some(s) = scaling {
            let kind = s
                .get("rope_type")
                .or_else(|| s.get("type"))
                .and_then(Value::as_str);
            if kind != Some("default") {
                return Err(cfg_err(format!(
                    "drafter RoPE scaling {s} is not supported"
                )));
            }
        }
        if let Some(Value::Array(types)) = v.get("layer_types") {
            if types
                .iter()
                .any(|t| t.as_str() == Some("sliding_attention"))
            {
                tracing::warn!(
                    "drafter has sliding-window layers; they attend to the whole context, as the \
                     reference implementation does"
                );
            }
        }
        let rope_theta = v
            .get("rope_theta")
            .or_else(|| v.get("rope_parameters").and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32;
        let cfg = DrafterConfig {
            block_size,
            mask_token_id,
            target_layer_ids,
            num_target_layers,
            hidden,
            intermediate: req("intermediate_size")?,
            layers,
            heads,
            kv_heads: num("num_key_value_heads").unwrap_or(heads),
            head_dim: num("head_dim").unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
            rms_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6) as f32,
            rope_theta,
        };
        if cfg.block_size < 2 {
            return Err(cfg_err(format!("block size {} is below 2", cfg.block_size)));
        }
        if cfg.heads == 0
            || cfg.kv_heads == 0
            || !cfg.heads.is_multiple_of(cfg.kv_heads)
            || cfg.layers == 0
        {
            return Err(cfg_err("drafter head counts are inconsistent"));
        }
        Ok(cfg)
    }

    /// Checks the drafter fits a target of the given shape.
    pub fn check_target(&self, hidden: usize, layers: usize, vocab: usize) -> Result<()> {
        if self.hidden != hidden {
            return Err(cfg_err(format!(
                "the drafter's hidden size is {} but the target's is {hidden}",
                self.hidden
            )));
        }
        if let Some(bad) = self.target_layer_ids.iter().find(|&&l| l >= layers) {
            return Err(cfg_err(format!(
                "the drafter taps target layer {bad}, but the target has {layers} layers"
            )));
        }
        if let Some(n) = self.num_target_layers {
            if n != layers {
                return Err(cfg_err(format!(
                    "the drafter was made for a target with {n} layers; this one has {layers}"
                )));
            }
        }
        if self.mask_token_id as usize >= vocab {
            return Err(cfg_err(format!(
                "mask token {} is outside the target vocabulary of {vocab}",
                self.mask_token_id
            )));
        }
        Ok(())
    }
}

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
}

/// A DFlash drafter on backend `B`.
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
    /// Names of this drafter's captured graphs (context extension, drafting).
    graph_owner: [u64; 2],
}

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
        let cfg = DrafterConfig::read(dir)?;
        let src = SafetensorsDir::open(dir)?;
        Self::load(backend, cfg, &src)
    }

    /// Builds the drafter from tensors in `src`.
    pub fn load(backend: Arc<B>, cfg: DrafterConfig, src: &dyn TensorSource) -> Result<Self> {
        let b = &*backend;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let (qd, kvd) = (cfg.heads * hd, cfg.kv_heads * hd);
        let taps = cfg.target_layer_ids.len();
        let w = |n: &str, r: usize, c: usize| {
            load_matrix(b, src, &resolve(src, n), [r, c], WeightRole::Draft)
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
        };
        Ok(Self {
            fc: w("fc.weight", h, taps * h)?,
            hidden_norm: vec("hidden_norm.weight", h)?,
            norm: vec("norm.weight", h)?,
            layers,
            inv_freq: b.upload(&inv, 1, inv.len()),
            kv: b.kv_new(cfg.layers, kvd),
            rows: RowTable::default(),
            ws,
            ids: Vec::new(),
            meta: Vec::new(),
            sel_rows: Vec::new(),
            ctx_step: b.step_new(),
            draft_step: b.step_new(),
            graph_owner: [b.graph_owner(), b.graph_owner()],
            backend,
            cfg,
        })
    }

    fn shape(&self) -> AttnShape {
        AttnShape {
            n_heads: self.cfg.heads,
            n_kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
            scale: 1.0 / (self.cfg.head_dim as f32).sqrt(),
        }
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
        self.rows.close(row);
        self.backend.kv_release(&mut self.kv, row);
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
        let total: usize = rows.iter().map(|r| r.1).sum();
        if total != tap_rows.len() {
            return Err(ModelError::Config(format!(
                "drafter context: {total} positions but {} feature rows",
                tap_rows.len()
            )));
        }
        if total == 0 {
            return Ok(());
        }
        self.meta.clear();
        for &(row, n) in rows {
            let start = self.rows.len_of(row)?;
            self.ensure_capacity(row, start + n + self.cfg.block_size);
            self.meta
                .extend((0..n).map(|i| TokenMeta::causal(row as u32, (start + i) as u32)));
        }
        let backend = self.backend.clone();
        let b = &*backend;
        let ids = vec![0u32; total];
        b.step_upload(&mut self.ctx_step, &self.meta, &ids, tap_rows);
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
            for (t, cols) in [
                (&mut ws.feat, taps_width),
                (&mut ws.ctx, h),
                (&mut ws.k, kvd),
                (&mut ws.v, kvd),
            ] {
                b.reshape(t, total, cols);
            }
            let mut work = || {
                let ws = &mut self.ws;
                let meta = b.step_meta(&self.ctx_step);
                b.gather_step(taps, &self.ctx_step, &mut ws.feat);
                b.matmul(&ws.feat, &self.fc, &mut ws.ctx);
                b.rms_norm(&mut ws.ctx, &self.hidden_norm, eps, false, None);
                for (li, layer) in self.layers.iter().enumerate() {
                    b.matmul_many(
                        &ws.ctx,
                        &[&layer.wk, &layer.wv],
                        &mut [&mut ws.k, &mut ws.v],
                    );
                    b.rms_norm(&mut ws.k, &layer.k_norm, eps, false, None);
                    b.rope(
                        &mut ws.k,
                        meta,
                        &self.inv_freq,
                        self.cfg.head_dim,
                        RopeStyle::Neox,
                    );
                    b.kv_write(&mut self.kv, li, &ws.k, &ws.v, meta);
                }
            };
            if total <= GRAPH_MAX_TOKENS {
                b.graph(key, &mut work);
            } else {
                work();
            }
        });
        for &(row, n) in rows {
            let len = self.rows.len(row) + n;
            self.rows.set_len(row, len);
        }
        Ok(())
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
        self.ids.clear();
        self.meta.clear();
        self.sel_rows.clear();
        for &(row, first) in rows {
            let start = self.rows.len_of(row)?;
            self.ensure_capacity(row, start + block);
            for j in 0..block {
                self.ids.push(if j == 0 {
                    first
                } else {
                    self.cfg.mask_token_id
                });
                // Bidirectional inside the block: every slot sees the context and the whole block.
                self.meta.push(TokenMeta {
                    row: row as u32,
                    pos: (start + j) as u32,
                    kv_start: 0,
                    kv_end: (start + block) as u32,
                });
                if j > 0 {
                    self.sel_rows.push((self.ids.len() - 1) as u32);
                }
            }
        }
        let backend = self.backend.clone();
        let b = &*backend;
        b.step_upload(&mut self.draft_step, &self.meta, &self.ids, &self.sel_rows);
        let shape = self.shape();
        let eps = self.cfg.rms_eps;
        let hd = self.cfg.head_dim;
        let cfg = &self.cfg;
        let (t, s) = (self.ids.len(), self.sel_rows.len());
        let (h, qd, kvd) = (cfg.hidden, cfg.heads * hd, cfg.kv_heads * hd);
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
            // The head's width is known once it has run; a first call shapes it itself.
            if vocab > 0 {
                b.reshape(&mut ws.logits, s, vocab);
            }
            let mut work = || {
                let ws = &mut self.ws;
                let meta = b.step_meta(&self.draft_step);
                b.embed_step(embed, &self.draft_step, &mut ws.x);
                for (li, layer) in self.layers.iter().enumerate() {
                    b.rms_norm(&mut ws.x, &layer.input_norm, eps, false, Some(&mut ws.h));
                    b.matmul_many(
                        &ws.h,
                        &[&layer.wq, &layer.wk, &layer.wv],
                        &mut [&mut ws.q, &mut ws.k, &mut ws.v],
                    );
                    b.rms_norm(&mut ws.q, &layer.q_norm, eps, false, None);
                    b.rms_norm(&mut ws.k, &layer.k_norm, eps, false, None);
                    // Block K/V go just past the committed context; the context length is
                    // not advanced, so the next call overwrites them.
                    b.rope_kv_write(
                        &mut ws.q,
                        &mut ws.k,
                        &ws.v,
                        &mut self.kv,
                        li,
                        meta,
                        &self.inv_freq,
                        hd,
                        RopeStyle::Neox,
                    );
                    b.attention(&ws.q, &self.kv, li, meta, shape, &mut ws.att);
                    b.matmul_add(&ws.att, &layer.wo, &mut ws.x, &mut ws.o);
                    b.rms_norm(&mut ws.x, &layer.post_norm, eps, false, Some(&mut ws.h));
                    b.matmul_swiglu(&ws.h, &layer.w_gate, &layer.w_up, &mut ws.gate, &mut ws.up);
                    b.matmul_add(&ws.gate, &layer.w_down, &mut ws.x, &mut ws.o);
                }
                b.gather_step(&ws.x, &self.draft_step, &mut ws.sel);
                b.rms_norm(&mut ws.sel, &self.norm, eps, false, None);
                b.matmul(&ws.sel, lm_head, &mut ws.logits);
            };
            if t <= GRAPH_MAX_TOKENS {
                b.graph(key, &mut work);
            } else {
                work();
            }
        });
        Ok(())
    }

    fn logits(&self) -> &B::Tensor {
        &self.ws.logits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_tap_rule_matches_published_examples() {
        assert_eq!(build_target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(build_target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(build_target_layer_ids(40, 5), vec![1, 10, 19, 28, 37]);
        // 30 layers: 7.5 -> 8 and 20.5 -> 20 (half to even).
        assert_eq!(build_target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        assert_eq!(build_target_layer_ids(30, 1), vec![15]);
    }

    #[test]
    fn config_errors_are_specific() {
        let base = serde_json::json!({
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 1, "intermediate_size": 128, "block_size": 8,
            "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}
        });
        let cfg = DrafterConfig::from_json(&base).unwrap();
        assert_eq!(cfg.head_dim, 16);
        assert!(cfg.check_target(64, 4, 100).is_ok());
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(cfg.check_target(96, 4, 100)).contains("hidden size"));
        assert!(msg(cfg.check_target(64, 2, 100)).contains("taps target layer 2"));
        assert!(msg(cfg.check_target(64, 4, 5)).contains("mask token"));
        let mut no_mask = base.clone();
        no_mask["dflash_config"] = serde_json::json!({"target_layer_ids": [1]});
        assert!(DrafterConfig::from_json(&no_mask)
            .unwrap_err()
            .to_string()
            .contains("mask_token_id"));
    }
}
