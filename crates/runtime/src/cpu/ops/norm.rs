//! RMS normalisation (plain and zero-centred), over groups of columns.

use super::sum_squares;

/// Normalises every `weight.len()`-column group of `x` (rows of `cols`) into `out`.
/// `out` may alias nothing; use [`rms_norm_inplace`] to normalise in place.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, zero_centred: bool, out: &mut [f32]) {
    let dim = weight.len();
    for (xs, os) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let inv = 1.0 / (sum_squares(xs) / dim as f32 + eps).sqrt();
        for ((o, &v), &w) in os.iter_mut().zip(xs).zip(weight) {
            let w = if zero_centred { 1.0 + w } else { w };
            *o = w * (v * inv);
        }
    }
}

/// In-place variant of [`rms_norm`].
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32, zero_centred: bool) {
    let dim = weight.len();
    for xs in x.chunks_exact_mut(dim) {
        let inv = 1.0 / (sum_squares(xs) / dim as f32 + eps).sqrt();
        for (v, &w) in xs.iter_mut().zip(weight) {
            let w = if zero_centred { 1.0 + w } else { w };
            *v = w * (*v * inv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalises_to_unit_rms_then_scales() {
        let x = [3.0f32, 4.0, 0.0, 0.0];
        let w = [1.0f32, 2.0, 1.0, 1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, false, &mut out);
        let rms = (25.0f32 / 4.0).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6);
        assert!((out[1] - 8.0 / rms).abs() < 1e-6);
        let mut y = x;
        rms_norm_inplace(&mut y, &[0.0, 1.0, 0.0, 0.0], 0.0, true);
        assert!((y[0] - 3.0 / rms).abs() < 1e-6);
        assert!((y[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn groups_are_normalised_separately() {
        let x = [1.0f32, 1.0, 10.0, 10.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &[1.0, 1.0], 0.0, false, &mut out);
        for v in out {
            assert!((v - 1.0).abs() < 1e-6);
        }
    }
}
