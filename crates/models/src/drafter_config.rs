//! A drafter's `config.json`: the typed DFlash / DFlash2 fields, how a directory says which of
//! the two it holds, and the checks that turn a bad or inconsistent file into a clear error.
//!
//! Both published formats are Qwen3-style configs. DFlash-specific fields may sit at the top
//! level or inside `dflash_config`; as in the reference (`_draft_value`), `dflash_config`
//! wins. A DFlash2 drafter (`DFlash2DraftModel`) adds a grouped dynamic convolution
//! (`conv_kernel_size`, `conv_group_size`) and a candidate selector (`selector_rank`,
//! `selector_top_k`), and usually sliding-window, non-causal layers.

use std::path::Path;

use serde::Deserialize;

use crate::error::{ModelError, Result};

/// Which drafter architecture a directory holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrafterKind {
    /// `DFlashDraftModel`: block drafts are the argmax (or samples) of each slot's logits.
    Dflash,
    /// `DFlash2DraftModel`: convolutions around every sublayer and a candidate selector.
    Dflash2,
}

/// How one drafter layer's block queries attend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerAttention {
    /// Keys further than this from the query (either side) are hidden; `None`: no window.
    pub window: Option<usize>,
    /// A query sees no later block slot.
    pub causal: bool,
}

impl LayerAttention {
    /// Every committed context position and the whole block.
    pub const FULL: Self = Self {
        window: None,
        causal: false,
    };

    /// Key positions `start..end` visible to the query at `pos` of a block ending (exclusive)
    /// at `block_end`, as the reference's `_attention_mask` builds them.
    pub fn visible(&self, pos: usize, block_end: usize) -> (usize, usize) {
        let mut end = if self.causal { pos + 1 } else { block_end };
        let mut start = 0;
        if let Some(w) = self.window {
            start = (pos + 1).saturating_sub(w);
            if !self.causal {
                end = end.min(pos + w);
            }
        }
        (start, end)
    }
}

/// The DFlash2 additions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Dflash2Params {
    /// Taps of the grouped dynamic causal convolution.
    pub conv_kernel_size: usize,
    /// Channels sharing one dynamic coefficient.
    pub conv_group_size: usize,
    /// Width of the selector's codebooks.
    pub selector_rank: usize,
    /// Candidates per slot (the top-k of the transformed logits).
    pub selector_top_k: usize,
    /// Rows of the selector's codebooks (the vocabulary the drafter was made for).
    pub vocab_size: usize,
    /// Logits are multiplied by this before the selector sees them.
    pub output_multiplier: f32,
    /// `cap * tanh(logits / cap)` after the multiplier, when set.
    pub final_logit_softcapping: Option<f32>,
}

impl Dflash2Params {
    /// Whether [`Self::transform`] returns every logit unchanged (no multiplier, no cap).
    pub fn transform_is_identity(&self) -> bool {
        self.output_multiplier == 1.0 && self.final_logit_softcapping.is_none()
    }

    /// The selector's view of a logit: multiplier, then the optional soft cap.
    pub fn transform(&self, logit: f32) -> f32 {
        let x = logit * self.output_multiplier;
        match self.final_logit_softcapping {
            Some(cap) => (x / cap).tanh() * cap,
            None => x,
        }
    }
}

/// Largest draft block a drafter config may declare. Published DFlash drafters use 16; every
/// slot costs a verify position per row per round, so blocks of hundreds are a corrupt or
/// hostile config, not a drafter.
pub const MAX_BLOCK_SIZE: usize = 64;

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
    /// The block's embeddings are multiplied by this (1 in every published DFlash drafter).
    pub input_embedding_scale: f32,
    /// Per layer, how block queries attend.
    pub attention: Vec<LayerAttention>,
    /// Present for DFlash2 drafters.
    pub dflash2: Option<Dflash2Params>,
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

/// Fields that may sit at the top level or in `dflash_config`.
#[derive(Clone, Debug, Default, Deserialize)]
struct DflashFields {
    block_size: Option<usize>,
    mask_token_id: Option<u32>,
    target_layer_ids: Option<Vec<usize>>,
    conv_kernel_size: Option<usize>,
    conv_group_size: Option<usize>,
    selector_rank: Option<usize>,
    selector_top_k: Option<usize>,
    output_multiplier: Option<f64>,
    final_logit_softcapping: Option<f64>,
    input_embedding_scale: Option<f64>,
}

impl DflashFields {
    /// `self` (from `dflash_config`) with gaps filled from `top`.
    fn or(self, top: DflashFields) -> DflashFields {
        DflashFields {
            block_size: self.block_size.or(top.block_size),
            mask_token_id: self.mask_token_id.or(top.mask_token_id),
            target_layer_ids: self.target_layer_ids.or(top.target_layer_ids),
            conv_kernel_size: self.conv_kernel_size.or(top.conv_kernel_size),
            conv_group_size: self.conv_group_size.or(top.conv_group_size),
            selector_rank: self.selector_rank.or(top.selector_rank),
            selector_top_k: self.selector_top_k.or(top.selector_top_k),
            output_multiplier: self.output_multiplier.or(top.output_multiplier),
            final_logit_softcapping: self.final_logit_softcapping.or(top.final_logit_softcapping),
            input_embedding_scale: self.input_embedding_scale.or(top.input_embedding_scale),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
struct RopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
struct RopeParameters {
    rope_theta: Option<f64>,
    rope_type: Option<String>,
}

/// `config.json` as written by transformers / the z-lab exports (unknown keys are ignored).
#[derive(Clone, Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    num_target_layers: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RopeParameters>,
    rope_scaling: Option<RopeScaling>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    vocab_size: Option<usize>,
    layer_types: Option<Vec<String>>,
    sliding_window: Option<usize>,
    is_causal: Option<bool>,
    dflash_config: Option<DflashFields>,
    #[serde(flatten)]
    top: DflashFields,
}

fn cfg_err(m: impl Into<String>) -> ModelError {
    ModelError::IncompatibleDrafter(m.into())
}

fn finite(name: &str, v: Option<f64>, default: f64) -> Result<f32> {
    let v = v.unwrap_or(default);
    if !v.is_finite() {
        return Err(cfg_err(format!(
            "config.json: `{name}` must be a finite number"
        )));
    }
    Ok(v as f32)
}

impl RawConfig {
    fn kind(&self, f: &DflashFields) -> Result<DrafterKind> {
        let v2_fields = [
            ("conv_kernel_size", f.conv_kernel_size.is_some()),
            ("conv_group_size", f.conv_group_size.is_some()),
            ("selector_rank", f.selector_rank.is_some()),
            ("selector_top_k", f.selector_top_k.is_some()),
        ];
        let present: Vec<&str> = v2_fields.iter().filter(|x| x.1).map(|x| x.0).collect();
        let missing: Vec<&str> = v2_fields.iter().filter(|x| !x.1).map(|x| x.0).collect();
        let arch = self.architectures.as_deref().unwrap_or(&[]);
        let says_v2 = arch.iter().any(|a| a == "DFlash2DraftModel");
        let says_v1 = arch.iter().any(|a| a == "DFlashDraftModel");
        if let Some(other) = arch
            .iter()
            .find(|a| *a != "DFlash2DraftModel" && *a != "DFlashDraftModel")
        {
            return Err(ModelError::UnsupportedArchitecture {
                arch: other.clone(),
                supported: "DFlashDraftModel, DFlash2DraftModel".into(),
            });
        }
        if says_v1 && says_v2 {
            return Err(cfg_err(
                "config.json names both DFlashDraftModel and DFlash2DraftModel",
            ));
        }
        if says_v2 || (!says_v1 && !present.is_empty()) {
            if !missing.is_empty() {
                return Err(cfg_err(format!(
                    "config.json describes a DFlash2 drafter but lacks {}",
                    missing.join(", ")
                )));
            }
            return Ok(DrafterKind::Dflash2);
        }
        if !present.is_empty() {
            return Err(cfg_err(format!(
                "config.json names DFlashDraftModel but has DFlash2 fields ({}); a DFlash2 \
                 drafter must name DFlash2DraftModel",
                present.join(", ")
            )));
        }
        Ok(DrafterKind::Dflash)
    }

    /// Per-layer attention: explicit top-level `is_causal` wins; else sliding layers are
    /// causal (the reference's rule). DFlash (v1) drafters keep every layer full and
    /// bidirectional, as the DFlash reference does.
    fn attention(&self, kind: DrafterKind, layers: usize) -> Result<Vec<LayerAttention>> {
        let types = match &self.layer_types {
            None => return Ok(vec![LayerAttention::FULL; layers]),
            Some(t) => t,
        };
        if types.len() != layers {
            return Err(cfg_err(format!(
                "config.json: `layer_types` has {} entries for {layers} layers",
                types.len()
            )));
        }
        let mut out = Vec::with_capacity(layers);
        for t in types {
            let sliding = match t.as_str() {
                "full_attention" => false,
                "sliding_attention" => true,
                other => {
                    return Err(cfg_err(format!(
                        "config.json: layer type `{other}` is not supported (full_attention, \
                         sliding_attention)"
                    )))
                }
            };
            if kind == DrafterKind::Dflash {
                if sliding {
                    tracing::warn!(
                        "DFlash drafter has sliding-window layers; they attend to the whole \
                         context, as the DFlash reference does"
                    );
                }
                out.push(LayerAttention::FULL);
                continue;
            }
            let window = if sliding {
                match self.sliding_window {
                    Some(w) if w > 0 => Some(w),
                    _ => {
                        return Err(cfg_err(
                            "config.json: sliding layers need a positive `sliding_window`",
                        ))
                    }
                }
            } else {
                None
            };
            out.push(LayerAttention {
                window,
                causal: self.is_causal.unwrap_or(sliding),
            });
        }
        Ok(out)
    }
}

impl DrafterConfig {
    /// Reads `config.json` of a drafter directory.
    pub fn read(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        Self::from_json_str(&text)
            .map_err(|e| cfg_err(format!("{}: {}", cfg_path.display(), strip(e))))
    }

    /// Parses the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| cfg_err(format!("config.json is not valid JSON: {e}")))?;
        Self::from_json(&v)
    }

    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        let raw: RawConfig =
            serde_json::from_value(v.clone()).map_err(|e| cfg_err(format!("config.json: {e}")))?;
        let f = raw
            .dflash_config
            .clone()
            .unwrap_or_default()
            .or(raw.top.clone());
        let kind = raw.kind(&f)?;
        let req = |name: &str, x: Option<usize>| {
            x.ok_or_else(|| cfg_err(format!("config.json: `{name}` is missing")))
        };
        let hidden = req("hidden_size", raw.hidden_size)?;
        let heads = req("num_attention_heads", raw.num_attention_heads)?;
        let layers = req("num_hidden_layers", raw.num_hidden_layers)?;
        let intermediate = req("intermediate_size", raw.intermediate_size)?;
        let mask_token_id = f
            .mask_token_id
            .ok_or_else(|| cfg_err("config.json: `dflash_config.mask_token_id` is missing"))?;
        let target_layer_ids = match f.target_layer_ids.clone() {
            Some(ids) => ids,
            None => {
                let n_target = raw.num_target_layers.ok_or_else(|| {
                    cfg_err("config.json gives neither `target_layer_ids` nor `num_target_layers`")
                })?;
                build_target_layer_ids(n_target, layers)
            }
        };
        if target_layer_ids.is_empty() {
            return Err(cfg_err("`target_layer_ids` is empty"));
        }
        if raw.attention_bias == Some(true) {
            return Err(cfg_err("drafters with attention biases are not supported"));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(cfg_err(format!(
                "drafter activation `{act}` is not supported (silu)"
            )));
        }
        let scaling = raw
            .rope_scaling
            .as_ref()
            .map(|s| s.rope_type.clone().or(s.kind.clone()).unwrap_or_default());
        let params_kind = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.clone());
        if let Some(k) = [scaling, params_kind]
            .into_iter()
            .flatten()
            .find(|k| k != "default")
        {
            return Err(cfg_err(format!(
                "drafter RoPE scaling `{k}` is not supported"
            )));
        }
        let rope_theta = raw
            .rope_theta
            .or(raw.rope_parameters.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(10000.0) as f32;
        let output_multiplier = finite("output_multiplier", f.output_multiplier, 1.0)?;
        let softcap = match f.final_logit_softcapping {
            Some(c) if c.is_finite() && c > 0.0 => Some(c as f32),
            Some(c) if c != 0.0 => {
                return Err(cfg_err(format!(
                    "config.json: `final_logit_softcapping` must be positive (or 0/null for \
                     none), not {c}"
                )))
            }
            _ => None,
        };
        let input_embedding_scale = finite("input_embedding_scale", f.input_embedding_scale, 1.0)?;
        let dflash2 = match kind {
            DrafterKind::Dflash => {
                if output_multiplier != 1.0 || softcap.is_some() {
                    return Err(cfg_err(
                        "`output_multiplier` / `final_logit_softcapping` are only supported for \
                         DFlash2 drafters (their selector applies them)",
                    ));
                }
                None
            }
            DrafterKind::Dflash2 => Some(Dflash2Params {
                conv_kernel_size: f.conv_kernel_size.unwrap_or(0),
                conv_group_size: f.conv_group_size.unwrap_or(0),
                selector_rank: f.selector_rank.unwrap_or(0),
                selector_top_k: f.selector_top_k.unwrap_or(0),
                vocab_size: req("vocab_size", raw.vocab_size)?,
                output_multiplier,
                final_logit_softcapping: softcap,
            }),
        };
        let cfg = DrafterConfig {
            block_size: f.block_size.unwrap_or(16),
            mask_token_id,
            target_layer_ids,
            num_target_layers: raw.num_target_layers,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads: raw.num_key_value_heads.unwrap_or(heads),
            head_dim: raw
                .head_dim
                .unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
            rms_eps: finite("rms_norm_eps", raw.rms_norm_eps, 1e-6)?,
            rope_theta,
            input_embedding_scale,
            attention: raw.attention(kind, layers)?,
            dflash2,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Which architecture this is.
    pub fn kind(&self) -> DrafterKind {
        if self.dflash2.is_some() {
            DrafterKind::Dflash2
        } else {
            DrafterKind::Dflash
        }
    }

    /// Internal consistency (also for configurations built in code).
    pub fn validate(&self) -> Result<()> {
        if !(2..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return Err(cfg_err(format!(
                "config.json: block_size {} is outside 2..={MAX_BLOCK_SIZE}",
                self.block_size
            )));
        }
        if self.heads == 0
            || self.kv_heads == 0
            || !self.heads.is_multiple_of(self.kv_heads)
            || self.layers == 0
            || self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
        {
            return Err(cfg_err("drafter head counts are inconsistent"));
        }
        if self.attention.len() != self.layers {
            return Err(cfg_err(format!(
                "{} layer attention entries for {} layers",
                self.attention.len(),
                self.layers
            )));
        }
        if let Some(p) = &self.dflash2 {
            if p.conv_kernel_size == 0 || p.conv_kernel_size > self.block_size {
                return Err(cfg_err(format!(
                    "`conv_kernel_size` {} must be between 1 and the block size {}",
                    p.conv_kernel_size, self.block_size
                )));
            }
            if p.conv_group_size == 0 || !self.hidden.is_multiple_of(p.conv_group_size) {
                return Err(cfg_err(format!(
                    "`conv_group_size` {} must divide the hidden size {}",
                    p.conv_group_size, self.hidden
                )));
            }
            if p.selector_rank == 0 {
                return Err(cfg_err("`selector_rank` must be at least 1"));
            }
            if p.selector_top_k == 0 || p.selector_top_k > p.vocab_size {
                return Err(cfg_err(format!(
                    "`selector_top_k` {} must be between 1 and the vocabulary size {}",
                    p.selector_top_k, p.vocab_size
                )));
            }
        }
        Ok(())
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
        if let Some(p) = &self.dflash2 {
            if p.vocab_size < vocab {
                return Err(cfg_err(format!(
                    "the drafter's selector covers {} tokens but the target's vocabulary has \
                     {vocab}",
                    p.vocab_size
                )));
            }
        }
        Ok(())
    }
}

/// serde's messages start with the full text of the error; keep them short.
fn strip(e: ModelError) -> String {
    match e {
        ModelError::IncompatibleDrafter(m) => m,
        other => other.to_string(),
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

    fn v1() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "block_size": 8,
            "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]}
        })
    }

    /// The published DFlash2 layout (Qwen3.8-27B drafter config, shrunk).
    fn v2() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DFlash2DraftModel"],
            "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
            "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 2048,
            "is_causal": false, "rope_theta": 10000000.0,
            "dflash_config": {
                "block_size": 8, "mask_token_id": 5, "target_layer_ids": [1, 2],
                "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32,
                "selector_top_k": 16
            }
        })
    }

    fn err(v: &serde_json::Value) -> String {
        DrafterConfig::from_json(v).unwrap_err().to_string()
    }

    #[test]
    fn config_errors_are_specific() {
        let cfg = DrafterConfig::from_json(&v1()).unwrap();
        assert_eq!(cfg.kind(), DrafterKind::Dflash);
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.attention, vec![LayerAttention::FULL; 2]);
        assert!(cfg.check_target(64, 4, 100).is_ok());
        let msg = |r: Result<()>| r.unwrap_err().to_string();
        assert!(msg(cfg.check_target(96, 4, 100)).contains("hidden size"));
        assert!(msg(cfg.check_target(64, 2, 100)).contains("taps target layer 2"));
        assert!(msg(cfg.check_target(64, 4, 5)).contains("mask token"));
        let mut no_mask = v1();
        no_mask["dflash_config"] = serde_json::json!({"target_layer_ids": [1]});
        assert!(err(&no_mask).contains("mask_token_id"));
        let mut bad_type = v1();
        bad_type["num_hidden_layers"] = "two".into();
        assert!(
            err(&bad_type).contains("invalid type"),
            "{}",
            err(&bad_type)
        );
        let mut capped = v1();
        capped["final_logit_softcapping"] = 30.0.into();
        assert!(err(&capped).contains("only supported for DFlash2"));
    }

    #[test]
    fn dflash2_fields_are_read_from_either_place() {
        let cfg = DrafterConfig::from_json(&v2()).unwrap();
        assert_eq!(cfg.kind(), DrafterKind::Dflash2);
        let p = cfg.dflash2.unwrap();
        assert_eq!(
            (
                p.conv_kernel_size,
                p.conv_group_size,
                p.selector_rank,
                p.selector_top_k
            ),
            (2, 16, 32, 16)
        );
        assert_eq!(p.vocab_size, 100);
        assert_eq!(
            cfg.attention,
            vec![
                LayerAttention {
                    window: Some(2048),
                    causal: false
                };
                2
            ]
        );
        assert_eq!(cfg.rope_theta, 1e7);
        // Top-level fields, dflash_config winning where both are given.
        let mut top = v2();
        top["selector_rank"] = 8.into();
        top["output_multiplier"] = 0.5.into();
        top["final_logit_softcapping"] = 30.into();
        top["dflash_config"]
            .as_object_mut()
            .unwrap()
            .remove("selector_top_k");
        top["selector_top_k"] = 4.into();
        let p = DrafterConfig::from_json(&top).unwrap().dflash2.unwrap();
        assert_eq!((p.selector_rank, p.selector_top_k), (32, 4));
        assert_eq!(p.output_multiplier, 0.5);
        assert_eq!(p.final_logit_softcapping, Some(30.0));
        assert!((p.transform(60.0) - 30.0 * 1f32.tanh()).abs() < 1e-6);
        // No architectures entry: the DFlash2 fields decide.
        let mut bare = v2();
        bare.as_object_mut().unwrap().remove("architectures");
        assert_eq!(
            DrafterConfig::from_json(&bare).unwrap().kind(),
            DrafterKind::Dflash2
        );
        // Without an explicit is_causal, sliding layers are causal (the reference's rule).
        let mut implicit = v2();
        implicit.as_object_mut().unwrap().remove("is_causal");
        assert!(DrafterConfig::from_json(&implicit).unwrap().attention[0].causal);
    }

    #[test]
    fn inconsistent_dflash2_configs_are_refused() {
        let mut partial = v2();
        partial["dflash_config"]
            .as_object_mut()
            .unwrap()
            .remove("selector_rank");
        assert!(
            err(&partial).contains("lacks selector_rank"),
            "{}",
            err(&partial)
        );
        let mut mixed = v2();
        mixed["architectures"] = serde_json::json!(["DFlashDraftModel"]);
        assert!(err(&mixed).contains("has DFlash2 fields"));
        let mut both = v2();
        both["architectures"] = serde_json::json!(["DFlashDraftModel", "DFlash2DraftModel"]);
        assert!(err(&both).contains("names both"));
        let mut other = v2();
        other["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        assert!(err(&other).contains("LlamaForCausalLM"));
        let mut group = v2();
        group["dflash_config"]["conv_group_size"] = 24.into();
        assert!(err(&group).contains("must divide the hidden size"));
        let mut taps = v2();
        taps["dflash_config"]["conv_kernel_size"] = 9.into();
        assert!(err(&taps).contains("conv_kernel_size"));
        let mut topk = v2();
        topk["dflash_config"]["selector_top_k"] = 101.into();
        assert!(err(&topk).contains("selector_top_k"));
        let mut no_vocab = v2();
        no_vocab.as_object_mut().unwrap().remove("vocab_size");
        assert!(err(&no_vocab).contains("vocab_size"));
        let mut no_window = v2();
        no_window["sliding_window"] = serde_json::Value::Null;
        assert!(err(&no_window).contains("sliding_window"));
        let mut types = v2();
        types["layer_types"] = serde_json::json!(["sliding_attention"]);
        assert!(err(&types).contains("layer_types"));
        let mut kind = v2();
        kind["layer_types"] = serde_json::json!(["linear_attention", "full_attention"]);
        assert!(err(&kind).contains("linear_attention"));
        let mut cap = v2();
        cap["final_logit_softcapping"] = (-1.0).into();
        assert!(err(&cap).contains("final_logit_softcapping"));
        let mut act = v2();
        act["hidden_act"] = "gelu".into();
        assert!(err(&act).contains("gelu"));
        let cfg = DrafterConfig::from_json(&v2()).unwrap();
        assert!(cfg
            .check_target(64, 4, 120)
            .unwrap_err()
            .to_string()
            .contains("selector covers 100"));
    }

    #[test]
    fn windows_and_causality_give_key_ranges() {
        let w = LayerAttention {
            window: Some(3),
            causal: false,
        };
        // Block 10..14: position 11 sees 9..14 (keys within 3 on either side, block end).
        assert_eq!(w.visible(11, 14), (9, 14));
        assert_eq!(w.visible(1, 14), (0, 4));
        let c = LayerAttention {
            window: Some(3),
            causal: true,
        };
        assert_eq!(c.visible(11, 14), (9, 12));
        assert_eq!(LayerAttention::FULL.visible(11, 14), (0, 14));
    }
}
