//! How a KV cache holds keys and values ([`KvType`]), the same for every backend: f32, or f16
//! rounded to nearest even once when written and widened exactly when read (llama.cpp's default
//! cache type), so every query that reads a position reads the same bits.

use std::fmt;
use std::str::FromStr;

use half::f16;

use crate::error::RuntimeError;

/// The environment variable that picks a backend's [`KvType`] (`f16` or `f32`; unset: the backend's default).
pub const ENV: &str = "DFLASH_KV_CACHE";

/// How a KV cache holds keys and values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// Half precision: half the bytes; values beyond ±65504 become infinite.
    #[default]
    F16,
    /// Single precision: the values as computed.
    F32,
}

impl KvType {
    /// The type `DFLASH_KV_CACHE` asks for (unset: the default, the CPU's).
    pub fn from_env() -> Result<KvType, RuntimeError> {
        Self::from_env_or(KvType::default())
    }

    /// The type `DFLASH_KV_CACHE` asks for, or `default` where it is unset or empty.
    pub fn from_env_or(default: KvType) -> Result<KvType, RuntimeError> {
        match std::env::var(ENV) {
            Ok(v) if !v.is_empty() => v.parse(),
            _ => Ok(default),
        }
    }

    /// The value a cache of this type holds for `x` (as read back).
    pub fn round(self, x: f32) -> f32 {
        match self {
            KvType::F16 => f16::from_f32(x).to_f32(),
            KvType::F32 => x,
        }
    }

    /// Bytes of one stored value.
    pub fn bytes(self) -> usize {
        match self {
            KvType::F16 => 2,
            KvType::F32 => 4,
        }
    }
}

impl FromStr for KvType {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            other => Err(RuntimeError::Device(format!(
                "{ENV}={other:?}: expected f16 or f32"
            ))),
        }
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
        })
    }
}
