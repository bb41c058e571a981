//! DFlash sampling follows the target's distribution.
//!
//! On a tiny synthetic target (264-token vocabulary), the first three generated tokens of many
//! seeded runs are drawn once by plain autoregressive sampling and once by DFlash (drafts
//! proposed from the drafter's distribution q, accepted with probability min(1, p/q), the
//! residual max(p - q, 0) sampled on rejection). A chi-square two-sample test over the joint
//! outcomes (token 1, token 2) and (token 2, token 3) must not reject (p > 1e-3) at T = 1, at
//! T = 1 with top-p 0.8 and at T = 1 with top-k 12 — with a randomly initialised DFlash
//! drafter shaped for the target (few drafts accepted: mostly the residual path) and with a
//! "peeking" test drafter that proposes a sharpened, noisy copy of the target's own
//! distribution (many drafts accepted: the p/q path; and min(p, q) is not proportional to p,
//! so a residual other than max(p - q, 0) would show).
//!
//! The same holds for DFlash2 drafters, whose q is the selector's sparse distribution over its
//! top-k candidates (q = 0 elsewhere): a randomly initialised DFlash2 drafter, and the peeking
//! drafter proposing through a candidate lattice (its top 8 sharpened logits as candidates,
//! random transition scores that depend on the predecessor chosen).
//!
//! And with a vocabulary shortlist (two thirds of the ids): q is the distribution over the
//! listed tokens and 0 elsewhere, so the target's unlisted tokens come only from the
//! residual — the peeking drafter and a randomly initialised DFlash drafter whose head is the
//! listed rows of the target's head.
//!
//! Controls: the same statistic rejects plain sampling at T = 1 against T = 1.3 (the order of
//! error a sampler that skipped the p/q test would make) with a tiny p-value, so the test has
//! power, and does not reject two plain samples with different seeds. The chi-square tail is
//! checked against known values.
//!
//! The synthetic target has an untied output head scaled up 4x (`common::sharp_tiny_gguf`):
//! the stock synthetic models are either almost deterministic at T = 1 (tied embeddings) or
//! almost uniform (untied), and neither makes a useful distribution test.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use common::{request, sharp_tiny_path};
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Completion, Decoder, SamplingParams};
use dflash_models::selector::top_k_indices;
use dflash_models::synthetic::{
    dflash2_config_for, drafter_config_for, random_drafter, special_id,
};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::TargetModel;
use dflash_models::{
    load_model, CandidateLattice, DflashDrafter, Drafter, LogitRows, RowStep, Target,
};
use dflash_runtime::cpu::CpuWeight;
use dflash_runtime::cpu::{CpuBackend, CpuTensor};
use dflash_runtime::Backend;
use rand::{Rng, SeedableRng};

/// Runs per arm.
const RUNS: u64 = 4000;
/// Tokens generated per run.
const TOKENS: usize = 3;
/// Rows decoding together.
const LIVE: usize = 500;
/// Drafter block.
const BLOCK: usize = 4;
/// How much sharper the peeking drafter's logits are than the target's.
const SHARPEN: f32 = 2.0;
/// The smallest p-value accepted for a correct sampler.
const ALPHA: f64 = 1e-3;

type Cpu = CpuBackend;

struct Setup {
    backend: Arc<Cpu>,
    tok: TextTokenizer,
    prompt: Vec<u32>,
}

fn setup() -> Setup {
    let backend = Arc::new(CpuBackend::new(1));
    let m = load_model(backend.clone(), sharp_tiny_path()).unwrap();
    let prompt = m.tokenizer.encode("Once upon a", false).unwrap();
    Setup {
        backend,
        tok: m.tokenizer,
        prompt,
    }
}

impl Setup {
    /// A fresh copy of the tiny target.
    fn target(&self) -> TargetModel<Cpu> {
        load_model(self.backend.clone(), sharp_tiny_path())
            .unwrap()
            .model
    }
}

/// A randomly initialised DFlash drafter shaped for the tiny target.
fn random(s: &Setup) -> DflashDrafter<Cpu> {
    let mask = special_id("<|mask|>");
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, mask);
    assert!(
        !cfg.target_layer_ids.is_empty() && cfg.target_layer_ids.iter().all(|&l| l < 4),
        "tap ids {:?} exist in a 4-layer target",
        cfg.target_layer_ids
    );
    assert_eq!(cfg.mask_token_id, mask);
    DflashDrafter::load(s.backend.clone(), cfg.clone(), &random_drafter(&cfg, 3)).unwrap()
}

/// A randomly initialised DFlash2 drafter shaped for the tiny target.
fn random2(s: &Setup) -> DflashDrafter<Cpu> {
    let mask = special_id("<|mask|>");
    let base = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, mask);
    let cfg = dflash2_config_for(base, s.target().vocab(), 8);
    DflashDrafter::load(s.backend.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap()
}

/// Candidates per slot of the peeking drafter's lattice.
const PEEK_TOP_K: usize = 8;

/// A test drafter that runs its own copy of the target: slot i's logits are the target's
/// logits after the row's context, `cur` and the greedy guesses for slots 1..i, scaled by
/// `sharpen`, plus uniform noise. It knows a row's context while every round commits a single token (the prompt is
/// shared by all runs); otherwise it proposes from flat logits.
struct Peek {
    model: TargetModel<Cpu>,
    prompt: Vec<u32>,
    taps: Vec<usize>,
    /// Per row: committed length and, when known, the committed tokens.
    rows: Vec<Option<(usize, Option<Vec<u32>>)>>,
    /// `cur` of each row's last draft (the first token its next commit holds).
    last_cur: HashMap<usize, u32>,
    logits: CpuTensor,
    rng: rand::rngs::StdRng,
    noise: f32,
    /// Logit scale: above 1 makes q sharper than p, so that min(p, q) is not proportional to
    /// p and a wrong residual shows.
    sharpen: f32,
    /// Propose through a candidate lattice (DFlash2) built from the logits.
    lattice: Option<CandidateLattice>,
    /// Propose over these target ids only (the logits' columns).
    shortlist: Option<Vec<u32>>,
}

impl Peek {
    fn new(s: &Setup, sharpen: f32, noise: f32) -> Self {
        Self {
            model: s.target(),
            prompt: s.prompt.clone(),
            taps: vec![1],
            rows: Vec::new(),
            last_cur: HashMap::new(),
            logits: CpuTensor::default(),
            rng: rand::rngs::StdRng::seed_from_u64(11),
            noise,
            sharpen,
            lattice: None,
            shortlist: None,
        }
    }

    /// Proposes over the target ids `ids` only: the logits keep those columns.
    fn with_shortlist(mut self, ids: Vec<u32>) -> Self {
        self.shortlist = Some(ids);
        self
    }

    /// Proposes through a lattice: each slot's top 8 logits as candidates and unary scores,
    /// plus a random transition score for every (predecessor, candidate) pair.
    fn with_lattice(mut self) -> Self {
        self.lattice = Some(CandidateLattice::new(PEEK_TOP_K, BLOCK - 1));
        self
    }
}

impl Drafter for Peek {
    type B = Cpu;

    fn block_size(&self) -> usize {
        BLOCK
    }

    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    fn new_row(&mut self, _capacity: usize) -> dflash_models::Result<usize> {
        let slot = (
            Some((0, Some(Vec::new()))),
            self.rows.iter().position(Option::is_none),
        );
        match slot.1 {
            Some(i) => {
                self.rows[i] = slot.0;
                Ok(i)
            }
            None => {
                self.rows.push(slot.0);
                Ok(self.rows.len() - 1)
            }
        }
    }

    fn release_row(&mut self, row: usize) {
        self.rows[row] = None;
        self.last_cur.remove(&row);
    }

    /// Peek keeps no KV cache.
    fn kv_usage(&self) -> dflash_models::KvUsage {
        dflash_models::KvUsage::default()
    }

    fn context_len(&self, row: usize) -> usize {
        self.rows[row].as_ref().map_or(0, |r| r.0)
    }

    fn extend(
        &mut self,
        rows: &[(usize, usize)],
        _taps: &CpuTensor,
        _tap_rows: &[u32],
    ) -> dflash_models::Result<()> {
        for &(r, n) in rows {
            let row = self.rows[r].as_mut().expect("live row");
            row.0 += n;
            row.1 = match (self.last_cur.remove(&r), row.1.take()) {
                // Prefill: the shared prompt.
                (None, Some(_)) if row.0 <= self.prompt.len() => {
                    Some(self.prompt[..row.0].to_vec())
                }
                // A round that committed only `cur`.
                (Some(cur), Some(mut t)) if n == 1 => {
                    t.push(cur);
                    Some(t)
                }
                _ => None,
            };
        }
        Ok(())
    }

    fn draft(
        &mut self,
        rows: &[(usize, u32)],
        block: usize,
        _embed: &CpuWeight,
        _lm_head: &CpuWeight,
    ) -> dflash_models::Result<()> {
        let v = self.model.vocab();
        self.logits = CpuTensor::zeros(rows.len() * (block - 1), v);
        // Rows whose context is known, with their token sequences up to and including `cur`.
        let mut known: Vec<(usize, Vec<u32>)> = Vec::new();
        for (i, &(r, cur)) in rows.iter().enumerate() {
            self.last_cur.insert(r, cur);
            if let Some((_, Some(t))) = &self.rows[r] {
                let mut seq = t.clone();
                seq.push(cur);
                known.push((i, seq));
            }
        }
        let mrows: Vec<usize> = known
            .iter()
            .map(|(_, seq)| self.model.new_row(seq.len() + block))
            .collect::<dflash_models::Result<_>>()?;
        let mut feed: Vec<Vec<u32>> = known.iter().map(|(_, seq)| seq.clone()).collect();
        let mut host = Vec::new();
        for slot in 0..block - 1 {
            let steps: Vec<RowStep<'_>> = mrows
                .iter()
                .zip(&feed)
                .map(|(&row, tokens)| RowStep {
                    row,
                    tokens,
                    logits: LogitRows::Last,
                    prompt: false,
                    argmax_only: false,
                })
                .collect();
            self.model.forward(&steps)?;
            self.model
                .backend()
                .copy_to_host(self.model.logits(), &mut host);
            for (k, (i, _)) in known.iter().enumerate() {
                let l = &host[k * v..(k + 1) * v];
                let out = self.logits.row_mut(i * (block - 1) + slot);
                for (o, &x) in out.iter_mut().zip(l) {
                    *o = x * self.sharpen + self.rng.random_range(-self.noise..self.noise);
                }
                feed[k] = vec![dflash_engine::sampling::argmax(l)];
            }
        }
        for row in mrows {
            self.model.release_row(row);
        }
        if let Some(ids) = &self.shortlist {
            let mut listed = CpuTensor::zeros(rows.len() * (block - 1), ids.len());
            for r in 0..rows.len() * (block - 1) {
                let full = self.logits.row(r);
                for (o, &id) in listed.row_mut(r).iter_mut().zip(ids) {
                    *o = full[id as usize];
                }
            }
            self.logits = listed;
        }
        if let Some(l) = &mut self.lattice {
            let k = PEEK_TOP_K;
            l.reset(k, block - 1);
            let mut order = Vec::new();
            for i in 0..rows.len() {
                let (ids, scores) = l.push_row_mut();
                for j in 0..block - 1 {
                    let x = self.logits.row(i * (block - 1) + j);
                    top_k_indices(x, k, &mut order);
                    ids[j * k..(j + 1) * k].copy_from_slice(&order);
                    for prev in 0..k {
                        for (c, &id) in order.iter().enumerate() {
                            scores[(j * k + prev) * k + c] =
                                x[id as usize] + self.rng.random_range(-1.0f32..1.0);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn logits(&self) -> &CpuTensor {
        &self.logits
    }

    fn lattice(&self) -> Option<&CandidateLattice> {
        self.lattice.as_ref()
    }

    fn vocab_map(&self) -> Option<&[u32]> {
        self.shortlist.as_deref()
    }
}

/// A vocabulary shortlist for the tiny target: two thirds of its ids, in an order unlike id
/// order (so a column is not its id).
fn shortlist(s: &Setup) -> Vec<u32> {
    (0..s.target().vocab() as u32)
        .rev()
        .filter(|id| id % 3 != 0)
        .collect()
}

fn params(temperature: f32, top_p: f32, top_k: usize) -> SamplingParams {
    SamplingParams {
        temperature,
        top_p,
        top_k,
        ..SamplingParams::default()
    }
}

/// Runs `RUNS` requests with seeds `first..first + RUNS` through `dec`.
fn sample(dec: &mut dyn Decoder, s: &Setup, p: &SamplingParams, first: u64) -> Vec<Completion> {
    let requests: Vec<_> = (first..first + RUNS)
        .map(|seed| {
            let params = SamplingParams { seed, ..p.clone() };
            request(s.prompt.clone(), TOKENS, params)
        })
        .collect();
    run_scheduled(dec, &s.tok, &requests, LIVE, &mut |_, _| {}).unwrap()
}

/// A run's first `TOKENS` tokens, with `u32::MAX` after an end of sequence.
fn outcome(c: &Completion) -> [u32; TOKENS] {
    let mut o = [u32::MAX; TOKENS];
    for (x, &t) in o.iter_mut().zip(&c.tokens) {
        *x = t;
    }
    o
}

/// Counts of the outcome pair at positions `(i, j)`.
fn counts(runs: &[Completion], i: usize, j: usize) -> HashMap<(u32, u32), u64> {
    let mut m = HashMap::new();
    for c in runs {
        let o = outcome(c);
        *m.entry((o[i], o[j])).or_insert(0) += 1;
    }
    m
}

/// ln Γ(x) for x > 0 (Lanczos approximation, g = 7, about 15 significant digits).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 - x) = π / sin(πx).
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let t = x + 7.5;
    let mut a = C[0];
    for (i, &c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// The regularised upper incomplete gamma function Q(a, x).
fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let front = (-x + a * x.ln() - ln_gamma(a)).exp();
    if x < a + 1.0 {
        // Series for P(a, x) = x^a e^-x / Γ(a) · Σ x^n / (a (a+1) ... (a+n)).
        let (mut term, mut sum, mut n) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            n += 1.0;
            term *= x / n;
            sum += term;
            if term.abs() < sum.abs() * 1e-16 {
                break;
            }
        }
        (1.0 - front * sum).max(0.0)
    } else {
        // Continued fraction for Q(a, x), evaluated with the modified Lentz method.
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        front * h
    }
}

/// P(X > x) for X chi-square with `df` degrees of freedom.
fn chi_square_tail(x: f64, df: usize) -> f64 {
    gamma_q(df as f64 / 2.0, x / 2.0)
}

/// Chi-square two-sample test of whether `a` and `b` (outcome counts) come from one
/// distribution. Cells with fewer than `MIN_CELL` observations in both samples together are
/// merged into one. Returns (statistic, degrees of freedom, p-value).
fn two_sample_chi_square<K: std::hash::Hash + Eq + Copy + Ord>(
    a: &HashMap<K, u64>,
    b: &HashMap<K, u64>,
) -> (f64, usize, f64) {
    const MIN_CELL: u64 = 10;
    let mut keys: Vec<K> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let get = |m: &HashMap<K, u64>, k: &K| m.get(k).copied().unwrap_or(0);
    let mut cells: Vec<(u64, u64)> = Vec::new();
    let mut rest = (0u64, 0u64);
    for k in &keys {
        let (x, y) = (get(a, k), get(b, k));
        if x + y >= MIN_CELL {
            cells.push((x, y));
        } else {
            rest.0 += x;
            rest.1 += y;
        }
    }
    if rest.0 + rest.1 >= MIN_CELL || cells.is_empty() {
        cells.push(rest);
    } else if rest.0 + rest.1 > 0 {
        // Too small to stand alone: fold it into the smallest cell.
        let smallest = (0..cells.len())
            .min_by_key(|&i| cells[i].0 + cells[i].1)
            .unwrap();
        cells[smallest].0 += rest.0;
        cells[smallest].1 += rest.1;
    }
    let na: u64 = cells.iter().map(|c| c.0).sum();
    let nb: u64 = cells.iter().map(|c| c.1).sum();
    let (ka, kb) = (
        (nb as f64 / na as f64).sqrt(),
        (na as f64 / nb as f64).sqrt(),
    );
    let stat: f64 = cells
        .iter()
        .filter(|c| c.0 + c.1 > 0)
        .map(|&(x, y)| (ka * x as f64 - kb * y as f64).powi(2) / (x + y) as f64)
        .sum();
    let df = cells.len().saturating_sub(1).max(1);
    (stat, df, chi_square_tail(stat, df))
}

/// p-values of the (t1, t2) and (t2, t3) joint outcomes of two samples.
fn compare(a: &[Completion], b: &[Completion], label: &str) -> [f64; 2] {
    let mut ps = [0.0; 2];
    for (k, (i, j)) in [(0, 1), (1, 2)].into_iter().enumerate() {
        let (stat, df, p) = two_sample_chi_square(&counts(a, i, j), &counts(b, i, j));
        eprintln!(
            "{label}: tokens ({}, {}): chi2 {stat:.1}, df {df}, p {p:.3e}",
            i + 1,
            j + 1
        );
        ps[k] = p;
    }
    ps
}

#[test]
fn chi_square_tail_matches_known_values() {
    // df = 2 has the closed form exp(-x/2).
    for x in [0.1, 1.0, 5.0, 10.0, 40.0] {
        let want = (-x / 2.0f64).exp();
        assert!((chi_square_tail(x, 2) - want).abs() < 1e-12 * want.max(1e-300) + 1e-15);
    }
    // Upper critical values from standard tables.
    for (x, df, p) in [
        (3.841_459, 1, 0.05),
        (6.634_897, 1, 0.01),
        (18.307_038, 10, 0.05),
        (23.209_251, 10, 0.01),
        (124.342_113, 100, 0.05),
        (29.588_3, 10, 0.001),
    ] {
        let got = chi_square_tail(x, df);
        assert!(
            (got - p).abs() < 1e-4 * p,
            "tail({x}, {df}) = {got}, not {p}"
        );
    }
    assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-13);
    assert!((ln_gamma(10.0) - 362_880f64.ln()).abs() < 1e-12);
}

#[test]
fn dflash_sampling_follows_the_target_distribution() {
    let t0 = Instant::now();
    let s = setup();
    let mut ar = ArDecoder::new(s.target());
    let mut with_random =
        DflashDecoder::new(s.target(), random(&s), BLOCK, AcceptPolicy::PerRow).unwrap();
    let mut with_peek = DflashDecoder::new(
        s.target(),
        Peek::new(&s, SHARPEN, 0.5),
        BLOCK,
        AcceptPolicy::PerRow,
    )
    .unwrap();
    let mut with_random2 =
        DflashDecoder::new(s.target(), random2(&s), BLOCK, AcceptPolicy::PerRow).unwrap();
    let mut with_peek2 = DflashDecoder::new(
        s.target(),
        Peek::new(&s, SHARPEN, 0.5).with_lattice(),
        BLOCK,
        AcceptPolicy::PerRow,
    )
    .unwrap();
    let ids = shortlist(&s);
    let mut with_peek_listed = DflashDecoder::new(
        s.target(),
        Peek::new(&s, SHARPEN, 0.5).with_shortlist(ids.clone()),
        BLOCK,
        AcceptPolicy::PerRow,
    )
    .unwrap();
    let target = s.target();
    let mut listed = random(&s);
    listed
        .set_vocab_shortlist(ids.clone(), target.lm_head_rows(&ids).unwrap())
        .unwrap();
    let mut with_random_listed =
        DflashDecoder::new(target, listed, BLOCK, AcceptPolicy::PerRow).unwrap();
    let configs = [
        ("T=1", params(1.0, 1.0, 0)),
        ("T=1 top-p 0.8", params(1.0, 0.8, 0)),
        ("T=1 top-k 12", params(1.0, 1.0, 12)),
    ];
    let mut failures = Vec::new();
    for (label, p) in &configs {
        let plain = sample(&mut ar, &s, p, 0);
        let arms: [(&str, &mut dyn Decoder, u64); 6] = [
            ("random drafter", &mut with_random, 1_000_000),
            ("peeking drafter", &mut with_peek, 2_000_000),
            ("random DFlash2 drafter", &mut with_random2, 3_000_000),
            ("peeking lattice drafter", &mut with_peek2, 4_000_000),
            (
                "peeking drafter, shortlist",
                &mut with_peek_listed,
                5_000_000,
            ),
            (
                "random drafter, shortlist",
                &mut with_random_listed,
                6_000_000,
            ),
        ];
        for (name, dec, first) in arms {
            let drafted = sample(dec, &s, p, first);
            let accepted: usize = drafted.iter().map(|c| c.stats.accepted).sum();
            let proposed: usize = drafted.iter().map(|c| c.stats.drafted).sum();
            let what = format!("{label}, {name}");
            eprintln!("{what}: {accepted} of {proposed} drafts accepted");
            assert!(accepted > 0, "{what}: some drafts were accepted");
            assert!(accepted < proposed, "{what}: some drafts were rejected");
            for p in compare(&plain, &drafted, &what) {
                if p <= ALPHA {
                    failures.push(format!("{what}: p = {p:e}"));
                }
            }
        }
    }
    eprintln!("sampling distribution: {:.1} s", t0.elapsed().as_secs_f64());
    assert!(
        failures.is_empty(),
        "DFlash sampling differs from the target: {failures:?}"
    );
}

#[test]
fn the_statistic_has_power_and_is_calibrated() {
    let s = setup();
    let mut ar = ArDecoder::new(s.target());
    let base = sample(&mut ar, &s, &params(1.0, 1.0, 0), 0);
    // Two independent plain samples of one distribution: no rejection.
    let again = sample(&mut ar, &s, &params(1.0, 1.0, 0), 2_000_000);
    for p in compare(&base, &again, "plain T=1 vs plain T=1") {
        assert!(p > ALPHA, "same distribution, p = {p:e}");
    }
    // A wrong distribution (T = 1.3 instead of 1): rejected with a tiny p-value.
    let hot = sample(&mut ar, &s, &params(1.3, 1.0, 0), 3_000_000);
    let ps = compare(&base, &hot, "plain T=1 vs plain T=1.3");
    assert!(
        ps.iter().all(|&p| p < 1e-6),
        "the test tells T=1 from T=1.3: {ps:?}"
    );
}
