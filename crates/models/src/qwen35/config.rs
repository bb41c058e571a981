//! Qwen 3.5 hybrid configuration, read from an HF `config.json` (the text-only
//! `Qwen3_5ForCausalLM` form or the `Qwen3_5ForConditionalGeneration` wrapper with
//! `text_config`) or from GGUF `qwen35` metadata, into one validated [`Qwen35Config`].
//!
//! The JSON is deserialised into typed structs that reject unknown fields, so a field this
//! loader does not understand is an error naming it rather than silently ignored.

use dflash_runtime::GdnShape;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::Value;

use crate::config::rope_inv_freq;
use crate::error::{ModelError, Result};
use crate::source::gguf::GgufFile;

/// The kind of token mixer of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet.
    LinearAttention,
    /// Gated full attention.
    FullAttention,
}

/// Shapes and constants of a Qwen 3.5 text model.
#[derive(Clone, Debug, PartialEq)]
pub struct Qwen35Config {
    pub hidden: usize,
    pub kinds: Vec<LayerKind>,
    pub intermediate: usize,
    pub vocab: usize,
    /// Full-attention heads.
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Rotated dimensions of each head (`head_dim * partial_rotary_factor`).
    pub rot_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    /// GDN shapes; `tiled_heads` is set for GGUF files, whose converter (llama.cpp's)
    /// reorders the v heads of every GDN tensor from grouped to tiled order.
    pub gdn: GdnShape,
    pub context_length: usize,
    pub tied_embeddings: bool,
}

fn bad(msg: impl Into<String>) -> ModelError {
    ModelError::Config(msg.into())
}

impl Qwen35Config {
    pub fn layers(&self) -> usize {
        self.kinds.len()
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies of the rotated dimensions.
    pub fn inv_freq(&self) -> Vec<f32> {
        rope_inv_freq(self.rope_theta, self.rot_dim, None)
    }

    /// Checks that the shapes fit together.
    pub fn validate(&self) -> Result<()> {
        let g = &self.gdn;
        let dims = [
            self.hidden,
            self.intermediate,
            self.vocab,
            self.heads,
            self.kv_heads,
            self.head_dim,
            g.k_heads,
            g.v_heads,
            g.k_dim,
            g.v_dim,
            g.conv_kernel,
        ];
        if dims.contains(&0) || self.kinds.is_empty() {
            return Err(bad("Qwen 3.5 config has a zero dimension"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.heads, self.kv_heads
            )));
        }
        if !g.v_heads.is_multiple_of(g.k_heads) {
            return Err(bad(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                g.v_heads, g.k_heads
            )));
        }
        if self.rot_dim == 0 || !self.rot_dim.is_multiple_of(2) || self.rot_dim > self.head_dim {
            return Err(bad(format!(
                "rotary dimension {} does not fit head_dim {} (it must be even and at most \
                 head_dim)",
                self.rot_dim, self.head_dim
            )));
        }
        let inner = [
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("attention heads x head_dim", self.heads * self.head_dim),
            ("linear value dim", g.value_dim()),
        ];
        if let Some((what, n)) = inner.iter().find(|(_, n)| !n.is_multiple_of(32)) {
            return Err(bad(format!(
                "{what} {n} is not a multiple of 32 (matrix rows are read in 32-value groups)"
            )));
        }
        if self.head_dim > 512 {
            return Err(bad(format!(
                "head dimension {} is not supported",
                self.head_dim
            )));
        }
        if self.context_length == 0 {
            return Err(bad("context length is zero"));
        }
        Ok(())
    }

    /// Reads an HF `config.json` value.
    pub fn from_hf_json(v: &Value) -> Result<Self> {
        let parse_err = |what: &str, e: serde_json::Error| bad(format!("config.json{what}: {e}"));
        let (text, outer_tie) = if v.get("text_config").is_some() {
            let w: HfWrapper = serde_json::from_value(v.clone()).map_err(|e| parse_err("", e))?;
            check_arch(w.architectures.as_deref(), w.model_type.as_deref())?;
            let text: HfText =
                serde_json::from_value(w.text_config).map_err(|e| parse_err(" text_config", e))?;
            (text, w.tie_word_embeddings)
        } else {
            let text: HfText = serde_json::from_value(v.clone()).map_err(|e| parse_err("", e))?;
            check_arch(text.architectures.as_deref(), text.model_type.as_deref())?;
            (text, None)
        };
        text.into_config(outer_tie)
    }

    /// Reads GGUF `qwen35` metadata; `is_linear(i)` says whether layer i holds GDN tensors.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f.str("general.architecture")?;
        if arch != "qwen35" {
            return Err(ModelError::UnsupportedArchitecture {
                arch: arch.to_string(),
                supported: "qwen35".into(),
            });
        }
        let key = |k: &str| format!("qwen35.{k}");
        let u = |k: &str| -> Result<usize> { Ok(f.u64(&key(k))? as usize) };
        let layers = u("block_count")?;
        let mut kinds = Vec::with_capacity(layers);
        for i in 0..layers {
            let linear = f.has_tensor(&format!("blk.{i}.ssm_a"));
            let full = f.has_tensor(&format!("blk.{i}.attn_q.weight"));
            kinds.push(match (linear, full) {
                (true, false) => LayerKind::LinearAttention,
                (false, true) => LayerKind::FullAttention,
                _ => {
                    return Err(bad(format!(
                        "GGUF layer {i} must hold either GDN tensors (blk.{i}.ssm_a) or \
                         attention tensors (blk.{i}.attn_q.weight), exactly one of them"
                    )))
                }
            });
        }
        if let Some(interval) = f.opt_u64(&key("full_attention_interval"))? {
            let interval = interval as usize;
            let want = interval_kinds(layers, interval)?;
            if want != kinds {
                return Err(ModelError::BadMetadata {
                    key: key("full_attention_interval"),
                    reason: format!(
                        "interval {interval} disagrees with the layers' tensors ({})",
                        describe(&kinds)
                    ),
                });
            }
        }
        let heads = u("attention.head_count")?;
        let head_dim = u("attention.key_length")?;
        if let Some(vl) = f.opt_u64(&key("attention.value_length"))? {
            if vl as usize != head_dim {
                return Err(ModelError::BadMetadata {
                    key: key("attention.value_length"),
                    reason: format!("{vl} differs from the key length {head_dim}"),
                });
            }
        }
        let v_heads = u("ssm.time_step_rank")?;
        let inner = u("ssm.inner_size")?;
        if v_heads == 0 || !inner.is_multiple_of(v_heads) {
            return Err(ModelError::BadMetadata {
                key: key("ssm.inner_size"),
                reason: format!("{inner} is not a multiple of ssm.time_step_rank {v_heads}"),
            });
        }
        let vocab = match f.opt_u64(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => f.str_array("tokenizer.ggml.tokens")?.len(),
        };
        let cfg = Qwen35Config {
            hidden: u("embedding_length")?,
            kinds,
            intermediate: u("feed_forward_length")?,
            vocab,
            heads,
            kv_heads: f
                .opt_u64(&key("attention.head_count_kv"))?
                .map_or(heads, |v| v as usize),
            head_dim,
            rot_dim: u("rope.dimension_count")?,
            rope_theta: f.opt_f64(&key("rope.freq_base"))?.unwrap_or(10000.0) as f32,
            rms_eps: f.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            gdn: GdnShape {
                k_heads: u("ssm.group_count")?,
                v_heads,
                k_dim: u("ssm.state_size")?,
                v_dim: inner / v_heads,
                conv_kernel: u("ssm.conv_kernel")?,
                tiled_heads: true,
            },
            context_length: u("context_length")?,
            tied_embeddings: !f.has_tensor("output.weight"),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

fn describe(kinds: &[LayerKind]) -> String {
    kinds
        .iter()
        .map(|k| match k {
            LayerKind::LinearAttention => 'L',
            LayerKind::FullAttention => 'F',
        })
        .collect()
}

/// Layer kinds from `full_attention_interval`: layer i is full attention iff (i+1) % n == 0.
fn interval_kinds(layers: usize, interval: usize) -> Result<Vec<LayerKind>> {
    if interval == 0 {
        return Err(bad("full_attention_interval is zero"));
    }
    Ok((0..layers)
        .map(|i| {
            if (i + 1).is_multiple_of(interval) {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect())
}

fn check_arch(architectures: Option<&[String]>, model_type: Option<&str>) -> Result<()> {
    const ARCHS: [&str; 2] = ["Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"];
    const TYPES: [&str; 2] = ["qwen3_5", "qwen3_5_text"];
    if let Some(a) = architectures.and_then(|a| a.first()) {
        if !ARCHS.contains(&a.as_str()) {
            return Err(ModelError::UnsupportedArchitecture {
                arch: a.clone(),
                supported: ARCHS.join(", "),
            });
        }
    }
    if let Some(t) = model_type {
        if !TYPES.contains(&t) {
            return Err(bad(format!(
                "config.json: model_type `{t}` is not a Qwen 3.5 text model ({})",
                TYPES.join(", ")
            )));
        }
    }
    Ok(())
}

/// Whether an HF `config.json` describes a Qwen 3.5 model (used by the resolver).
pub fn is_qwen35_json(v: &Value) -> bool {
    let arch = v
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    let ty = v.get("model_type").and_then(Value::as_str);
    matches!(
        arch,
        Some("Qwen3_5ForConditionalGeneration" | "Qwen3_5ForCausalLM")
    ) || matches!(ty, Some("qwen3_5" | "qwen3_5_text"))
}

/// The `Qwen3_5ForConditionalGeneration` wrapper: the text model is in `text_config`; the
/// vision tower is not run.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HfWrapper {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    text_config: Value,
    #[serde(rename = "vision_config")]
    _vision_config: Option<IgnoredAny>,
    tie_word_embeddings: Option<bool>,
    #[serde(rename = "image_token_id")]
    _image_token_id: Option<IgnoredAny>,
    #[serde(rename = "video_token_id")]
    _video_token_id: Option<IgnoredAny>,
    #[serde(rename = "vision_start_token_id")]
    _vision_start_token_id: Option<IgnoredAny>,
    #[serde(rename = "vision_end_token_id")]
    _vision_end_token_id: Option<IgnoredAny>,
    #[serde(rename = "transformers_version")]
    _transformers_version: Option<IgnoredAny>,
    #[serde(rename = "torch_dtype", alias = "dtype")]
    _dtype: Option<IgnoredAny>,
}

/// `rope_parameters` (transformers 5) of a Qwen 3.5 text config.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct HfRope {
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    /// Multimodal RoPE sections: with text-only positions (the same id in every section) the
    /// rotation is ordinary RoPE; checked for consistency only.
    mrope_section: Option<Vec<usize>>,
    #[serde(rename = "mrope_interleaved")]
    _mrope_interleaved: Option<bool>,
}

/// `Qwen3_5TextConfig` fields. Defaults are transformers' where a checkpoint may omit a field.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HfText {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    #[serde(default = "d_head_dim")]
    head_dim: usize,
    hidden_act: Option<String>,
    #[serde(default = "d_ctx")]
    max_position_embeddings: usize,
    #[serde(default = "d_eps")]
    rms_norm_eps: f64,
    tie_word_embeddings: Option<bool>,
    rope_parameters: Option<HfRope>,
    /// Older configs: RoPE fields at the top level.
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "d_conv")]
    linear_conv_kernel_dim: usize,
    #[serde(default = "d_lin_dim")]
    linear_key_head_dim: usize,
    #[serde(default = "d_lin_dim")]
    linear_value_head_dim: usize,
    #[serde(default = "d_k_heads")]
    linear_num_key_heads: usize,
    #[serde(default = "d_v_heads")]
    linear_num_value_heads: usize,
    layer_types: Option<Vec<LayerKind>>,
    full_attention_interval: Option<usize>,
    /// Present in official configs (true); the gate is always part of the architecture.
    attn_output_gate: Option<bool>,
    /// Present in official configs ("float32"); the recurrent state is always kept in f32.
    mamba_ssm_dtype: Option<String>,
    #[serde(rename = "mtp_num_hidden_layers")]
    _mtp_num_hidden_layers: Option<IgnoredAny>,
    #[serde(rename = "mtp_use_dedicated_embeddings")]
    _mtp_use_dedicated_embeddings: Option<IgnoredAny>,
    #[serde(rename = "initializer_range")]
    _initializer_range: Option<IgnoredAny>,
    #[serde(rename = "attention_dropout")]
    _attention_dropout: Option<IgnoredAny>,
    #[serde(rename = "use_cache")]
    _use_cache: Option<IgnoredAny>,
    #[serde(rename = "pad_token_id")]
    _pad_token_id: Option<IgnoredAny>,
    #[serde(rename = "bos_token_id")]
    _bos_token_id: Option<IgnoredAny>,
    #[serde(rename = "eos_token_id")]
    _eos_token_id: Option<IgnoredAny>,
    #[serde(rename = "transformers_version")]
    _transformers_version: Option<IgnoredAny>,
    #[serde(rename = "torch_dtype", alias = "dtype")]
    _dtype: Option<IgnoredAny>,
}

fn d_head_dim() -> usize {
    256
}
fn d_ctx() -> usize {
    32768
}
fn d_eps() -> f64 {
    1e-6
}
fn d_conv() -> usize {
    4
}
fn d_lin_dim() -> usize {
    128
}
fn d_k_heads() -> usize {
    16
}
fn d_v_heads() -> usize {
    32
}

impl HfText {
    fn into_config(self, outer_tie: Option<bool>) -> Result<Qwen35Config> {
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(bad(format!(
                    "config.json: hidden_act `{act}` is not supported (Qwen 3.5 uses silu)"
                )));
            }
        }
        if self.attention_bias {
            return Err(bad(
                "config.json: attention_bias true is not a Qwen 3.5 layout",
            ));
        }
        if self.attn_output_gate == Some(false) {
            return Err(bad(
                "config.json: attn_output_gate false is not supported (Qwen 3.5 gates attention)",
            ));
        }
        if let Some(d) = &self.mamba_ssm_dtype {
            if d != "float32" {
                return Err(bad(format!(
                    "config.json: mamba_ssm_dtype `{d}` is not supported (the state is kept in \
                     float32)"
                )));
            }
        }
        let kinds = match (&self.layer_types, self.full_attention_interval) {
            (Some(t), interval) => {
                if t.len() != self.num_hidden_layers {
                    return Err(bad(format!(
                        "config.json: layer_types lists {} layers, num_hidden_layers is {}",
                        t.len(),
                        self.num_hidden_layers
                    )));
                }
                if let Some(n) = interval {
                    if interval_kinds(t.len(), n)? != *t {
                        return Err(bad(format!(
                            "config.json: layer_types ({}) disagrees with full_attention_interval {n}",
                            describe(t)
                        )));
                    }
                }
                t.clone()
            }
            (None, n) => interval_kinds(self.num_hidden_layers, n.unwrap_or(4))?,
        };
        let rope = self.rope_parameters.unwrap_or_default();
        match rope.rope_type.as_deref() {
            None | Some("default") => {}
            Some(other) => {
                return Err(bad(format!(
                    "config.json: RoPE type `{other}` is not supported for Qwen 3.5"
                )))
            }
        }
        let theta = rope.rope_theta.or(self.rope_theta).unwrap_or(10000.0);
        let factor = rope
            .partial_rotary_factor
            .or(self.partial_rotary_factor)
            .unwrap_or(0.25);
        let rot_dim = (self.head_dim as f64 * factor) as usize;
        if let Some(sec) = &rope.mrope_section {
            let sum: usize = sec.iter().sum();
            if sum != rot_dim / 2 {
                return Err(bad(format!(
                    "config.json: mrope_section {sec:?} sums to {sum}, not to the {} rotary \
                     frequencies of head_dim {} x partial_rotary_factor {factor}",
                    rot_dim / 2,
                    self.head_dim
                )));
            }
        }
        let tied = match (outer_tie, self.tie_word_embeddings) {
            (Some(a), Some(b)) if a != b => {
                return Err(bad(format!(
                    "config.json: tie_word_embeddings is {a} at the top level but {b} in \
                     text_config"
                )))
            }
            (a, b) => a.or(b).unwrap_or(false),
        };
        let cfg = Qwen35Config {
            hidden: self.hidden_size,
            kinds,
            intermediate: self.intermediate_size,
            vocab: self.vocab_size,
            heads: self.num_attention_heads,
            kv_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            rot_dim,
            rope_theta: theta as f32,
            rms_eps: self.rms_norm_eps as f32,
            gdn: GdnShape {
                k_heads: self.linear_num_key_heads,
                v_heads: self.linear_num_value_heads,
                k_dim: self.linear_key_head_dim,
                v_dim: self.linear_value_head_dim,
                conv_kernel: self.linear_conv_kernel_dim,
                tiled_heads: false,
            },
            context_length: self.max_position_embeddings,
            tied_embeddings: tied,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Value {
        serde_json::json!({
            "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
            "vocab_size": 100, "hidden_size": 64, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                "mrope_interleaved": true},
            "tie_word_embeddings": true
        })
    }

    #[test]
    fn text_and_wrapper_forms_parse_to_the_same_config() {
        let c = Qwen35Config::from_hf_json(&tiny()).unwrap();
        assert_eq!(c.rot_dim, 4);
        assert_eq!(describe(&c.kinds), "LLLF");
        assert!(c.tied_embeddings);
        let mut text = tiny();
        text.as_object_mut().unwrap().remove("architectures");
        let wrapper = serde_json::json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text, "vision_config": {"depth": 2}, "image_token_id": 5
        });
        assert_eq!(Qwen35Config::from_hf_json(&wrapper).unwrap(), c);
    }

    #[test]
    fn unknown_and_inconsistent_fields_are_errors() {
        let cases: [(&str, Value, &str); 6] = [
            (
                "unknown",
                serde_json::json!(7),
                "unknown field `frobnicate`",
            ),
            (
                "layer_types",
                serde_json::json!(["linear_attention"]),
                "layer_types lists 1",
            ),
            (
                "linear_num_value_heads",
                serde_json::json!(3),
                "not a multiple",
            ),
            ("hidden_act", serde_json::json!("gelu"), "gelu"),
            ("full_attention_interval", serde_json::json!(2), "disagrees"),
            ("mamba_ssm_dtype", serde_json::json!("bfloat16"), "bfloat16"),
        ];
        for (field, value, want) in cases {
            let mut v = tiny();
            if field == "unknown" {
                v["frobnicate"] = value;
            } else {
                v[field] = value;
            }
            if field == "full_attention_interval" {
                v["layer_types"] = serde_json::json!([
                    "linear_attention",
                    "linear_attention",
                    "linear_attention",
                    "full_attention"
                ]);
            }
            let err = Qwen35Config::from_hf_json(&v).unwrap_err().to_string();
            assert!(err.contains(want), "{field}: {err}");
        }
        let mut v = tiny();
        v["rope_parameters"]["mrope_section"] = serde_json::json!([2, 2, 2]);
        assert!(Qwen35Config::from_hf_json(&v)
            .unwrap_err()
            .to_string()
            .contains("mrope_section"));
    }
}
