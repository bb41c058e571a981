//! Moving measurements of one kind of round at one batch size, and the decoding rate they
//! give.
//!
//! A round's decoding cost is its wall time without the prompt pieces of joining rows that
//! rode in its forward. Rounds that carried none measure it directly, and once a group has
//! seen such a round, its rate comes from those rounds only. Until then a round is charged
//! its draft and commit time plus its live rows' share of the forward (the forward's time
//! times live tokens over all tokens): exact where the forward is compute-bound, and a fair
//! estimate at the large batches where constant joining leaves no round without pieces.
//!
//! (Fitting one cost per prompt token from the rounds themselves, as before, failed on the
//! H200: within a group the pieces often fill the same share of the budget round after round,
//! so the fit had no spread and charged them nothing, and a piece's cost is not linear in its
//! tokens: a short piece adds its own tensor-core launches. Plain rounds, which leave more of
//! the budget to pieces, then looked slower than they were.)

use super::Round;

/// Weight of the newest round in the moving averages.
pub(super) const SMOOTHING: f64 = 0.3;

/// An exponentially weighted average of committed tokens and seconds per round.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Ewma {
    rounds: usize,
    committed: f64,
    seconds: f64,
}

impl Ewma {
    fn add(&mut self, committed: f64, seconds: f64) {
        let w = if self.rounds == 0 { 1.0 } else { SMOOTHING };
        self.committed += w * (committed - self.committed);
        self.seconds += w * (seconds - self.seconds);
        self.rounds += 1;
    }

    fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.committed / self.seconds
        } else {
            f64::INFINITY
        }
    }
}

/// One group's rounds: those without prompt pieces, and every round with its pieces' share of
/// the forward taken out.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Moments {
    pure: Ewma,
    shared: Ewma,
}

impl Moments {
    /// Rounds recorded so far.
    pub fn rounds(&self) -> usize {
        self.shared.rounds
    }

    pub fn add(&mut self, r: &Round) {
        let committed = r.committed as f64;
        if r.prompt_tokens == 0 {
            self.pure.add(committed, r.seconds);
        }
        let live = r.tokens.saturating_sub(r.prompt_tokens) as f64;
        let forward = r.forward_seconds.clamp(0.0, r.seconds);
        let share = forward * live / r.tokens.max(1) as f64;
        self.shared.add(committed, r.seconds - forward + share);
    }

    /// Committed tokens per second of decoding.
    pub fn rate(&self) -> f64 {
        if self.pure.rounds > 0 {
            self.pure.rate()
        } else {
            self.shared.rate()
        }
    }
}
