//! Token choice on the GPU against the engine's host definition.
//!
//! The CUDA backend's `argmax_rows`, `sample_rows`, `draft_rows` and `verify_rows` are run on
//! random logits (vocabularies of 49,152 and 151,936; normal, peaked, tied and masked rows;
//! top-k, top-p, min-p and repetition-penalty combinations; many uniforms) and compared with
//! `SamplingParams::distribution` + `Dist::pick`, `dflash::propose` and `dflash::judge`.
//! Greedy choices must agree exactly. Sampled ones may part only where the host's and the
//! device's sums (f64 on the host, fixed-order f64 and exact fixed point on the device) put a
//! boundary on different sides of u: the cumulative masses agree to about 1e-7 (f32 rounding
//! of the terms), so a different token is accepted only when u lies within [`BOUND`] of the
//! host's boundary between the two tokens (and an accept test only when `u * q(d)` lies within
//! it of `p(d)`); such cases are counted and printed, and must stay rare.
//!
//! End to end, on the tiny synthetic target: greedy DFlash equals greedy AR on the GPU, and
//! rows that choose on the device write what rows that choose on the host (`keep_logits`,
//! same GPU logits) write, at T = 0 and T > 0, for AR and DFlash.
//!
//! Every test opens the GPU first and prints "skipped: no CUDA device (<reason>)" without one.
#![cfg(feature = "cuda")]

mod common;

use std::sync::{Arc, OnceLock};

use common::{request, sharp_tiny_path};
use dflash_engine::ar::ArDecoder;
use dflash_engine::dflash::{judge, propose, residual, AcceptPolicy, DflashDecoder, Draws};
use dflash_engine::sampling::{argmax, Dist};
use dflash_engine::session::run_scheduled;
use dflash_engine::{Completion, Decoder, SamplingParams};
use dflash_models::load_model;
use dflash_models::synthetic::{drafter_config_for, random_drafter, special_id};
use dflash_models::DflashDrafter;
use dflash_runtime::choice::{DraftRow, SampleRow, Verdict, VerifyRow};
use dflash_runtime::cuda::{CudaBackend, CudaTensor};
use dflash_runtime::Backend;
use rand::{Rng, SeedableRng};

/// Vocabularies of the default model and of Qwen.
const VOCABS: [usize; 2] = [49_152, 151_936];
/// How far apart the host's and the device's cumulative masses may be (see the module docs).
const BOUND: f64 = 1e-6;

fn gpu() -> Option<Arc<CudaBackend>> {
    static GPU: OnceLock<Result<Arc<CudaBackend>, String>> = OnceLock::new();
    match GPU.get_or_init(|| CudaBackend::new().map(Arc::new).map_err(|e| e.to_string())) {
        Ok(b) => Some(b.clone()),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            None
        }
    }
}

fn rng(seed: u64) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// A standard normal draw (Box-Muller).
fn normal(r: &mut impl Rng) -> f32 {
    let u1: f64 = r.random_range(1e-12..1.0);
    let u2: f64 = r.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Kinds of logits rows.
const KINDS: [&str; 4] = ["normal", "peaked", "ties", "masked"];

fn logits_row(kind: &str, v: usize, r: &mut impl Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..v).map(|_| 2.5 * normal(r)).collect();
    match kind {
        "normal" => {}
        "peaked" => {
            for _ in 0..5 {
                let i = r.random_range(0..v);
                x[i] += 12.0 + 3.0 * normal(r);
            }
        }
        "ties" => {
            // Coarse values: many exact ties, also at the top.
            for l in &mut x {
                *l = (*l * 2.0).round() / 2.0;
            }
            let top = x.iter().copied().fold(f32::MIN, f32::max);
            for _ in 0..3 {
                let i = r.random_range(0..v);
                x[i] = top;
            }
        }
        "masked" => {
            for l in &mut x {
                if r.random::<f32>() < 0.3 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        _ => unreachable!(),
    }
    x
}

fn history(v: usize, r: &mut impl Rng) -> Vec<u32> {
    let n = r.random_range(0..300);
    let mut h: Vec<u32> = (0..n).map(|_| r.random_range(0..v as u32)).collect();
    // Repeats, which the penalty must count once.
    if n > 10 {
        h.extend_from_within(..10);
    }
    h
}

fn params(t: f32, top_k: usize, top_p: f32, min_p: f32, rep: f32) -> SamplingParams {
    SamplingParams {
        temperature: t,
        top_k,
        top_p,
        min_p,
        repetition_penalty: rep,
        ..Default::default()
    }
}

/// Parameter combinations: greedy with and without the penalty, temperatures alone, each
/// filter alone and combined.
fn grid() -> Vec<SamplingParams> {
    vec![
        params(0.0, 0, 1.0, 0.0, 1.0),
        params(0.0, 0, 1.0, 0.0, 1.3),
        params(1.0, 0, 1.0, 0.0, 1.0),
        params(0.7, 0, 1.0, 0.0, 1.0),
        params(1.5, 0, 1.0, 0.0, 1.2),
        params(1.0, 1, 1.0, 0.0, 1.0),
        params(1.0, 40, 1.0, 0.0, 1.0),
        params(0.8, 1000, 1.0, 0.0, 1.1),
        params(1.0, 0, 0.9, 0.0, 1.0),
        params(1.0, 0, 0.5, 0.0, 1.0),
        params(1.0, 0, 1.0, 0.05, 1.0),
        params(0.9, 50, 0.8, 0.02, 1.0),
        params(1.2, 0, 0.95, 0.01, 1.3),
        params(1.0, 200_000, 1.0, 0.0, 1.0),
    ]
}

/// Uniforms: the ends of the range and random ones.
fn uniforms(n: usize, r: &mut impl Rng) -> Vec<f32> {
    let mut u = vec![0.0, 1.0 - f32::EPSILON / 2.0];
    u.extend((2..n).map(|_| r.random::<f32>()));
    u.truncate(n);
    u
}

#[derive(Default)]
struct Tally {
    picks: usize,
    boundary: usize,
}

impl Tally {
    fn report(&self, what: &str) {
        println!(
            "{what}: {} choices, {} within {BOUND:e} of a boundary",
            self.picks, self.boundary
        );
        assert!(
            self.boundary * 100 <= self.picks.max(100),
            "{what}: too many boundary cases ({} of {})",
            self.boundary,
            self.picks
        );
    }
}

/// Checks a device pick against the host's: equal, or u within BOUND of the host's boundary
/// between the two tokens (nothing of positive mass between them).
fn check_pick(dist: &Dist, u: f32, host: u32, dev: u32, what: &str, tally: &mut Tally) {
    tally.picks += 1;
    if host == dev {
        return;
    }
    let pos = |id: u32| dist.items.iter().position(|x| x.0 == id);
    let (Some(a), Some(b)) = (pos(host), pos(dev)) else {
        panic!("{what}: device token {dev} is not in the host distribution (host {host})");
    };
    let (lo, hi) = (a.min(b), a.max(b));
    assert!(
        dist.items[lo + 1..hi].iter().all(|x| x.1 == 0.0),
        "{what}: u = {u}: host {host} (at {a}) and device {dev} (at {b}) are not neighbours"
    );
    let boundary: f64 = dist.items[..hi].iter().map(|x| x.1 as f64).sum();
    let gap = (u as f64 - boundary).abs();
    assert!(
        gap <= BOUND,
        "{what}: u = {u}: host {host}, device {dev}, boundary {boundary} is {gap:e} away"
    );
    println!("boundary case ({what}): u = {u}, boundary {boundary}, host {host}, device {dev}");
    tally.boundary += 1;
}

fn upload(b: &CudaBackend, rows: &[Vec<f32>]) -> CudaTensor {
    let v = rows.first().map_or(0, Vec::len);
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    b.upload(&flat, rows.len(), v)
}

#[test]
fn argmax_is_exact() {
    let Some(b) = gpu() else { return };
    let mut r = rng(1);
    for v in [1usize, 100, 4095, 4096, 4097, 49_152, 151_936] {
        for rows in [1usize, 5, 64] {
            let mut data: Vec<Vec<f32>> = (0..rows)
                .map(|i| logits_row(KINDS[i % KINDS.len()], v, &mut r))
                .collect();
            // A NaN (never chosen), a row of -inf (0), ties at the top.
            data[0][v / 2] = f32::NAN;
            if rows > 2 {
                data[1].fill(f32::NEG_INFINITY);
                let top = data[2].iter().copied().fold(f32::MIN, f32::max) + 1.0;
                let (i, j) = (v / 3, v - 1);
                data[2][j] = top;
                data[2][i] = top;
            }
            let t = upload(&b, &data);
            let want: Vec<u32> = data.iter().map(|x| argmax(x)).collect();
            assert_eq!(b.argmax_rows(&t), want, "argmax, vocab {v}, {rows} rows");
            let plain: Vec<SampleRow<'_>> = (0..rows)
                .map(|_| SampleRow {
                    params: SamplingParams::greedy().device().unwrap(),
                    history: &[],
                    u: 0.5,
                })
                .collect();
            assert_eq!(b.sample_rows(&t, &plain), Some(want));
        }
    }
}

#[test]
fn sampling_matches_the_host() {
    let Some(b) = gpu() else { return };
    let mut r = rng(2);
    const ROWS: usize = 4;
    const US: usize = 12;
    let mut tally = Tally::default();
    let mut scratch = Vec::new();
    for v in VOCABS {
        for (pi, p) in grid().into_iter().enumerate() {
            let data: Vec<Vec<f32>> = (0..ROWS)
                .map(|i| logits_row(KINDS[(i + pi) % KINDS.len()], v, &mut r))
                .collect();
            let hists: Vec<Vec<u32>> = (0..ROWS).map(|_| history(v, &mut r)).collect();
            let t = upload(&b, &data);
            let dists: Vec<Dist> = (0..ROWS)
                .map(|i| p.distribution(&data[i], &hists[i], &mut scratch))
                .collect();
            let us: Vec<Vec<f32>> = (0..ROWS).map(|_| uniforms(US, &mut r)).collect();
            // One call per column of uniforms.
            let columns: Vec<Vec<f32>> = (0..US)
                .map(|k| us.iter().map(|row| row[k]).collect())
                .collect();
            for uk in &columns {
                let rows: Vec<SampleRow<'_>> = (0..ROWS)
                    .map(|i| SampleRow {
                        params: p.device().unwrap(),
                        history: &hists[i],
                        u: uk[i],
                    })
                    .collect();
                let got = b.sample_rows(&t, &rows).expect("the CUDA backend samples");
                for i in 0..ROWS {
                    let u = uk[i];
                    let what = format!("vocab {v}, {p:?}, row {i} ({})", KINDS[(i + pi) % 4]);
                    if p.is_greedy() {
                        assert_eq!(got[i], dists[i].items[0].0, "{what}");
                    }
                    check_pick(&dists[i], u, dists[i].pick(u), got[i], &what, &mut tally);
                }
            }
        }
    }
    tally.report("sample_rows");
}

#[test]
fn drafts_match_the_host() {
    let Some(b) = gpu() else { return };
    let mut r = rng(3);
    const ROWS: usize = 3;
    const SLOTS: usize = 5;
    let mut tally = Tally::default();
    let mut scratch = Vec::new();
    for v in VOCABS {
        for p in grid() {
            let data: Vec<Vec<f32>> = (0..ROWS * SLOTS)
                .map(|i| logits_row(KINDS[i % KINDS.len()], v, &mut r))
                .collect();
            let hists: Vec<Vec<u32>> = (0..ROWS).map(|_| history(v, &mut r)).collect();
            let us: Vec<Vec<f32>> = (0..ROWS).map(|_| uniforms(SLOTS, &mut r)).collect();
            let t = upload(&b, &data);
            let rows: Vec<DraftRow<'_>> = (0..ROWS)
                .map(|i| DraftRow {
                    params: p.device().unwrap(),
                    history: &hists[i],
                    u: &us[i],
                })
                .collect();
            let got = b
                .draft_rows(&t, SLOTS, &rows)
                .expect("the CUDA backend drafts");
            for i in 0..ROWS {
                let flat: Vec<f32> = data[i * SLOTS..(i + 1) * SLOTS].concat();
                let (want, qs) = propose(&p, &hists[i], &flat, v, &us[i], &mut scratch);
                for s in 0..SLOTS {
                    let what = format!("vocab {v}, {p:?}, row {i}, slot {s}");
                    let dev = got[i * SLOTS + s];
                    check_pick(&qs[s], us[i][s], want[s], dev, &what, &mut tally);
                    if dev != want[s] {
                        // A boundary case: later slots see another history.
                        break;
                    }
                }
            }
        }
    }
    tally.report("draft_rows");
}

/// Target logits near the drafter's, so that drafts are accepted at varied lengths.
fn near(x: &[f32], noise: f32, r: &mut impl Rng) -> Vec<f32> {
    x.iter().map(|&l| l + noise * normal(r)).collect()
}

#[test]
fn verification_matches_the_host() {
    let Some(b) = gpu() else { return };
    let mut r = rng(4);
    const ROWS: usize = 4;
    const BLOCK: usize = 6;
    const N: usize = BLOCK - 1;
    let mut tally = Tally::default();
    let mut tests = Tally::default();
    let mut accepted_at = [0usize; BLOCK];
    let mut scratch = Vec::new();
    for v in VOCABS {
        for p in grid() {
            for noise in [0.05f32, 1.0] {
                let draft: Vec<Vec<f32>> = (0..ROWS * N)
                    .map(|i| logits_row(KINDS[i % KINDS.len()], v, &mut r))
                    .collect();
                let hists: Vec<Vec<u32>> = (0..ROWS).map(|_| history(v, &mut r)).collect();
                let draws: Vec<Draws> = (0..ROWS)
                    .map(|_| {
                        let u = uniforms(2 * N + 1, &mut r);
                        Draws {
                            draft: u[..N].to_vec(),
                            accept: u[N..2 * N].to_vec(),
                            last: u[2 * N],
                        }
                    })
                    .collect();
                // Drafts as the host draws them; the target's block: the drafter's slots
                // plus noise, and one more slot.
                let mut target: Vec<Vec<f32>> = Vec::new();
                let mut proposals = Vec::new();
                for i in 0..ROWS {
                    let flat: Vec<f32> = draft[i * N..(i + 1) * N].concat();
                    proposals.push(propose(
                        &p,
                        &hists[i],
                        &flat,
                        v,
                        &draws[i].draft,
                        &mut scratch,
                    ));
                    for s in 0..N {
                        target.push(near(&draft[i * N + s], noise, &mut r));
                    }
                    target.push(logits_row("normal", v, &mut r));
                }
                let (tt, dt) = (upload(&b, &target), upload(&b, &draft));
                let rows: Vec<VerifyRow<'_>> = (0..ROWS)
                    .map(|i| VerifyRow {
                        params: p.device().unwrap(),
                        history: &hists[i],
                        drafts: &proposals[i].0,
                        accept_u: &draws[i].accept,
                        last_u: draws[i].last,
                    })
                    .collect();
                let got = b
                    .verify_rows(&tt, &dt, BLOCK, &rows)
                    .expect("the CUDA backend verifies");
                for i in 0..ROWS {
                    let block: Vec<f32> = target[i * BLOCK..(i + 1) * BLOCK].concat();
                    let (drafts, qs) = (&proposals[i].0, &proposals[i].1);
                    let want = judge(
                        &p,
                        &hists[i],
                        &block,
                        v,
                        (drafts, qs),
                        &draws[i],
                        &mut scratch,
                    );
                    let what = format!("vocab {v}, {p:?}, noise {noise}, row {i}");
                    check_verdict(
                        &p,
                        &hists[i],
                        &block,
                        v,
                        (drafts, qs),
                        &draws[i],
                        want,
                        got[i],
                        &what,
                        (&mut tally, &mut tests),
                    );
                    accepted_at[want.accepted] += 1;
                }
            }
        }
    }
    println!("host accept counts 0..={N}: {accepted_at:?}");
    assert!(
        accepted_at.iter().filter(|&&c| c > 0).count() >= 3,
        "the cases cover several accept counts"
    );
    tally.report("verify_rows tokens");
    tests.report("verify_rows accept tests");
}

/// A device verdict against the host's: equal, or parted at a boundary (an accept test with
/// `u * q(d)` within BOUND of `p(d)`, or the token's u within BOUND of a boundary).
#[allow(clippy::too_many_arguments)]
fn check_verdict(
    p: &SamplingParams,
    history: &[u32],
    block: &[f32],
    v: usize,
    (drafts, qs): (&[u32], &[Dist]),
    draws: &Draws,
    want: Verdict,
    got: Verdict,
    what: &str,
    (tally, tests): (&mut Tally, &mut Tally),
) {
    let mut scratch = Vec::new();
    let mut hist = history.to_vec();
    hist.extend_from_slice(&drafts[..want.accepted.min(got.accepted)]);
    let slot = want.accepted.min(got.accepted);
    let pd = p.distribution(&block[slot * v..(slot + 1) * v], &hist, &mut scratch);
    tests.picks += slot + 1;
    if want.accepted != got.accepted {
        assert!(
            !p.is_greedy(),
            "{what}: greedy accept counts differ: {want:?} vs {got:?}"
        );
        let d = drafts[slot];
        let lhs = draws.accept[slot] as f64 * qs[slot].prob(d) as f64;
        let gap = (lhs - pd.prob(d) as f64).abs();
        assert!(
            gap <= BOUND,
            "{what}: accept counts {want:?} vs {got:?}, test {gap:e} from its boundary"
        );
        println!("boundary case ({what}): accept test at slot {slot}, {gap:e} from its boundary");
        tests.boundary += 1;
        return;
    }
    if p.is_greedy() {
        assert_eq!(want, got, "{what}");
        return;
    }
    let dist = if want.accepted < drafts.len() {
        residual(&pd, &qs[want.accepted])
    } else {
        pd
    };
    check_pick(&dist, draws.last, want.token, got.token, what, tally);
}

// ---- end to end on the tiny synthetic target ---------------------------------------------

const BLOCK: usize = 4;

fn gpu_target(
    b: &Arc<CudaBackend>,
) -> (
    dflash_models::TargetModel<CudaBackend>,
    dflash_models::tokenizer::TextTokenizer,
    Vec<u32>,
) {
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    let prompt = m.tokenizer.encode("Once upon a", false).unwrap();
    (m.model, m.tokenizer, prompt)
}

fn gpu_drafter(b: &Arc<CudaBackend>) -> DflashDrafter<CudaBackend> {
    let mask = special_id("<|mask|>");
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, mask);
    DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 3)).unwrap()
}

fn run(
    dec: &mut dyn Decoder,
    tok: &dflash_models::tokenizer::TextTokenizer,
    prompt: &[u32],
    p: &SamplingParams,
    rows: u64,
) -> Vec<Completion> {
    let requests: Vec<_> = (0..rows)
        .map(|seed| request(prompt.to_vec(), 24, SamplingParams { seed, ..p.clone() }))
        .collect();
    run_scheduled(dec, tok, &requests, 8, &mut |_, _| {}).unwrap()
}

fn tokens(c: &[Completion]) -> Vec<Vec<u32>> {
    c.iter().map(|c| c.tokens.clone()).collect()
}

#[test]
fn decoders_choose_on_the_device_as_on_the_host() {
    let Some(b) = gpu() else { return };
    for p in [
        params(0.0, 0, 1.0, 0.0, 1.0),
        params(0.0, 0, 1.0, 0.0, 1.3),
        params(1.0, 0, 1.0, 0.0, 1.0),
        params(0.8, 12, 0.9, 0.02, 1.2),
    ] {
        let host = SamplingParams {
            keep_logits: true,
            ..p.clone()
        };
        let (t, tok, prompt) = gpu_target(&b);
        let mut ar = ArDecoder::new(t);
        let ar_dev = run(&mut ar, &tok, &prompt, &p, 6);
        let ar_host = run(&mut ar, &tok, &prompt, &host, 6);
        assert_eq!(tokens(&ar_dev), tokens(&ar_host), "AR, {p:?}");

        let (t, _, _) = gpu_target(&b);
        let mut dd = DflashDecoder::new(t, gpu_drafter(&b), BLOCK, AcceptPolicy::PerRow).unwrap();
        let df_dev = run(&mut dd, &tok, &prompt, &p, 6);
        let df_host = run(&mut dd, &tok, &prompt, &host, 6);
        assert_eq!(tokens(&df_dev), tokens(&df_host), "DFlash, {p:?}");
        if p.is_greedy() {
            assert_eq!(
                tokens(&df_dev),
                tokens(&ar_dev),
                "greedy DFlash equals greedy AR, {p:?}"
            );
        }
        println!("{p:?}: AR and DFlash agree on device and host");
    }
}

/// A DFlash2 drafter on the GPU: its candidates are ranked on the device
/// (`Backend::top_k_rows`); they equal the host's top-k of the same device logits, and greedy
/// DFlash2 still writes what greedy AR writes.
#[test]
fn dflash2_candidates_are_ranked_on_the_device_as_on_the_host() {
    use dflash_models::selector::top_k_indices;
    use dflash_models::synthetic::dflash2_config_for;
    use dflash_models::Drafter;
    let Some(b) = gpu() else { return };
    let (t, tok, prompt) = gpu_target(&b);
    let vocab = dflash_models::Target::vocab(&t);
    let mask = special_id("<|mask|>");
    let cfg = dflash2_config_for(
        drafter_config_for(64, 4, 2, 128, 4, 1, BLOCK, mask),
        vocab,
        64,
    );
    assert!(cfg.dflash2.as_ref().unwrap().transform_is_identity());
    let drafter = DflashDrafter::load(b.clone(), cfg.clone(), &random_drafter(&cfg, 5)).unwrap();
    let mut dd = DflashDecoder::new(t, drafter, BLOCK, AcceptPolicy::PerRow).unwrap();
    let p = params(0.0, 0, 1.0, 0.0, 1.0);
    let got = run(&mut dd, &tok, &prompt, &p, 3);
    let lattice = dd
        .drafter
        .lattice()
        .expect("a DFlash2 drafter builds a lattice")
        .clone();
    let k = lattice.top_k();
    assert!(lattice.rows() > 0 && lattice.slots() == BLOCK - 1);
    let logits = b.to_host(dd.drafter.logits());
    let mut order = Vec::new();
    for row in 0..lattice.rows() {
        for slot in 0..lattice.slots() {
            let at = (row * lattice.slots() + slot) * vocab;
            top_k_indices(&logits[at..at + vocab], k, &mut order);
            assert_eq!(
                lattice.candidates(row, slot),
                &order[..],
                "row {row} slot {slot}"
            );
        }
    }
    let (t, _, _) = gpu_target(&b);
    let mut ar = ArDecoder::new(t);
    assert_eq!(
        tokens(&got),
        tokens(&run(&mut ar, &tok, &prompt, &p, 3)),
        "greedy DFlash2 equals greedy AR"
    );
    println!(
        "DFlash2 on the GPU: {} rows x {} slots of candidates ranked as on the host",
        lattice.rows(),
        lattice.slots()
    );
}
