//! Log-probabilities of generated tokens, as reported to API clients.
//!
//! They come from the target's raw logits at the token's position (a log-softmax before
//! penalties, temperature and filters, as OpenAI-compatible servers report them), so they do
//! not depend on how the token was chosen or on whether a drafter proposed it.

use serde::Serialize;

/// One generated token's log-probability and the most likely alternatives at its position.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// `(id, logprob)` of the most likely tokens, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `id` under `softmax(logits)` and the `top` most likely tokens.
pub fn token_logprob(logits: &[f32], id: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - log_z) as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && l <= best[top - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        id,
        logprob: logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_direct_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let want = |i: usize| ((logits[i] as f64).exp() / z).ln() as f32;
        let t = token_logprob(&logits, 2, 3);
        assert!((t.logprob - want(2)).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 2]);
        assert!((t.top[0].1 - want(1)).abs() < 1e-6);
        assert!(token_logprob(&logits, 0, 0).top.is_empty());
        let total: f64 = (0..4)
            .map(|i| (token_logprob(&logits, i, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
