//! Element and block formats of stored tensors, with the GGML type ids GGUF files use.

use std::fmt;

/// A stored tensor format. Block formats pack `block_len()` values into `block_bytes()` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q4K,
    Q6K,
}

impl DType {
    /// Every format the runtime reads.
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4K,
        DType::Q6K,
    ];

    /// Number of values in one block (1 for plain floats).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => 32,
            DType::Q4K | DType::Q6K => 256,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            DType::Q4K => 144,
            DType::Q6K => 210,
        }
    }

    /// Bytes used by a row of `cols` values, or `None` when `cols` is not a whole number of blocks.
    pub const fn row_bytes(self, cols: usize) -> Option<usize> {
        if !cols.is_multiple_of(self.block_len()) {
            return None;
        }
        Some(cols / self.block_len() * self.block_bytes())
    }

    /// The GGML type id used in GGUF tensor infos.
    pub const fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q4K => 12,
            DType::Q6K => 14,
            DType::BF16 => 30,
        }
    }

    /// The format for a GGML type id, if the runtime supports it.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_id() == id)
    }

    /// The name GGML uses for a type id, also for types we do not support (for error messages).
    pub fn ggml_name(id: u32) -> &'static str {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16",
        ];
        NAMES.get(id as usize).copied().unwrap_or("unknown")
    }

    /// True for the GGUF block-quantized formats.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q8_0 => "Q8_0",
            DType::Q4K => "Q4_K",
            DType::Q6K => "Q6_K",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::from_ggml_id(d.ggml_id()), Some(d));
        }
        assert_eq!(DType::from_ggml_id(6), None);
        assert_eq!(DType::ggml_name(6), "Q5_0");
    }

    #[test]
    fn row_bytes_requires_whole_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(64), Some(40));
        assert_eq!(DType::Q4_1.row_bytes(48), None);
        assert_eq!(DType::Q6K.row_bytes(512), Some(420));
        assert_eq!(DType::BF16.row_bytes(3), Some(6));
    }
}
