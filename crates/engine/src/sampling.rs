//! Turning logits into tokens: greedy, temperature, top-k, top-p, min-p, repetition,
//! frequency and presence penalties.
//!
//! [`SamplingParams::distribution`] gives the exact distribution a token is drawn from (also
//! used by speculative rejection sampling, which must apply the same processing to the
//! target's and the drafter's logits); [`Dist::pick`] takes the token at a cumulative mass;
//! [`Sampler`] draws the uniforms from a seeded generator, exactly one per sampled token.
//!
//! This host code is the definition the device token choice (`Backend::sample_rows` and
//! friends) reproduces. Its sums run in f64 over f32 terms (the softmax total, the masses of
//! top-p and of the renormalisation, the running mass of `pick`), so their rounding no longer
//! grows with the vocabulary: a device summing in another order agrees to about 1e-7 on every
//! cumulative mass, and a different token only where the uniform lies that close to a
//! boundary between two tokens. The exponential is taken in f64 and rounded to f32, which is
//! the correctly rounded value on every libm and on the GPU but for rare last-bit cases, so
//! the probabilities and their order agree too.

use dflash_runtime::choice::ChoiceParams;
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
    /// alternatives (`None`: no log-probabilities; [`crate::Batch`] computes them from the
    /// kept logits). Does not change which tokens are chosen.
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Copy the logits behind every chosen token to the host, for the caller
    /// (`Decoder::token_logits`, e.g. for log-probabilities). Such rows choose on the host.
    #[serde(default)]
    pub keep_logits: bool,
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
            keep_logits: false,
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

    /// The token at cumulative mass `u` in `[0, 1)`: the first item whose running mass (an
    /// f64 sum of the f32 probabilities, in list order) exceeds `u`; when rounding leaves
    /// the total at or below `u`, the last item of positive probability.
    pub fn pick(&self, u: f32) -> u32 {
        let u = u as f64;
        let mut acc = 0f64;
        let mut last = None;
        for &(id, p) in &self.items {
            if p > 0.0 {
                acc += p as f64;
                if u < acc {
                    return id;
                }
                last = Some(id);
            }
        }
        last.or(self.items.last().map(|x| x.0)).unwrap_or(0)
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
    ///
    /// The definition, step by step: penalise; `e = exp((l - max) * (1 / T))` (the argument in
    /// f32, exp in f64 rounded to f32); keep
    /// ids with `e > 0`; `p = e / total` with `total` the f64 sum of every `e`; without a
    /// filter, the items in id order. With one: sort by probability (descending, ties by lower
    /// id); top-k keeps the first k; top-p keeps the shortest head whose running f64 mass
    /// reaches `top_p` times the f64 mass of what top-k kept (at least one item); min-p keeps
    /// items of at least `min_p` times the first; then every probability is divided by the
    /// f64 mass of what is left.
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
        let mut total = 0f64;
        for (i, &l) in scratch.iter().enumerate() {
            // exp in f64, rounded to f32: the correctly rounded value (but for about one
            // argument in 10^8) on any libm and on the GPU alike.
            let e = (((l - max) * inv_t) as f64).exp() as f32;
            total += e as f64;
            if e > 0.0 {
                items.push((i as u32, e));
            }
        }
        for it in &mut items {
            it.1 = (it.1 as f64 / total) as f32;
        }
        if self.top_k == 0 && self.top_p >= 1.0 && self.min_p <= 0.0 {
            // No filter needs the order: keep id order and skip sorting the vocabulary.
            return Dist { items };
        }
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_p = self.top_p < 1.0;
        // The mass top-p is measured against: everything top-k keeps (all when it is off).
        let top_p_mass = if top_p && self.top_k == 0 {
            Some(items.iter().map(|x| x.1 as f64).sum::<f64>())
        } else {
            None
        };
        // Only the head of the distribution survives top-k/top-p/min-p; sort just that much.
        let keep_hint = if self.top_k > 0 { self.top_k } else { 1024 };
        if items.len() > keep_hint && (self.top_k > 0 || top_p) {
            items.select_nth_unstable_by(keep_hint - 1, by_prob);
            let head_mass: f64 = items[..keep_hint].iter().map(|x| x.1 as f64).sum();
            // (A margin far above the f64 rounding of either sum.)
            let head_reaches =
                top_p_mass.is_some_and(|m| head_mass >= self.top_p as f64 * m * (1.0 + 1e-9));
            if self.top_k > 0 || head_reaches {
                items.truncate(keep_hint);
            }
        }
        items.sort_unstable_by(by_prob);
        if self.top_k > 0 {
            items.truncate(self.top_k);
        }
        if top_p {
            let mass = top_p_mass.unwrap_or_else(|| items.iter().map(|x| x.1 as f64).sum());
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
        let mass: f64 = items.iter().map(|x| x.1 as f64).sum();
        for it in &mut items {
            it.1 = (it.1 as f64 / mass) as f32;
        }
        Dist { items }
    }

    /// Whether a row with these parameters reads its logits only for the position of the
    /// largest (greedy, nothing that changes logits before the choice, nothing that reports
    /// them), so a target may compute the others approximately (`RowStep::argmax_only`).
    /// Every field is named here: a new option must say whether it reads the logits.
    pub fn argmax_only(&self) -> bool {
        let SamplingParams {
            temperature: _,
            // Filters keep the most likely token, so a greedy choice ignores them.
            top_k: _,
            top_p: _,
            min_p: _,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            seed: _,
            logprobs,
            keep_logits,
        } = self;
        self.is_greedy()
            && *repetition_penalty == 1.0
            && *frequency_penalty == 0.0
            && *presence_penalty == 0.0
            && logprobs.is_none()
            && !*keep_logits
    }

    /// These parameters in the device token choice's terms; `None` when the device cannot
    /// honour them (the row's logits are wanted on the host), so the row chooses on the host.
    /// Every field is named here: a new sampling option must say whether the device
    /// implements it (or return `None` when it is active).
    pub fn device(&self) -> Option<ChoiceParams> {
        let SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            seed: _,
            keep_logits,
            // Reported from kept logits (`crate::Batch` sets `keep_logits` for them).
            logprobs: _,
        } = self;
        // Frequency and presence penalties are host-only.
        if *keep_logits || *frequency_penalty != 0.0 || *presence_penalty != 0.0 {
            return None;
        }
        Some(ChoiceParams {
            // Temperatures below MIN_TEMPERATURE are greedy on the host; the same on the device.
            temperature: if self.is_greedy() { 0.0 } else { *temperature },
            top_k: u32::try_from(*top_k).unwrap_or(u32::MAX),
            top_p: *top_p,
            min_p: *min_p,
            repetition_penalty: *repetition_penalty,
        })
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

    /// Draws from `dist` with one uniform (also for a point mass, so that every sampled token
    /// consumes exactly one draw, wherever it is chosen).
    pub fn sample(&mut self, dist: &Dist) -> u32 {
        let u = self.uniform();
        dist.pick(u)
    }
}

#[cfg(test)]
mod tests;
