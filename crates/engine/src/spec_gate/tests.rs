use super::*;

/// A fake machine: the seconds and committed tokens of a round, given the rows the batch
/// holds, whether it drafts and the prompt tokens it carries.
struct Machine {
    /// Seconds of a round's draft: `(rows, speculative)`.
    overhead_s: fn(usize, bool) -> f64,
    /// Seconds of a forward over this many tokens (the live rows' and the prompt pieces).
    forward_s: fn(usize) -> f64,
    /// Tokens a speculative round commits per row.
    tau: f64,
    /// The block size (verify tokens per row of a speculative round).
    block: usize,
}

impl Machine {
    fn round(&self, rows: usize, speculated: bool, prompt_tokens: usize) -> Round {
        let per_row = if speculated { self.block } else { 1 };
        let committed = if speculated {
            (self.tau * rows as f64).round() as usize
        } else {
            rows
        };
        let tokens = rows * per_row + prompt_tokens;
        let overhead = (self.overhead_s)(rows, speculated);
        Round {
            rows,
            speculated,
            committed,
            tokens,
            prompt_tokens,
            seconds: overhead + (self.forward_s)(tokens),
            draft_seconds: overhead,
        }
    }
}

/// Runs `rounds` rounds of `rows` rows without prompt pieces; returns which drafted.
fn drive(gate: &mut SpecGate, m: &Machine, rows: usize, rounds: usize) -> Vec<bool> {
    (0..rounds)
        .map(|_| {
            let s = gate.speculate(rows, true);
            gate.record(m.round(rows, s, 0));
            s
        })
        .collect()
}

fn share(kinds: &[bool]) -> f64 {
    kinds.iter().filter(|&&s| s).count() as f64 / kinds.len() as f64
}

/// Indices of the speculative rounds.
fn spec_at(kinds: &[bool]) -> Vec<usize> {
    kinds
        .iter()
        .enumerate()
        .filter(|x| *x.1)
        .map(|x| x.0)
        .collect()
}

/// An H200-like balance (the default model, block 4, τ = 2): a forward is memory-bound (a
/// fixed time) up to ~64 tokens and compute-bound beyond, so a speculative round's verify
/// rides almost free at 16 rows and costs about four plain steps at 256.
fn gpu_forward(tokens: usize) -> f64 {
    (4e-3f64).max(6e-5 * tokens as f64)
}

/// The draft forward of a speculative round; a plain round has nothing outside its forward.
fn gpu_draft(rows: usize, speculated: bool) -> f64 {
    if speculated {
        5e-4 + 1e-5 * rows as f64
    } else {
        0.0
    }
}

fn gpu() -> Machine {
    Machine {
        overhead_s: gpu_draft,
        forward_s: gpu_forward,
        tau: 2.0,
        block: 4,
    }
}

/// The prompt tokens a step's budget of 512 leaves after the live rows' own (a verify block
/// per drafting row, one token per row otherwise), never less than a quarter of it (the join
/// reserve), at most `queued`.
fn leftover(m: &Machine, rows: usize, speculated: bool, queued: usize) -> usize {
    let own = rows * if speculated { m.block } else { 1 };
    queued.min(512usize.saturating_sub(own).max(128))
}

#[test]
fn buckets_are_the_nearest_power_of_two() {
    let exp = |n: usize| 1usize << bucket(n);
    for (rows, want) in [
        (0, 1),
        (1, 1),
        (2, 2),
        (11, 8),
        (12, 16),
        (16, 16),
        (22, 16),
        (23, 32),
        (64, 64),
        (181, 128),
        (182, 256),
        (362, 256),
        (363, 512),
    ] {
        assert_eq!(exp(rows), want, "{rows} rows");
    }
}

#[test]
fn the_machine_pays_at_16_rows_and_loses_at_256() {
    // The premise of the tests below, in committed tokens per second.
    let rate = |rows: usize, s: bool| {
        let r = gpu().round(rows, s, 0);
        r.committed as f64 / r.seconds
    };
    assert!(rate(16, true) > 1.3 * rate(16, false));
    assert!(rate(256, true) < 0.7 * rate(256, false));
}

#[test]
fn stops_drafting_where_plain_rounds_are_faster_and_probes_at_the_backed_off_interval() {
    let mut gate = SpecGate::new(SpecMode::Auto);
    let kinds = drive(&mut gate, &gpu(), 256, 400);
    // One round of each kind, then plain: the first three rounds settle it.
    assert_eq!(&kinds[..3], &[true, false, false]);
    // Probes every 12 rounds, then 24, then every 48 while they confirm plain is faster.
    let at = spec_at(&kinds);
    let gaps: Vec<usize> = at.windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(&gaps[..3], &[13, 24, 48]);
    assert!(gaps[2..].iter().all(|&g| g == MAX_PROBE_EVERY), "{gaps:?}");
    assert!(at.len() >= 8, "keeps probing: {at:?}");
}

#[test]
fn keeps_drafting_where_it_pays() {
    let mut gate = SpecGate::new(SpecMode::Auto);
    let kinds = drive(&mut gate, &gpu(), 16, 400);
    assert!(
        kinds[2..].iter().filter(|&&s| !s).count() <= 12,
        "{kinds:?}"
    );
    assert!(share(&kinds) > 0.95);
}

#[test]
fn a_batch_growing_from_16_to_256_rows_switches_and_back() {
    let mut gate = SpecGate::new(SpecMode::Auto);
    let m = gpu();
    let small = drive(&mut gate, &m, 16, 100);
    assert!(share(&small[50..]) > 0.95);
    // Through the sizes between (each bucket settles in a few rounds of its own)...
    for rows in [24, 40, 64, 100, 160] {
        drive(&mut gate, &m, rows, 20);
    }
    // ...to 256 rows, where the first two rounds measure both kinds and plain wins.
    let large = drive(&mut gate, &m, 256, 100);
    assert_eq!(&large[..3], &[true, false, false]);
    assert!(share(&large) < 0.06, "{large:?}");
    // Rows leave: back at 16 the bucket still knows that drafting pays there.
    let again = drive(&mut gate, &m, 16, 50);
    assert!(share(&again) > 0.95, "{again:?}");
}

#[test]
fn rounds_with_prompt_pieces_inform_the_gate() {
    // Constant joining: every round carries prompt pieces, as many as the step's budget
    // leaves (see `leftover`), at most what the queue holds. Plain decoding is faster here
    // (a compute-bound forward: 2 ms a token), but a speculative round carries fewer prompt
    // tokens: charged whole, it would look faster.
    let m = Machine {
        overhead_s: |rows, s| if s { 0.012 } else { 0.005 } * rows as f64,
        forward_s: |tokens| 0.002 * tokens as f64,
        tau: 2.0,
        block: 4,
    };
    let rows = 64;
    let mut gate = SpecGate::new(SpecMode::Auto);
    let mut kinds = Vec::new();
    let mut naive = [(0.0, 0.0); 2];
    for i in 0..400usize {
        let s = gate.speculate(rows, true);
        let queued = 100 + (i * 7919) % 500;
        let r = m.round(rows, s, leftover(&m, rows, s, queued));
        assert!(r.prompt_tokens > 0);
        gate.record(r);
        let n = &mut naive[s as usize];
        n.0 += r.committed as f64;
        n.1 += r.seconds;
        kinds.push(s);
    }
    let (plain, spec) = (naive[0].0 / naive[0].1, naive[1].0 / naive[1].1);
    assert!(
        spec > plain,
        "charged whole, drafting looks faster: {spec} vs {plain}"
    );
    assert!(share(&kinds[50..]) < 0.06, "{kinds:?}");
}

#[test]
fn a_filling_batch_keeps_to_plain_steps_where_drafting_starves_joining_rows() {
    // A batch of 256 rows filling up: most rows are still prefilling, and every forward is
    // full. A plain round decodes 40 live rows and fills the budget with 472 prompt tokens; a
    // speculative round decodes 96 rows' blocks (384 tokens) and carries 128. The pieces fill
    // the same share round after round. Charged whole, drafting would look 4x faster; without
    // the pieces, plain steps are faster, and the gate keeps to them.
    let m = gpu();
    let round = |s: bool| {
        let live = if s { 96 } else { 40 };
        let own = live * if s { m.block } else { 1 };
        Round {
            rows: 256,
            ..m.round(live, s, 512 - own)
        }
    };
    let whole = |r: Round| r.committed as f64 / r.seconds;
    assert!(whole(round(true)) > 4.0 * whole(round(false)));
    let alone = |live, s| whole(m.round(live, s, 0));
    assert!(alone(40, false) > 1.2 * alone(96, true));
    let mut gate = SpecGate::new(SpecMode::Auto);
    let kinds: Vec<bool> = (0..200)
        .map(|_| {
            let s = gate.speculate(256, true);
            gate.record(round(s));
            s
        })
        .collect();
    assert!(share(&kinds[3..]) < 0.06, "{kinds:?}");
}

#[test]
fn moments_charge_a_round_its_live_share_of_the_forward() {
    let m = Machine {
        overhead_s: |rows, _| 0.001 * rows as f64,
        forward_s: |tokens| 0.002 * tokens as f64,
        tau: 2.0,
        block: 4,
    };
    let mut g = Moments::default();
    // With a forward without a fixed part, a round's decoding cost is exactly the round
    // without its pieces, whatever the pieces.
    for q in [100, 0, 300, 50] {
        g.add(&m.round(8, true, q));
    }
    let pure = m.round(8, true, 0);
    let want = pure.committed as f64 / pure.seconds;
    assert!(
        (g.rate() - want).abs() < 1e-9 * want,
        "{} vs {want}",
        g.rate()
    );
    assert_eq!(g.rounds(), 4);
    // A draft reported longer than the round is cut to it.
    let mut h = Moments::default();
    h.add(&Round {
        draft_seconds: 10.0 * pure.seconds,
        ..pure
    });
    assert!((h.rate() - pure.committed as f64 / pure.seconds).abs() < 1e-9 * want);
}

#[test]
fn one_stalled_round_does_not_hand_over_the_lead() {
    // Plain steps lead by 25%; one plain step stalls (8x its time, as a graph capture does).
    let m = Machine {
        overhead_s: |_, s| if s { 1.0 } else { 0.0 },
        forward_s: |_| 1.0,
        tau: 1.6,
        block: 4,
    };
    let mut gate = SpecGate::new(SpecMode::Auto);
    drive(&mut gate, &m, 16, 100);
    assert!(!gate.speculate(16, true));
    gate.record(Round {
        seconds: 8.0,
        ..m.round(16, false, 0)
    });
    let after = drive(&mut gate, &m, 16, 40);
    assert!(after.iter().filter(|&&s| s).count() <= 1, "{after:?}");
    // A stall among a group's first rounds (the cap does not apply yet) fades as the group
    // runs normally: faster rounds are never capped.
    let mut g = Moments::default();
    g.add(&Round {
        seconds: 8.0,
        ..m.round(16, false, 0)
    });
    for _ in 0..16 {
        g.add(&m.round(16, false, 0));
    }
    assert!(g.rate() > 15.5, "{}", g.rate());
}

#[test]
fn follows_a_change_in_the_balance() {
    let useless = Machine {
        overhead_s: |_, s| if s { 1.0 } else { 0.0 },
        forward_s: |_| 1.0,
        tau: 1.0,
        block: 4,
    };
    let good = Machine {
        tau: 8.0,
        ..useless
    };
    let mut gate = SpecGate::new(SpecMode::Auto);
    drive(&mut gate, &useless, 1, 100);
    let late = drive(&mut gate, &good, 1, 100);
    assert!(share(&late[50..]) >= 0.9, "speculating again once it pays");
}

#[test]
fn sampling_rows_and_always_mode_always_draft() {
    let mut auto = SpecGate::new(SpecMode::Auto);
    let mut always = SpecGate::new(SpecMode::Always);
    let m = gpu();
    for _ in 0..50 {
        assert!(auto.speculate(256, false));
        auto.record(m.round(256, true, 0));
        assert!(always.speculate(256, true));
        always.record(m.round(256, true, 0));
    }
}
