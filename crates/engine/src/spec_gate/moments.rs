//! Moving moments of one kind of round at one batch size, and the decoding rate they give
//! once the prompt pieces the rounds carried are charged at their own cost.
//!
//! A round's time is modelled as `a + c * q`: `a` the decoding part (draft, verify forward
//! and commit of the live rows), `q` the prompt-piece tokens that rode in its forward and `c`
//! what one such token adds. `c` is one number for the whole gate, fitted by least squares
//! within each group (a group: one batch-size bucket and one kind of round, each with its own
//! `a`) and pooled over the groups, so any group whose rounds carry varying amounts of prompt
//! informs it. A token's marginal cost lies between 0 (a memory-bound forward, where extra
//! tokens ride free) and the forward's mean time per token (a forward with no fixed part), so
//! the fit is clamped to that range per group; while no group has varied `q` it is 0 and a
//! round is charged whole.

use super::Round;

/// Weight of the newest round in the moving moments.
pub(super) const SMOOTHING: f64 = 0.3;

/// Below this variance of prompt tokens per round (tokens²) a group's rounds carried the same
/// prompt work: it says nothing about that work's cost.
const MIN_VARIANCE: f64 = 1.0;

/// Exponentially weighted moments of one group's rounds.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Moments {
    rounds: usize,
    committed: f64,
    seconds: f64,
    /// Forward tokens (the live rows' plus the prompt pieces).
    tokens: f64,
    prompt: f64,
    prompt_sq: f64,
    prompt_seconds: f64,
}

impl Moments {
    /// Rounds recorded so far.
    pub fn rounds(&self) -> usize {
        self.rounds
    }

    pub fn add(&mut self, r: &Round) {
        let q = r.prompt_tokens as f64;
        let new = [
            r.committed as f64,
            r.seconds,
            r.tokens.max(1) as f64,
            q,
            q * q,
            q * r.seconds,
        ];
        let w = if self.rounds == 0 { 1.0 } else { SMOOTHING };
        let old = [
            &mut self.committed,
            &mut self.seconds,
            &mut self.tokens,
            &mut self.prompt,
            &mut self.prompt_sq,
            &mut self.prompt_seconds,
        ];
        for (m, x) in old.into_iter().zip(new) {
            *m += w * (x - *m);
        }
        self.rounds += 1;
    }

    /// The weighted variance of prompt tokens per round and their covariance with the
    /// round's seconds, or `None` while the prompt work did not vary.
    fn spread(&self) -> Option<(f64, f64)> {
        let var = self.prompt_sq - self.prompt * self.prompt;
        (var >= MIN_VARIANCE).then_some((var, self.prompt_seconds - self.prompt * self.seconds))
    }

    /// Committed tokens per second of decoding, prompt tokens charged at `cost` seconds each
    /// (at most the mean round's seconds per forward token).
    pub fn rate(&self, cost: f64) -> f64 {
        let cost = cost.clamp(0.0, self.seconds / self.tokens);
        let decoding = self.seconds - cost * self.prompt;
        if decoding > 0.0 {
            self.committed / decoding
        } else {
            f64::INFINITY
        }
    }
}

/// Seconds one prompt token adds to a round: the least-squares slope of round time on prompt
/// tokens within each group, pooled over `groups` (`Σ cov / Σ var`); 0 while none varied.
pub(super) fn prompt_cost<'a>(groups: impl Iterator<Item = &'a Moments>) -> f64 {
    let (cov, var) = groups
        .filter_map(Moments::spread)
        .fold((0.0, 0.0), |(c, v), (var, cov)| (c + cov, v + var));
    if var > 0.0 {
        (cov / var).max(0.0)
    } else {
        0.0
    }
}
