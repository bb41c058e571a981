//! Rotary position embeddings at per-token positions.

use crate::backend::RopeStyle;

/// Rotates the first `2 * inv_freq.len()` dimensions of every `head_dim` head of one token's
/// vector `x` at position `pos`. Angles are `pos · inv_freq[i]` in f32, as HF computes them.
pub fn rope_token(x: &mut [f32], pos: u32, inv_freq: &[f32], head_dim: usize, style: RopeStyle) {
    let half = inv_freq.len();
    let mut cos = [0f32; 256];
    let mut sin = [0f32; 256];
    assert!(half <= 256, "rotary dimension above 512 is not supported");
    for i in 0..half {
        let angle = pos as f32 * inv_freq[i];
        cos[i] = angle.cos();
        sin[i] = angle.sin();
    }
    for head in x.chunks_exact_mut(head_dim) {
        match style {
            RopeStyle::Neox => {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let inv: Vec<f32> = (0..4)
            .map(|i| 10000f32.powf(-(2 * i) as f32 / 8.0))
            .collect();
        let orig: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let mut x = orig.clone();
            rope_token(&mut x, 0, &inv, 8, style);
            assert_eq!(x, orig);
            rope_token(&mut x, 17, &inv, 8, style);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
        }
    }

    #[test]
    fn neox_pairs_i_with_i_plus_half() {
        // One frequency of 1 rad per position, head of 2 dims: a plain 2-D rotation.
        let mut x = [1.0f32, 0.0];
        rope_token(&mut x, 1, &[1.0], 2, RopeStyle::Neox);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
    }
}
