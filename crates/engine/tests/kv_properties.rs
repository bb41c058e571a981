//! Properties of per-row cache commits and attention masks under random accept patterns.
//!
//! On the CPU backend's KV cache (its default type, f16; several rows, 2 KV heads, GQA; the
//! random K/V values are ones the cache holds exactly): every round each row writes
//! a block at its current length, then commits a random accept count (or, under the clamp,
//! the round's minimum) by moving its length — rejected slots stay behind as stale data and
//! rows sometimes grow their storage, finish, or are replaced by new rows. After every round:
//! (i) each row's valid prefix is exactly its committed K/V, in order, with no gaps; (ii)
//! attention of a query with `kv_end = len` (and a random `kv_start`) equals attention
//! computed in f64 on that row's committed K/V alone — queries never see rejected slots or
//! other rows; (iii) during verification, block token j sees the committed prefix plus block
//! tokens 0..=j (the causal block mask).
//!
//! At the session level, on a tiny synthetic target: random batches (ragged prompts, token
//! limits, `max_live`, block sizes, per-row or clamp policy) with a drafter whose errors fall
//! at random block slots give exactly the B=1 greedy output, and every row's accepted total is
//! its own accept counts (per-row) or the round minima (clamp).

mod common;

use std::cell::{Cell, RefCell};
use std::sync::{Arc, OnceLock};

use common::{ar_reference, request, sharp_tiny_path, Oracle, Schedule};
use dflash_engine::dflash::{AcceptPolicy, DflashDecoder};
use dflash_engine::session::run_scheduled;
use dflash_engine::{FinishReason, SamplingParams};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::TargetModel;
use dflash_models::{load_model, Target};
use dflash_runtime::backend::{AttnShape, TokenMeta};
use dflash_runtime::cpu::{CpuBackend, CpuKv, CpuTensor};
use dflash_runtime::Backend;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use rand::{Rng, SeedableRng};

const LAYERS: usize = 2;
const KV_HEADS: usize = 2;
const HEADS: usize = 4;

fn cpu() -> &'static CpuBackend {
    static B: OnceLock<CpuBackend> = OnceLock::new();
    B.get_or_init(|| CpuBackend::new(1))
}

/// One round's choices for every row.
#[derive(Clone, Debug)]
struct Round {
    /// Accepted drafts per row (committed = accepted + 1), in `0..block`.
    accepts: Vec<usize>,
    /// Rows that finish after this round and are replaced by a new row in the same slot.
    rejoin: Vec<bool>,
}

#[derive(Clone, Debug)]
struct Plan {
    rows: usize,
    block: usize,
    head_dim: usize,
    clamp: bool,
    prompts: Vec<usize>,
    rounds: Vec<Round>,
    seed: u64,
}

fn plan() -> impl Strategy<Value = Plan> {
    (
        1usize..=4,
        2usize..=8,
        prop_oneof![Just(8usize), Just(12), Just(16)],
    )
        .prop_flat_map(|(rows, block, head_dim)| {
            let round = (
                prop::collection::vec(0..block, rows),
                prop::collection::vec(prop::bool::weighted(0.15), rows),
            )
                .prop_map(|(accepts, rejoin)| Round { accepts, rejoin });
            (
                Just(rows),
                Just(block),
                Just(head_dim),
                any::<bool>(),
                prop::collection::vec(1usize..=12, rows),
                prop::collection::vec(round, 1..=8),
                any::<u64>(),
            )
        })
        .prop_map(
            |(rows, block, head_dim, clamp, prompts, rounds, seed)| Plan {
                rows,
                block,
                head_dim,
                clamp,
                prompts,
                rounds,
                seed,
            },
        )
}

/// One position's K and V, one vector per layer.
type PerLayer = Vec<Vec<f32>>;
/// A position to write: (row, position, k, v).
type Write = (usize, usize, PerLayer, PerLayer);
/// What a query may see: K and V rows.
type Visible = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// The model of the cache: what each row has committed, per layer, as (k, v) rows.
struct Committed {
    /// `kv[layer][row]`: committed positions of `kv_dim` values each.
    k: Vec<Vec<Vec<Vec<f32>>>>,
    v: Vec<Vec<Vec<Vec<f32>>>>,
}

impl Committed {
    fn len(&self, row: usize) -> usize {
        self.k[0][row].len()
    }
}

/// Random rows of values the test backend's KV cache holds exactly.
fn random_rows(rng: &mut rand::rngs::StdRng, n: usize, dim: usize) -> Vec<Vec<f32>> {
    let ty = cpu().kv_type();
    (0..n)
        .map(|_| {
            (0..dim)
                .map(|_| ty.round(rng.random_range(-1.0f32..1.0)))
                .collect()
        })
        .collect()
}

/// Writes `tokens[t]` = (row, pos, k per layer, v per layer) into the cache in one call per
/// layer (rows interleaved, as a batched forward does).
fn write(kv: &mut CpuKv, tokens: &[Write], dim: usize) {
    let b = cpu();
    let meta: Vec<TokenMeta> = tokens
        .iter()
        .map(|(r, p, _, _)| TokenMeta::causal(*r as u32, *p as u32))
        .collect();
    let meta = b.upload_meta(&meta);
    for l in 0..LAYERS {
        let mut k = CpuTensor::zeros(tokens.len(), dim);
        let mut v = CpuTensor::zeros(tokens.len(), dim);
        for (t, tok) in tokens.iter().enumerate() {
            k.row_mut(t).copy_from_slice(&tok.2[l]);
            v.row_mut(t).copy_from_slice(&tok.3[l]);
        }
        b.kv_write(kv, l, &k, &v, &meta);
    }
}

/// Makes room for `need` positions the way the target does (double, keep the valid prefix).
fn ensure(kv: &mut CpuKv, row: usize, need: usize, keep: usize) {
    let b = cpu();
    let cap = b.kv_capacity(kv, row);
    if need > cap {
        b.kv_reserve(kv, row, need.max(cap * 2), keep);
    }
}

/// Attention in f64 of one query (`HEADS x head_dim`) over explicit K/V rows.
fn reference_attention(
    q: &[f32],
    k: &[&[f32]],
    v: &[&[f32]],
    head_dim: usize,
    scale: f32,
) -> Vec<f64> {
    let group = HEADS / KV_HEADS;
    let mut out = vec![0f64; HEADS * head_dim];
    for h in 0..HEADS {
        let off = (h / group) * head_dim;
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let scores: Vec<f64> = k
            .iter()
            .map(|kr| {
                qh.iter()
                    .zip(&kr[off..off + head_dim])
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        if scores.is_empty() {
            continue;
        }
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        for (wi, vr) in w.iter().zip(v) {
            for d in 0..head_dim {
                out[h * head_dim + d] += wi / sum * vr[off + d] as f64;
            }
        }
    }
    out
}

/// Runs the backend's attention for `queries` = (meta, q) and compares every output with the
/// f64 reference over the K/V rows `visible(layer, query index)`.
fn check_attention(
    kv: &CpuKv,
    queries: &[(TokenMeta, Vec<f32>)],
    head_dim: usize,
    visible: &dyn Fn(usize, usize) -> Visible,
    what: &str,
) -> Result<(), TestCaseError> {
    if queries.is_empty() {
        return Ok(());
    }
    let b = cpu();
    let shape = AttnShape {
        n_heads: HEADS,
        n_kv_heads: KV_HEADS,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
    };
    let meta: Vec<TokenMeta> = queries.iter().map(|x| x.0).collect();
    let meta = b.upload_meta(&meta);
    let mut q = CpuTensor::zeros(queries.len(), HEADS * head_dim);
    for (t, (_, qv)) in queries.iter().enumerate() {
        q.row_mut(t).copy_from_slice(qv);
    }
    for l in 0..LAYERS {
        let mut out = CpuTensor::default();
        b.run(|| b.attention(&q, kv, l, &meta, shape, &mut out));
        for (t, (m, qv)) in queries.iter().enumerate() {
            let (ks, vs) = visible(l, t);
            let kr: Vec<&[f32]> = ks.iter().map(Vec::as_slice).collect();
            let vr: Vec<&[f32]> = vs.iter().map(Vec::as_slice).collect();
            let want = reference_attention(qv, &kr, &vr, head_dim, shape.scale);
            for (i, (&got, &w)) in out.row(t).iter().zip(&want).enumerate() {
                prop_assert!(
                    (got as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "{what}: layer {l} query {t} ({m:?}) output {i}: {got} vs reference {w}"
                );
            }
        }
    }
    Ok(())
}

fn run_plan(p: &Plan) -> Result<(), TestCaseError> {
    let b = cpu();
    let dim = KV_HEADS * p.head_dim;
    let mut rng = rand::rngs::StdRng::seed_from_u64(p.seed);
    let mut kv = b.kv_new(LAYERS, KV_HEADS, p.head_dim);
    let mut c = Committed {
        k: vec![vec![Vec::new(); p.rows]; LAYERS],
        v: vec![vec![Vec::new(); p.rows]; LAYERS],
    };
    let kv_rows = |rng: &mut rand::rngs::StdRng, n: usize| -> Vec<(PerLayer, PerLayer)> {
        (0..n)
            .map(|_| (random_rows(rng, LAYERS, dim), random_rows(rng, LAYERS, dim)))
            .collect()
    };

    // Prefill: every row's prompt in one interleaved batch, into storage barely large enough.
    let mut prefill = Vec::new();
    for (r, &n) in p.prompts.iter().enumerate() {
        b.kv_reserve(&mut kv, r, n, 0);
        for (pos, (k, v)) in kv_rows(&mut rng, n).into_iter().enumerate() {
            for l in 0..LAYERS {
                c.k[l][r].push(k[l].clone());
                c.v[l][r].push(v[l].clone());
            }
            prefill.push((r, pos, k, v));
        }
    }
    // Rows interleave token by token.
    prefill.sort_by_key(|t| (t.1, t.0));
    write(&mut kv, &prefill, dim);

    for (ri, round) in p.rounds.iter().enumerate() {
        // Verify: every row writes a block of `block` positions at its length, one batch.
        let mut blocks = Vec::new();
        let mut tokens = Vec::new();
        for r in 0..p.rows {
            let len = c.len(r);
            ensure(&mut kv, r, len + p.block, len);
            let blk = kv_rows(&mut rng, p.block);
            for (j, (k, v)) in blk.iter().enumerate() {
                tokens.push((r, len + j, k.clone(), v.clone()));
            }
            blocks.push(blk);
        }
        write(&mut kv, &tokens, dim);

        // (iii) The block mask: block token j of row r sees its committed prefix and block
        // tokens 0..=j, nothing stale and nothing of other rows.
        let mut queries = Vec::new();
        for (r, blk) in blocks.iter().enumerate() {
            for j in 0..blk.len() {
                let pos = (c.len(r) + j) as u32;
                let q: Vec<f32> = random_rows(&mut rng, 1, HEADS * p.head_dim).remove(0);
                queries.push((TokenMeta::causal(r as u32, pos), q));
            }
        }
        let visible = |l: usize, t: usize| {
            let m = queries[t].0;
            let r = m.row as usize;
            let j = m.pos as usize - c.len(r);
            let mut ks = c.k[l][r].clone();
            let mut vs = c.v[l][r].clone();
            for (k, v) in &blocks[r][..=j] {
                ks.push(k[l].clone());
                vs.push(v[l].clone());
            }
            (ks, vs)
        };
        check_attention(&kv, &queries, p.head_dim, &visible, "block mask")?;

        // Commit: each row its own count, or the round's minimum under the clamp.
        let floor = round.accepts.iter().copied().min().unwrap_or(0);
        for (r, blk) in blocks.iter().enumerate() {
            let accepted = if p.clamp { floor } else { round.accepts[r] };
            for (k, v) in &blk[..accepted + 1] {
                for l in 0..LAYERS {
                    c.k[l][r].push(k[l].clone());
                    c.v[l][r].push(v[l].clone());
                }
            }
        }

        // Some rows finish; a new row takes the freed slot with a fresh prompt.
        let mut joined = Vec::new();
        for r in 0..p.rows {
            if round.rejoin[r] {
                b.kv_release(&mut kv, r);
                let n = rng.random_range(1..=12);
                b.kv_reserve(&mut kv, r, n, 0);
                for l in 0..LAYERS {
                    c.k[l][r].clear();
                    c.v[l][r].clear();
                }
                for (pos, (k, v)) in kv_rows(&mut rng, n).into_iter().enumerate() {
                    for l in 0..LAYERS {
                        c.k[l][r].push(k[l].clone());
                        c.v[l][r].push(v[l].clone());
                    }
                    joined.push((r, pos, k, v));
                }
            }
        }
        write(&mut kv, &joined, dim);

        // (i) Every row's valid prefix is exactly its committed K/V, contiguous and in order.
        for l in 0..LAYERS {
            for r in 0..p.rows {
                let len = c.len(r);
                prop_assert!(b.kv_capacity(&kv, r) >= len);
                let (got_k, got_v) = kv.read(l, r, 0..len);
                let want_k: Vec<f32> = c.k[l][r].concat();
                let want_v: Vec<f32> = c.v[l][r].concat();
                prop_assert_eq!(
                    &got_k[..],
                    &want_k[..],
                    "round {} layer {} row {}: K prefix",
                    ri,
                    l,
                    r
                );
                prop_assert_eq!(
                    &got_v[..],
                    &want_v[..],
                    "round {} layer {} row {}: V prefix",
                    ri,
                    l,
                    r
                );
            }
        }

        // (ii) A query at the next position (kv_end = len, random kv_start) sees exactly the
        // committed K/V in its window.
        let mut queries = Vec::new();
        for r in 0..p.rows {
            let len = c.len(r);
            let start = if rng.random_bool(0.5) {
                0
            } else {
                rng.random_range(0..len)
            };
            let q: Vec<f32> = random_rows(&mut rng, 1, HEADS * p.head_dim).remove(0);
            let m = TokenMeta {
                row: r as u32,
                pos: len as u32,
                kv_start: start as u32,
                kv_end: len as u32,
            };
            queries.push((m, q));
        }
        let visible = |l: usize, t: usize| {
            let m = queries[t].0;
            let (r, s, e) = (m.row as usize, m.kv_start as usize, m.kv_end as usize);
            (c.k[l][r][s..e].to_vec(), c.v[l][r][s..e].to_vec())
        };
        check_attention(&kv, &queries, p.head_dim, &visible, "committed prefix")?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn per_row_commits_keep_caches_exact_and_masks_tight(p in plan()) {
        run_plan(&p)?;
    }
}

// --- session level ------------------------------------------------------------------------

fn tiny_target(b: &Arc<CpuBackend>) -> (TargetModel<CpuBackend>, TextTokenizer) {
    let m = load_model(b.clone(), sharp_tiny_path()).unwrap();
    (m.model, m.tokenizer)
}

#[derive(Clone, Debug)]
struct Batch {
    prompts: Vec<Vec<u32>>,
    max_tokens: Vec<usize>,
    max_live: usize,
    block: usize,
    clamp: bool,
    seed: u64,
}

fn batch() -> impl Strategy<Value = Batch> {
    (1usize..=5)
        .prop_flat_map(|n| {
            (
                prop::collection::vec(prop::collection::vec(0u32..256, 1..=20), n),
                prop::collection::vec(1usize..=24, n),
                1usize..=n + 1,
                2usize..=6,
                any::<bool>(),
                any::<u64>(),
            )
        })
        .prop_map(
            |(prompts, max_tokens, max_live, block, clamp, seed)| Batch {
                prompts,
                max_tokens,
                max_live,
                block,
                clamp,
                seed,
            },
        )
}

#[test]
fn session_per_row_and_clamp_equal_b1_with_exact_accepts() {
    let b = Arc::new(CpuBackend::new(1));
    let slot: RefCell<Option<(TargetModel<CpuBackend>, TextTokenizer)>> = RefCell::new(None);
    let mut runner = TestRunner::new(Config {
        cases: 128,
        failure_persistence: None,
        ..Config::default()
    });
    let different = Cell::new(0usize);
    runner
        .run(&batch(), |case| {
            let (target, tok) = slot.borrow_mut().take().unwrap_or_else(|| tiny_target(&b));
            let longest = *case.max_tokens.iter().max().unwrap();
            let (refs, target) = ar_reference(target, &tok, &case.prompts, longest + case.block);
            let schedule = match case.seed % 3 {
                0 => Schedule::Rotating,
                1 => Schedule::OneRowPerRound,
                _ => Schedule::Seeded(case.seed),
            };
            let mut oracle =
                Oracle::with_schedule(case.block, target.vocab(), vec![1, 2], schedule);
            oracle.stop_ids = tok.stop_ids.clone();
            for (p, r) in case.prompts.iter().zip(&refs) {
                oracle.expect(p, r);
            }
            let policy = if case.clamp {
                AcceptPolicy::Clamp
            } else {
                AcceptPolicy::PerRow
            };
            let mut dec = DflashDecoder::new(target, oracle, case.block, policy).unwrap();
            let requests: Vec<_> = case
                .prompts
                .iter()
                .zip(&case.max_tokens)
                .map(|(p, &n)| request(p.clone(), n, SamplingParams::greedy()))
                .collect();
            let got = run_scheduled(&mut dec, &tok, &requests, case.max_live, &mut |_, _| {});
            let DflashDecoder {
                target, drafter, ..
            } = dec;
            slot.replace(Some((target, tok)));
            let got = got.map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (i, (c, r)) in got.iter().zip(&refs).enumerate() {
                let n = case.max_tokens[i];
                let want: Vec<u32> = r.tokens.iter().take(n).copied().collect();
                prop_assert_eq!(&c.tokens, &want, "request {}", i);
                let reason = if want.len() == n {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                prop_assert_eq!(c.finish_reason, reason, "request {}", i);
            }
            let totals = drafter.expected_totals(case.clamp);
            let seen = drafter.rows_seen();
            prop_assert!(
                seen.iter().all(|r| totals.contains_key(r)),
                "every row's accepts are exactly predictable"
            );
            for (row, c) in got.iter().enumerate() {
                let want = totals.get(&row).copied().unwrap_or(0);
                prop_assert_eq!(c.stats.accepted, want, "request {} accepted", row);
            }
            prop_assert!(drafter.round_rows.iter().all(|r| r.len() <= case.max_live));
            if drafter.rounds_with_different_accepts() > 0 {
                different.set(different.get() + 1);
            }
            Ok(())
        })
        .unwrap();
    assert!(
        different.get() > 0,
        "some case had rows accepting different counts in one round"
    );
}
