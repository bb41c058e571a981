use super::*;

/// A fake machine: the seconds and committed tokens of a round, given the rows the batch
/// holds, whether it drafts and the prompt tokens it carries.
struct Machine {
    /// Seconds of a round's decoding part: `(rows, speculative)`.
    decode_s: fn(usize, bool) -> f64,
    /// Tokens a speculative round commits per row.
    tau: f64,
    /// Seconds each prompt token adds.
    prompt_s: f64,
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
        Round {
            rows,
            speculated,
            committed,
            tokens: rows * per_row + prompt_tokens,
            prompt_tokens,
            seconds: (self.decode_s)(rows, speculated) + self.prompt_s * prompt_tokens as f64,
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
fn gpu_like(rows: usize, speculated: bool) -> f64 {
    let r = rows as f64;
    let forward = |tokens: f64| (4e-3f64).max(6e-5 * tokens);
    if speculated {
        // A draft forward, then a verify over four tokens per row.
        5e-4 + 1e-5 * r + forward(4.0 * r)
    } else {
        forward(r)
    }
}

fn gpu() -> Machine {
    Machine {
        decode_s: gpu_like,
        tau: 2.0,
        prompt_s: 1e-5,
        block: 4,
    }
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
    // Constant joining: every round carries prompt pieces, as many as the step's budget of
    // 512 tokens leaves after the live rows' own (a verify block of 4 per row drafting, one
    // per row otherwise), at most what the queue holds. Plain decoding is faster here, but a
    // speculative round carries fewer prompt tokens: charged whole, it would look faster.
    let m = Machine {
        decode_s: |rows, s| {
            if s {
                0.020 * rows as f64
            } else {
                0.007 * rows as f64
            }
        },
        tau: 2.0,
        prompt_s: 0.004,
        block: 4,
    };
    let rows = 64;
    let mut gate = SpecGate::new(SpecMode::Auto);
    let mut kinds = Vec::new();
    let mut naive = [(0.0, 0.0); 2];
    for i in 0..400usize {
        let s = gate.speculate(rows, true);
        let queued = 100 + (i * 7919) % 500;
        let budget = 512 - rows * if s { m.block } else { 1 };
        let r = m.round(rows, s, queued.min(budget));
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
fn the_prompt_cost_is_fitted_within_groups_and_bounded() {
    let m = Machine {
        decode_s: |rows, s| if s { 2.0 } else { 1.0 } * rows as f64,
        tau: 2.0,
        prompt_s: 0.01,
        block: 4,
    };
    let mut a = Moments::default();
    let mut b = Moments::default();
    for i in 0..40 {
        a.add(&m.round(8, true, 10 * (i % 5)));
        b.add(&m.round(64, false, 50 + 30 * (i % 3)));
    }
    let c = prompt_cost([&a, &b].into_iter());
    assert!((c - 0.01).abs() < 1e-9, "{c}");
    // Charged at the fitted cost, each group's rate is its decoding rate.
    assert!((a.rate(c) - 16.0 / 16.0).abs() < 1e-9);
    assert!((b.rate(c) - 1.0).abs() < 1e-9);
    // The same prompt work in every round says nothing: charged whole.
    let mut same = Moments::default();
    for _ in 0..10 {
        same.add(&m.round(4, false, 100));
    }
    assert_eq!(prompt_cost([&same].into_iter()), 0.0);
    assert!((same.rate(0.0) - 4.0 / 5.0).abs() < 1e-9);
    // A cost above the round's mean time per forward token is cut to it.
    assert!((same.rate(1.0) - same.rate(5.0 / 104.0)).abs() < 1e-9);
}

#[test]
fn follows_a_change_in_the_balance() {
    let useless = Machine {
        decode_s: |_, s| if s { 2.0 } else { 1.0 },
        tau: 1.0,
        prompt_s: 0.0,
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
