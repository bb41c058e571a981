//! Softmax attention of one query head over a slice of its row's KV cache.

use super::dot;

/// Attends query head `q` (`head_dim` values) to keys/values at positions `start..end` of one
/// row (`k`, `v`: position-major with `kv_dim` values per position, this head's slice starting
/// at `head_off`). Writes the `head_dim` outputs to `out`; `scores` is scratch space.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    kv_dim: usize,
    head_off: usize,
    start: usize,
    end: usize,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let hd = q.len();
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for j in start..end {
        let key = &k[j * kv_dim + head_off..j * kv_dim + head_off + hd];
        let s = dot(q, key) * scale;
        max = max.max(s);
        scores.push(s);
    }
    out.fill(0.0);
    if scores.is_empty() {
        return;
    }
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    for (idx, j) in (start..end).enumerate() {
        let p = scores[idx];
        let val = &v[j * kv_dim + head_off..j * kv_dim + head_off + hd];
        for (o, &x) in out.iter_mut().zip(val) {
            *o = p.mul_add(x, *o);
        }
    }
    let inv = 1.0 / sum;
    for o in out.iter_mut() {
        *o *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_equal_keys_average() {
        let q = [1.0f32, 0.0];
        let k = [0.5f32, 0.5, 0.5, 0.5];
        let v = [1.0f32, 2.0, 3.0, 4.0];
        let mut scores = Vec::new();
        let mut out = [0f32; 2];
        attend(&q, &k, &v, 2, 0, 0, 1, 1.0, &mut scores, &mut out);
        assert_eq!(out, [1.0, 2.0]);
        attend(&q, &k, &v, 2, 0, 0, 2, 1.0, &mut scores, &mut out);
        assert!((out[0] - 2.0).abs() < 1e-6 && (out[1] - 3.0).abs() < 1e-6);
    }
}
