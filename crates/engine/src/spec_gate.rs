//! When a DFlash round should draft at all.
//!
//! A speculative round costs more than a plain decoding step (a draft forward, and a verify
//! forward over the whole block); it pays only when enough drafts are accepted. Where that
//! break-even lies depends on the hardware (on a few CPU cores a 4-token verify costs ~1.8
//! plain steps, on a GPU about one) and on the text (code and repetitive answers are drafted
//! far better than open prose). In `Auto` mode the gate measures committed tokens per second
//! of both kinds of round as decoding goes, runs the faster kind, and keeps probing the other
//! so it notices when the balance turns. A probe that confirms the leader doubles the
//! interval to the next one (up to [`MAX_PROBE_EVERY`] rounds), so a kind that keeps losing
//! (drafting on a 2-core CPU, where a round costs about two plain steps) costs ~2% instead of
//! ~7%; a probe that changes the leader resets it.
//!
//! Skipping the draft never changes greedy output (a plain round is the target's own greedy
//! step), so `Auto` acts only while every row decodes greedily. Rows that sample keep drafting
//! every round: their random stream then stays the same from run to run, and so does their
//! output for a given seed.

/// How rounds choose between drafting and a plain step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMode {
    /// Every round drafts a full block.
    Always,
    /// Greedy batches draft only while it is measured to be faster than plain steps.
    Auto,
}

/// Weight of the newest round in a moving average of throughput.
const SMOOTHING: f64 = 0.3;
/// While one kind of round is ahead, every this many rounds the other kind runs once.
const PROBE_EVERY: usize = 12;
/// The longest probe interval after repeated probes found the same leader.
const MAX_PROBE_EVERY: usize = 48;

/// Throughput bookkeeping for [`SpecMode::Auto`].
#[derive(Clone, Debug)]
pub struct SpecGate {
    mode: SpecMode,
    /// Moving averages of committed tokens per second: speculative and plain rounds.
    spec_rate: Option<f64>,
    plain_rate: Option<f64>,
    /// Rounds since the kind that is behind last ran.
    since_probe: usize,
    /// The current probe interval (backs off while probes confirm the leader).
    probe_every: usize,
    /// Set by a probe round: which kind led before it ran (`true`: speculative).
    probed: Option<bool>,
}

impl SpecGate {
    pub fn new(mode: SpecMode) -> Self {
        Self {
            mode,
            spec_rate: None,
            plain_rate: None,
            since_probe: 0,
            probe_every: PROBE_EVERY,
            probed: None,
        }
    }

    pub fn mode(&self) -> SpecMode {
        self.mode
    }

    /// Whether the next round drafts; `all_greedy` says whether every live row is greedy.
    pub fn speculate(&mut self, all_greedy: bool) -> bool {
        if self.mode == SpecMode::Always || !all_greedy {
            return true;
        }
        match (self.spec_rate, self.plain_rate) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(spec), Some(plain)) => {
                let ahead = spec >= plain;
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
    }

    /// Records a finished round: whether it drafted, the tokens it committed over all rows
    /// and its wall time.
    pub fn record(&mut self, speculated: bool, committed: usize, seconds: f64) {
        if self.mode == SpecMode::Always || seconds <= 0.0 {
            return;
        }
        let rate = committed as f64 / seconds;
        let slot = if speculated {
            &mut self.spec_rate
        } else {
            &mut self.plain_rate
        };
        *slot = Some(match *slot {
            None => rate,
            Some(avg) => avg + SMOOTHING * (rate - avg),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives a gate where a speculative round commits `tau` tokens in `spec_s` seconds and a
    /// plain round one token in `plain_s`; returns the fraction of rounds that drafted.
    fn share_speculative(tau: usize, spec_s: f64, plain_s: f64, rounds: usize) -> f64 {
        let mut gate = SpecGate::new(SpecMode::Auto);
        let mut spec = 0;
        for _ in 0..rounds {
            let s = gate.speculate(true);
            if s {
                spec += 1;
                gate.record(true, tau, spec_s);
            } else {
                gate.record(false, 1, plain_s);
            }
        }
        spec as f64 / rounds as f64
    }

    #[test]
    fn runs_the_faster_kind_and_keeps_probing_the_other() {
        // Drafting pays: 3 tokens in 1.5 steps' time.
        let s = share_speculative(3, 1.5, 1.0, 240);
        assert!(s > 0.85 && s < 1.0, "mostly speculative, some probes: {s}");
        // Drafting does not pay: 1 token in 2.2 steps' time.
        let s = share_speculative(1, 2.2, 1.0, 240);
        assert!(s > 0.0 && s < 0.15, "mostly plain, some probes: {s}");
    }

    #[test]
    fn probes_back_off_while_they_confirm_the_leader() {
        // Drafting loses clearly: 1.6 tokens in 2.4 steps' time.
        let mut gate = SpecGate::new(SpecMode::Auto);
        let mut probes = 0;
        for _ in 0..480 {
            let s = gate.speculate(true);
            if s {
                probes += 1;
                gate.record(true, 2, 2.4 * 2.0 / 1.6);
            } else {
                gate.record(false, 1, 1.0);
            }
        }
        // At a fixed interval of 12 that would be 40 probes; backed off to 48, about 12.
        assert!((8..=14).contains(&probes), "probes: {probes}");
    }

    #[test]
    fn follows_a_change_in_the_balance() {
        let mut gate = SpecGate::new(SpecMode::Auto);
        // First the drafter is useless...
        for _ in 0..100 {
            let s = gate.speculate(true);
            gate.record(s, 1, if s { 2.0 } else { 1.0 });
        }
        // ...then it starts drafting whole blocks (8 tokens per round).
        let mut late = 0;
        for i in 0..100 {
            let s = gate.speculate(true);
            gate.record(s, if s { 8 } else { 1 }, if s { 2.0 } else { 1.0 });
            if i >= 50 && s {
                late += 1;
            }
        }
        assert!(late >= 45, "speculating again once it pays: {late}/50");
    }

    #[test]
    fn sampling_rows_and_always_mode_always_draft() {
        let mut auto = SpecGate::new(SpecMode::Auto);
        let mut always = SpecGate::new(SpecMode::Always);
        for _ in 0..50 {
            assert!(auto.speculate(false));
            auto.record(true, 1, 10.0);
            assert!(always.speculate(true));
            always.record(true, 1, 10.0);
        }
    }
}
