//! Moving measurements of one kind of round at one batch size, and the decoding rate they
//! give.
//!
//! A round's decoding cost is its wall time without the prompt pieces of joining rows that
//! rode in it: its draft time plus its live rows' share (live tokens over all tokens) of the
//! rest, the forward and the commit (which extends the drafter's context over the pieces as
//! well as over the committed tokens). A round without pieces is charged whole. Exact where
//! the work is compute-bound, as at the large batches where rows join all the time; on the
//! GPU a prompt piece is not a free rider at small batches either (it takes its own
//! tensor-core launches, and the drafter's context grows over it: 44 prompt tokens made a
//! 1.7 ms plain step of 16 rows 5.3 ms on the H200).
//!
//! Mixed rounds count as much as rounds without pieces, so the rates follow what the batch
//! does now: while rows join, a speculative round serves fewer live rows (its verify blocks
//! leave less of the budget to the joining prompts), and its rate shows it. (A per-token cost
//! fitted from the rounds, the first design, had nothing to fit when the pieces filled the
//! same share of the budget round after round, and then charged them nothing.)

use super::Round;

/// Weight of the newest round in the moving averages.
pub(super) const SMOOTHING: f64 = 0.3;

/// Once a group has this many rounds, a round slower than [`SLOW_CAP`] times its average
/// counts as that slow: one stalled round (a CUDA graph captured for a new shape, a host
/// hiccup: 12.7 ms for a 1.7 ms step of 16 rows on the H200) must not hand the lead to the
/// other kind for the dozens of rounds until it is probed again. Faster rounds always count
/// whole, so a group whose first rounds were slow recovers as fast as without the cap.
const SETTLED: usize = 3;
const SLOW_CAP: f64 = 1.5;

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
        let seconds = if self.rounds >= SETTLED {
            seconds.min(SLOW_CAP * self.seconds)
        } else {
            seconds
        };
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

/// One group's rounds, each charged its decoding cost (see above).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Moments {
    ewma: Ewma,
}

impl Moments {
    /// Rounds recorded so far.
    pub fn rounds(&self) -> usize {
        self.ewma.rounds
    }

    pub fn add(&mut self, r: &Round) {
        let live = r.tokens.saturating_sub(r.prompt_tokens) as f64;
        let draft = r.draft_seconds.clamp(0.0, r.seconds);
        let share = (r.seconds - draft) * live / r.tokens.max(1) as f64;
        self.ewma.add(r.committed as f64, draft + share);
    }

    /// Committed tokens per second of decoding.
    pub fn rate(&self) -> f64 {
        self.ewma.rate()
    }
}
