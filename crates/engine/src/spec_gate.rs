//! When a DFlash round should draft at all.
//!
//! A speculative round costs more than a plain decoding step (a draft forward, and a verify
//! forward over the whole block); it pays only when enough drafts are accepted. Where that
//! break-even lies depends on the hardware (on a few CPU cores a 4-token verify costs ~1.8
//! plain steps, on a GPU about one), on the text (code and repetitive answers are drafted far
//! better than open prose) and on the batch size: a GPU verifying a few rows' blocks is
//! memory-bound and the extra tokens ride almost free, while at a few hundred rows the block
//! multiplies compute-bound work (and the logits to choose from) and drafting can halve
//! throughput. In `Auto` mode the gate therefore keeps its measurements per batch size: the
//! rows the batch holds (live and still prefilling; what `--max-live` caps), in buckets of the
//! nearest power of two (12–22 rows count as 16, 182–362 as 256). Counting the prefilling rows
//! makes both kinds of round compare at the same load: a speculative round leaves less of the
//! step's token budget to joining rows, so at a large batch fewer rows may be live, and that is
//! part of what drafting costs there.
//!
//! Per bucket the gate keeps moving measurements of committed tokens per second of both kinds
//! of round, runs the faster kind, and keeps probing the other so it notices when the balance
//! turns. A probe that confirms the leader doubles the interval to the next one (up to
//! [`MAX_PROBE_EVERY`] rounds), so a kind that keeps losing costs ~2% instead of ~7%; a probe
//! that changes the leader resets it. A bucket seen for the first time runs one round of each
//! kind before it chooses.
//!
//! Every round is measured, also those whose forward carried prompt pieces of joining rows
//! (chunked prefill): under constant joining many rounds do. Those pieces are not decoding
//! work, and the two kinds carry different amounts of them (the verify blocks take more of the
//! token budget), so [`moments`] charges a round only its live rows' share of its forward and
//! commit.
//!
//! Skipping the draft never changes greedy output (a plain round is the target's own greedy
//! step), so `Auto` acts only while every row decodes greedily. Rows that sample keep drafting
//! every round: their random stream then stays the same from run to run, and so does their
//! output for a given seed.

mod moments;
#[cfg(test)]
mod tests;

use moments::Moments;

/// How rounds choose between drafting and a plain step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Every round drafts a full block.
    Always,
    /// Greedy batches draft only while it is measured to be faster than plain steps.
    Auto,
}

/// While one kind of round is ahead, every this many rounds the other kind runs once.
const PROBE_EVERY: usize = 12;
/// The longest probe interval after repeated probes found the same leader.
const MAX_PROBE_EVERY: usize = 48;
/// A bucket's state is traced (`DFLASH_LOG=dflash_engine::spec_gate=debug`) every this many
/// of its rounds.
const TRACE_EVERY: usize = 64;

/// One finished round, as [`SpecGate::record`] sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Round {
    /// Rows the batch held (live and prefilling): the same number the round's
    /// [`SpecGate::speculate`] was asked with.
    pub rows: usize,
    /// Whether it drafted.
    pub speculated: bool,
    /// Tokens it committed over all live rows.
    pub committed: usize,
    /// Tokens its target forward ran: the live rows' own plus the prompt pieces.
    pub tokens: usize,
    /// Of `tokens`, the prompt pieces of joining rows.
    pub prompt_tokens: usize,
    /// Its wall time.
    pub seconds: f64,
    /// Of `seconds`, the draft's (the rest is the target forward and the commit).
    pub draft_seconds: f64,
}

/// The bucket of a batch of `rows` rows: the nearest power of two's exponent (in log scale:
/// `2^(k - 1/2) <= rows < 2^(k + 1/2)`).
fn bucket(rows: usize) -> usize {
    let sq = (rows.max(1) as u128).pow(2);
    (sq.ilog2() as usize).div_ceil(2)
}

/// One bucket's measurements and probe schedule.
#[derive(Clone, Debug)]
struct Bucket {
    spec: Moments,
    plain: Moments,
    /// Rounds since the kind that is behind last ran.
    since_probe: usize,
    /// The current probe interval (backs off while probes confirm the leader).
    probe_every: usize,
    /// Set by a probe round: which kind led before it ran (`true`: speculative).
    probed: Option<bool>,
}

impl Default for Bucket {
    fn default() -> Self {
        Self {
            spec: Moments::default(),
            plain: Moments::default(),
            since_probe: 0,
            probe_every: PROBE_EVERY,
            probed: None,
        }
    }
}

impl Bucket {
    /// Whether the next round drafts.
    fn speculate(&mut self) -> bool {
        if self.spec.rounds() == 0 {
            return true;
        }
        if self.plain.rounds() == 0 {
            return false;
        }
        let ahead = self.spec.rate() >= self.plain.rate();
        if let Some(before) = self.probed.take() {
            self.probe_every = if before == ahead {
                (2 * self.probe_every).min(MAX_PROBE_EVERY)
            } else {
                PROBE_EVERY
            };
        }
        self.since_probe += 1;
        if self.since_probe >= self.probe_every {
            self.since_probe = 0;
            self.probed = Some(ahead);
            !ahead
        } else {
            ahead
        }
    }
}

/// Throughput bookkeeping for [`SpecMode::Auto`].
#[derive(Clone, Debug)]
pub struct SpecGate {
    mode: SpecMode,
    /// Indexed by [`bucket`]; grown on demand.
    buckets: Vec<Bucket>,
}

impl SpecGate {
    pub fn new(mode: SpecMode) -> Self {
        Self {
            mode,
            buckets: Vec::new(),
        }
    }

    pub fn mode(&self) -> SpecMode {
        self.mode
    }

    fn bucket_mut(&mut self, rows: usize) -> &mut Bucket {
        let b = bucket(rows);
        if self.buckets.len() <= b {
            self.buckets.resize_with(b + 1, Bucket::default);
        }
        &mut self.buckets[b]
    }

    /// Whether the next round of a batch holding `rows` rows drafts; `all_greedy` says
    /// whether every live row is greedy.
    pub fn speculate(&mut self, rows: usize, all_greedy: bool) -> bool {
        if self.mode == SpecMode::Always || !all_greedy {
            return true;
        }
        self.bucket_mut(rows).speculate()
    }

    /// Records a finished round.
    pub fn record(&mut self, round: Round) {
        if self.mode == SpecMode::Always || round.seconds <= 0.0 {
            return;
        }
        let b = self.bucket_mut(round.rows);
        if round.speculated {
            b.spec.add(&round);
        } else {
            b.plain.add(&round);
        }
        let seen = b.spec.rounds() + b.plain.rounds();
        if seen.is_multiple_of(TRACE_EVERY) {
            tracing::debug!(
                rows = round.rows,
                spec_rounds = b.spec.rounds(),
                plain_rounds = b.plain.rounds(),
                spec = ?b.spec,
                plain = ?b.plain,
                spec_rate = b.spec.rate(),
                plain_rate = b.plain.rate(),
                "speculation gate"
            );
        }
    }
}
