//! Llama-family model configuration, read from GGUF metadata or an HF `config.json`.

use dflash_runtime::backend::RopeStyle;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::source::gguf::GgufFile;

/// The Llama-family architectures we run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
}

impl Arch {
    pub const SUPPORTED: &'static str = "llama (Llama, SmolLM2), qwen2, qwen3";

    fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" | "LlamaForCausalLM" | "smollm" => Ok(Arch::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Arch::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture {
                arch: other.to_string(),
                supported: Arch::SUPPORTED.to_string(),
            }),
        }
    }
}

/// Llama-3 style RoPE frequency scaling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: f32,
}

/// Shapes and constants of a Llama-family network.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3Scaling>,
    pub rope_style: RopeStyle,
    pub context_length: usize,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_embeddings: bool,
}

impl LlamaConfig {
    /// Checks the shapes are consistent.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.hidden == 0 || self.layers == 0 || self.heads == 0 || self.kv_heads == 0 {
            return bad("model config has a zero dimension".into());
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim > 512 {
            return bad(format!("head dimension {} is not supported", self.head_dim));
        }
        if self.context_length == 0 {
            return bad("context length is zero".into());
        }
        Ok(())
    }

    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies (`head_dim / 2` values), with Llama-3 scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        rope_inv_freq(self.rope_theta, self.head_dim, self.rope_scaling)
    }

    /// Reads the config of a GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch_name = f.str("general.architecture")?;
        let arch = Arch::from_name(arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let hidden = f.u64(&key("embedding_length"))? as usize;
        let heads = f.u64(&key("attention.head_count"))? as usize;
        let kv_heads = f
            .opt_u64(&key("attention.head_count_kv"))?
            .map_or(heads, |v| v as usize);
        let head_dim = match f.opt_u64(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None if heads > 0 => hidden / heads,
            None => 0,
        };
        let vocab = match f.opt_u64(&key("vocab_size"))? {
            Some(v) => v as usize,
            None => f.str_array("tokenizer.ggml.tokens")?.len(),
        };
        let rope_scaling = match f.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
            Some("llama3") => Some(Llama3Scaling {
                factor: f.f64(&key("rope.scaling.factor"))? as f32,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: f.f64(&key("rope.scaling.original_context_length"))? as f32,
            }),
            Some("none") | None => None,
            Some(other) => {
                return Err(ModelError::BadMetadata {
                    key: key("rope.scaling.type"),
                    reason: format!("RoPE scaling `{other}` is not supported"),
                })
            }
        };
        let cfg = LlamaConfig {
            arch,
            hidden,
            layers: f.u64(&key("block_count"))? as usize,
            heads,
            kv_heads,
            head_dim,
            intermediate: f.u64(&key("feed_forward_length"))? as usize,
            vocab,
            rms_eps: f.f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            rope_theta: f.opt_f64(&key("rope.freq_base"))?.unwrap_or(10000.0) as f32,
            rope_scaling,
            // GGUF llama files store q/k permuted for interleaved RoPE; qwen files do not.
            rope_style: if arch == Arch::Llama {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Neox
            },
            context_length: f.u64(&key("context_length"))? as usize,
            qkv_bias: f.has_tensor("blk.0.attn_q.bias"),
            qk_norm: f.has_tensor("blk.0.attn_q_norm.weight"),
            tied_embeddings: !f.has_tensor("output.weight"),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads an HF `config.json` value.
    pub fn from_hf_json(v: &Value) -> Result<Self> {
        let arch_name = v
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .or_else(|| v.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| ModelError::Config("config.json names no architecture".into()))?;
        let arch = Arch::from_name(arch_name)?;
        let usize_field = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| ModelError::Config(format!("config.json: `{k}` is missing")))
        };
        let hidden = usize_field("hidden_size")?;
        let heads = usize_field("num_attention_heads")?;
        let kv_heads = usize_field("num_key_value_heads").unwrap_or(heads);
        let head_dim = v
            .get("head_dim")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(hidden.checked_div(heads).unwrap_or(0));
        let rope_params = v.get("rope_parameters").or_else(|| v.get("rope_scaling"));
        let rope_theta = v
            .get("rope_theta")
            .or_else(|| rope_params.and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32;
        let rope_scaling = match rope_params {
            Some(p) if !p.is_null() => {
                let kind = p
                    .get("rope_type")
                    .or_else(|| p.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => None,
                    "llama3" => {
                        let f =
                            |k: &str, d: f64| p.get(k).and_then(Value::as_f64).unwrap_or(d) as f32;
                        Some(Llama3Scaling {
                            factor: f("factor", 8.0),
                            low_freq_factor: f("low_freq_factor", 1.0),
                            high_freq_factor: f("high_freq_factor", 4.0),
                            original_context: f("original_max_position_embeddings", 8192.0),
                        })
                    }
                    other => {
                        return Err(ModelError::Config(format!(
                            "config.json: RoPE scaling `{other}` is not supported"
                        )))
                    }
                }
            }
            _ => None,
        };
        let cfg = LlamaConfig {
            arch,
            hidden,
            layers: usize_field("num_hidden_layers")?,
            heads,
            kv_heads,
            head_dim,
            intermediate: usize_field("intermediate_size")?,
            vocab: usize_field("vocab_size")?,
            rms_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            rope_style: RopeStyle::Neox,
            context_length: usize_field("max_position_embeddings").unwrap_or(4096),
            qkv_bias: arch == Arch::Qwen2
                || v.get("attention_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            qk_norm: arch == Arch::Qwen3,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// RoPE inverse frequencies `theta^(-2i/dim)` for `i < dim/2`, computed in f32 as HF does,
/// with optional Llama-3 wavelength-dependent scaling.
pub fn rope_inv_freq(theta: f32, dim: usize, scaling: Option<Llama3Scaling>) -> Vec<f32> {
    let base: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
        .collect();
    let Some(s) = scaling else { return base };
    let low_wavelen = s.original_context / s.low_freq_factor;
    let high_wavelen = s.original_context / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen > low_wavelen {
                f / s.factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth = (s.original_context / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_freq_plain_and_scaled() {
        let f = rope_inv_freq(10000.0, 8, None);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0], 1.0);
        assert!((f[2] - 10000f32.powf(-0.5)).abs() < 1e-7);
        let s = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192.0,
        };
        let scaled = rope_inv_freq(500000.0, 128, Some(s));
        let plain = rope_inv_freq(500000.0, 128, None);
        // High frequencies unchanged, lowest divided by the factor.
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
    }

    #[test]
    fn hf_config_parses_and_rejects_unknown_architectures() {
        let v: Value = serde_json::json!({
            "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
            "intermediate_size": 128, "vocab_size": 100, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "max_position_embeddings": 512
        });
        let c = LlamaConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert!(c.qk_norm && c.tied_embeddings && !c.qkv_bias);
        assert_eq!(c.kv_dim(), 32);
        let mut bad = v.clone();
        bad["architectures"] = serde_json::json!(["MambaForCausalLM"]);
        let err = LlamaConfig::from_hf_json(&bad).unwrap_err();
        assert!(err.to_string().contains("MambaForCausalLM"));
        let mut bad = v;
        bad["num_key_value_heads"] = serde_json::json!(3);
        assert!(LlamaConfig::from_hf_json(&bad).is_err());
    }
}
