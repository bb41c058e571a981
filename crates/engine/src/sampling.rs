//! Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, repetition,
//! frequency and presence penalties.
//!
//! [`SamplingParams::distribution`] gives the exact distribution a token is drawn from (also
//! used by speculative rejection sampling, which must apply the same processing to the
//! target's and the drafter's logits); [`Sampler`] draws from it with a seeded generator.

use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// How tokens are chosen.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches p (1: off).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of tokens already seen (1: off).
    pub repetition_penalty: f32,
    /// Subtract this times a token's count so far from its logit (0: off; OpenAI semantics,
    /// counted over the prompt and the output).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Subtract this from the logit of every token seen so far (0: off).
    #[serde(default)]
    pub presence_penalty: f32,
    pub seed: u64,
    /// Report the log-probability of every generated token with this many most likely
    /// alternatives (`None`: no log-probabilities). Does not change which tokens are chosen.
    #[serde(default)]
    pub logprobs: Option<usize>,
}

/// Temperatures below this are greedy decoding: `1 / t` would overflow `f32` near here (and
/// the distribution is a point mass on the argmax long before).
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Most alternatives a token's log-probability report may list.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
            logprobs: None,
        }
    }
}

/// Why sampling parameters were refused.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct InvalidParams(pub String);

/// A distribution over token ids: `(id, probability)` pairs whose probabilities sum to 1.
/// When a top-k/top-p/min-p filter was applied they are sorted by probability, descending,
/// with ties broken by lower id; otherwise they are in id order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dist {
    pub items: Vec<(u32, f32)>,
}

impl Dist {
    /// Probability of `id` (0 when filtered out).
    pub fn prob(&self, id: u32) -> f32 {
        self.items
            .iter()
            .find(|(i, _)| *i == id)
            .map_or(0.0, |(_, p)| *p)
    }

    /// Every token's probability indexed by id (0 for filtered-out ids; as long as the largest
    /// id kept plus one): for many lookups, where [`Dist::prob`] would search each time.
    pub fn probs_by_id(&self) -> Vec<f32> {
        let len = self.items.iter().map(|&(id, _)| id as usize + 1).max();
        let mut dense = vec![0f32; len.unwrap_or(0)];
        for &(id, p) in &self.items {
            dense[id as usize] = p;
        }
        dense
    }

    /// The token at cumulative mass `u` in `[0, 1)`.
    pub fn pick(&self, u: f32) -> u32 {
        let mut acc = 0f32;
        for &(id, p) in &self.items {
            acc += p;
            if u < acc {
                return id;
            }
        }
        self.items.last().map_or(0, |(id, _)| *id)
    }

    /// A single certain token.
    pub fn point(id: u32) -> Self {
        Self {
            items: vec![(id, 1.0)],
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Greedy decoding: temperature 0, or one so small that it is the argmax anyway
    /// ([`MIN_TEMPERATURE`]).
    pub fn is_greedy(&self) -> bool {
        self.temperature < MIN_TEMPERATURE
    }

    /// Checks ranges (negative temperature, top_p outside (0, 1], ...).
    pub fn validate(&self) -> Result<(), InvalidParams> {
        let bad = |m: &str| Err(InvalidParams(m.to_string()));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p must be in [0, 1]");
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad("repetition penalty must be a finite number > 0");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency penalty must be in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence penalty must be in [-2, 2]");
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(InvalidParams(format!(
                "at most {MAX_TOP_LOGPROBS} top log-probabilities can be reported"
            )));
        }
        Ok(())
    }

    /// Applies the repetition, frequency and presence penalties to `logits` in place for the
    /// ids in `history`.
    pub fn penalize(&self, logits: &mut [f32], history: &[u32]) {
        let repetition = self.repetition_penalty != 1.0;
        if !repetition && self.frequency_penalty == 0.0 && self.presence_penalty == 0.0 {
            return;
        }
        let mut counts = std::collections::HashMap::with_capacity(history.len());
        for &id in history {
            *counts.entry(id).or_insert(0u32) += 1;
        }
        for (id, n) in counts {
            if let Some(l) = logits.get_mut(id as usize) {
                if repetition {
                    *l = if *l > 0.0 {
                        *l / self.repetition_penalty
                    } else {
                        *l * self.repetition_penalty
                    };
                }
                *l -= self.frequency_penalty * n as f32 + self.presence_penalty;
            }
        }
    }

    /// The distribution a token is drawn from, given raw logits and the ids seen so far.
    /// `scratch` is reused between calls. Greedy gives a point mass on the argmax.
    pub fn distribution(&self, logits: &[f32], history: &[u32], scratch: &mut Vec<f32>) -> Dist {
        scratch.clear();
        scratch.extend_from_slice(logits);
        self.penalize(scratch, history);
        if self.is_greedy() {
            return Dist::point(argmax(scratch));
        }
        let inv_t = 1.0 / self.temperature;
        let max = scratch.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut items: Vec<(u32, f32)> = Vec::new();
        let mut total = 0f32;
        for (i, &l) in scratch.iter().enumerate() {
            let e = ((l - max) * inv_t).exp();
            total += e;
            if e > 0.0 {
                items.push((i as u32, e));
            }
        }
        for it in &mut items {
            it.1 /= total;
        }
        if self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0 {
            // No filter needs the order: keep id order and skip sorting the vocabulary.
            return Dist { items };
        }
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        // Only the head of the distribution survives top-k/top-p/min-p; sort just that much.
        let keep_hint = if self.top_k > 0 { self.top_k } else { 1024 };
        if items.len() > keep_hint && (self.top_k > 0 || self.top_p < 1.0) {
            items.select_nth_unstable_by(keep_hint - 1, by_prob);
            let head_mass: f32 = items[..keep_hint].iter().map(|x| x.1).sum();
            if self.top_k > 0 || head_mass >= self.top_p {
                items.truncate(keep_hint);
            }
        }
        items.sort_unstable_by(by_prob);
        if self.top_k > 0 {
            items.truncate(self.top_k);
        }
        if self.top_p < 1.0 {
            let mass: f64 = items.iter().map(|x| x.1 as f64).sum();
            let mut acc = 0f64;
            let mut keep = items.len();
            for (i, it) in items.iter().enumerate() {
                acc += it.1 as f64;
                if acc >= self.top_p as f64 * mass {
                    keep = i + 1;
                    break;
                }
            }
            items.truncate(keep.max(1));
        }
        if self.min_p > 0.0 {
            let floor = items.first().map_or(0.0, |x| x.1) * self.min_p;
            items.retain(|x| x.1 >= floor);
        }
        let mass: f32 = items.iter().map(|x| x.1).sum();
        for it in &mut items {
            it.1 /= mass;
        }
        Dist { items }
    }
}

/// Index of the largest value (the first on ties).
pub fn argmax(x: &[f32]) -> u32 {
    dflash_runtime::cpu::ops::elementwise::argmax(x)
}

/// A seeded source of uniform draws, one per row.
pub struct Sampler {
    rng: rand::rngs::StdRng,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        }
    }

    /// A uniform draw in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// Draws from `dist` (no randomness consumed for a point mass).
    pub fn sample(&mut self, dist: &Dist) -> u32 {
        if dist.items.len() == 1 {
            return dist.items[0].0;
        }
        let u = self.uniform();
        dist.pick(u)
    }
}

#[cfg(test)]
mod tests;
