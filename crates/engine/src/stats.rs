//! Per-row and aggregate decoding statistics.

use serde::Serialize;

/// What happened to one row.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RowStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Speculative rounds (0 for plain decoding).
    pub rounds: usize,
    /// Rounds of a DFlash decoder that did not draft (speculation judged not to pay, or the
    /// end of the context).
    pub plain_steps: usize,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// `accepted_at[i]`: rounds in which the draft at block slot i+1 was accepted.
    pub accepted_at: Vec<usize>,
    pub draft_s: f64,
    pub verify_s: f64,
    pub commit_s: f64,
}

impl RowStats {
    pub fn prefill_tok_per_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_s)
    }

    /// Generated tokens per second of decoding (the first token comes from the prefill).
    pub fn decode_tok_per_s(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.decode_s)
    }

    /// Mean tokens committed per speculative round (accepted drafts + the bonus token).
    pub fn tau(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            (self.accepted + self.rounds) as f64 / self.rounds as f64
        }
    }

    /// Adds `other`'s counts and times into `self`.
    pub fn merge(&mut self, other: &RowStats) {
        self.prompt_tokens += other.prompt_tokens;
        self.generated_tokens += other.generated_tokens;
        self.prefill_s += other.prefill_s;
        self.decode_s = self.decode_s.max(other.decode_s);
        self.rounds += other.rounds;
        self.plain_steps += other.plain_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        if self.accepted_at.len() < other.accepted_at.len() {
            self.accepted_at.resize(other.accepted_at.len(), 0);
        }
        for (a, b) in self.accepted_at.iter_mut().zip(&other.accepted_at) {
            *a += b;
        }
        self.draft_s += other.draft_s;
        self.verify_s += other.verify_s;
        self.commit_s += other.commit_s;
    }

    /// Acceptance rate at each block slot: accepted_at[i] / rounds.
    pub fn acceptance_by_position(&self) -> Vec<f64> {
        self.accepted_at
            .iter()
            .map(|&a| {
                if self.rounds == 0 {
                    0.0
                } else {
                    a as f64 / self.rounds as f64
                }
            })
            .collect()
    }
}

fn rate(n: usize, s: f64) -> f64 {
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}
