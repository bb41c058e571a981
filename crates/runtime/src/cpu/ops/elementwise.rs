//! Element-wise ops: SiLU-gated product, residual add, argmax.

/// `gate[i] = silu(gate[i]) * up[i]`, with silu(x) = x / (1 + e^-x).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Index of the largest value (the first on ties); NaNs are never chosen over numbers.
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_matches_definition() {
        let mut g = [0.0f32, 1.0, -2.0];
        silu_mul(&mut g, &[1.0, 2.0, 3.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
        assert!((g[2] - 3.0 * -2.0 / (1.0 + 2f32.exp())).abs() < 1e-6);
    }

    #[test]
    fn argmax_takes_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
    }
}
