//! DFlash speculative decoding over a batch of rows.
//!
//! One round: the drafter proposes `block - 1` tokens after each row's current token in one
//! forward pass; the target verifies every row's whole block in one forward pass; each row
//! keeps the longest prefix the target agrees with plus one token of the target's own (greedy:
//! exact match with the argmax; sampling: speculative rejection sampling, so the output
//! follows the target's distribution); then each row commits its own count — the target's
//! KV cache is cut back to the committed length and the drafter's context grows by the
//! committed tokens' features. Rows never wait for each other's accept counts unless the
//! clamp policy is chosen.
//!
//! Drafts and verdicts are chosen on the device when the backend offers it
//! (`Backend::draft_rows`, `verify_rows`), else on the host by [`propose`] and [`judge`],
//! which define them. A DFlash2 drafter's proposals come from walking its candidate lattice
//! on the host (`selector_walk`), with the selector's sparse distribution as q; those rows
//! are judged on the host too (the device verifier would rebuild q from the drafter's
//! logits). A drafter whose head covers a vocabulary shortlist (`Drafter::vocab_map`) drafts
//! over those tokens only (`shortlist`); its rows draft on the device only for a plain argmax
//! (the ids are mapped back), else on the host. At T > 0 a row draws `2 * (block - 1) + 1` uniforms per round, in this order and
//! whatever happens, DFlash or DFlash2: one per draft, one per accept test, one for the token
//! after the accepted drafts.

use std::time::Instant;

use dflash_models::{Drafter, KvUsage, LogitRows, RowStep, Target};
use dflash_runtime::choice::{DraftRow, Verdict, VerifyRow};
use dflash_runtime::Backend;

use crate::ar::{check_row, choose_next, first_stats, prefill, prefill_steps, HostChoice};
use crate::choose::{copy_rows, split, with_rows, Layout, RowSampling};
use crate::decoder::{Decoder, EngineError, Result, RowId};
use crate::prefill::{prompt_budget, Piece, PrefillQueue, DEFAULT_BATCH_TOKENS};
use crate::sampling::{Dist, SamplingParams};
use crate::selector_walk::walk;
use crate::shortlist::{propose_listed, VocabMap};
use crate::spec_gate::{Round, SpecGate, SpecMode};
use crate::stats::RowStats;

/// How a batch commits accepted tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcceptPolicy {
    /// Every row commits its own accept count.
    PerRow,
    /// Every row commits the smallest accept count of the round (the rectangular fallback).
    Clamp,
}

impl AcceptPolicy {
    /// The policy from `DFLASH_PER_ROW_ACCEPTS` (`0` selects the clamp), else per-row.
    pub fn from_env() -> Self {
        match std::env::var("DFLASH_PER_ROW_ACCEPTS").as_deref() {
            Ok("0") => AcceptPolicy::Clamp,
            _ => AcceptPolicy::PerRow,
        }
    }
}

struct SpecRow {
    drow: usize,
    /// The last committed token: emitted, but not yet in the target's cache.
    cur: u32,
    sampling: RowSampling,
    stats: RowStats,
}

/// The uniforms of one row's round (all zero for a greedy row), drawn in this order.
#[derive(Clone, Debug, PartialEq)]
pub struct Draws {
    /// One per draft.
    pub draft: Vec<f32>,
    /// One per accept test.
    pub accept: Vec<f32>,
    /// For the token after the accepted drafts.
    pub last: f32,
}

impl Draws {
    fn new(s: &mut RowSampling, drafts: usize) -> Self {
        let draft = s.uniforms(drafts);
        let accept = s.uniforms(drafts);
        Self {
            draft,
            accept,
            last: s.uniform(),
        }
    }
}

/// DFlash decoding: a target and a drafter over the same backend.
pub struct DflashDecoder<T: Target, D: Drafter<B = T::B>> {
    pub target: T,
    pub drafter: D,
    block: usize,
    policy: AcceptPolicy,
    gate: SpecGate,
    rows: Vec<Option<SpecRow>>,
    /// Rows whose prompts are still being fed, with their drafter rows.
    queue: PrefillQueue<usize>,
    batch_tokens: usize,
    host: HostChoice<T::B>,
    /// The drafter's logits of the rows drafting on the host.
    draft_host: Vec<f32>,
    /// Gathered drafter logits of the rows verifying on the device.
    draft_tmp: Option<<T::B as Backend>::Tensor>,
    /// The drafter's vocabulary shortlist, when its logits cover one.
    shortlist: Option<VocabMap>,
}

impl<T: Target, D: Drafter<B = T::B>> DflashDecoder<T, D> {
    /// Pairs `target` with `drafter`, drafting blocks of `block` slots (at most the drafter's
    /// trained block size).
    pub fn new(mut target: T, drafter: D, block: usize, policy: AcceptPolicy) -> Result<Self> {
        if block < 2 || block > drafter.block_size() {
            return Err(EngineError::Invalid(format!(
                "block size {block} must be between 2 and the drafter's trained block of {}",
                drafter.block_size()
            )));
        }
        target.set_tap_layers(drafter.tap_layers())?;
        let shortlist = drafter
            .vocab_map()
            .map(|ids| VocabMap::new(ids, target.vocab()))
            .transpose()
            .map_err(EngineError::Invalid)?;
        let policy = if policy == AcceptPolicy::PerRow && !target.per_row_commit() {
            tracing::warn!(
                "the target's cache layout cannot commit a different accept count per row; \
                 DFlash batches fall back to the clamp (every row commits the batch minimum)"
            );
            AcceptPolicy::Clamp
        } else {
            tracing::info!(
                block,
                ?policy,
                reason = match policy {
                    AcceptPolicy::PerRow => "per-row KV caches keep every row's prefix contiguous",
                    AcceptPolicy::Clamp =>
                        "clamp requested (--batch-accept clamp or DFLASH_PER_ROW_ACCEPTS=0)",
                },
                "DFlash batch accept policy"
            );
            policy
        };
        Ok(Self {
            target,
            drafter,
            block,
            policy,
            gate: SpecGate::new(SpecMode::Always),
            rows: Vec::new(),
            queue: PrefillQueue::default(),
            batch_tokens: DEFAULT_BATCH_TOKENS,
            host: HostChoice::new(),
            draft_host: Vec::new(),
            draft_tmp: None,
            shortlist,
        })
    }

    pub fn policy(&self) -> AcceptPolicy {
        self.policy
    }

    /// Whether every round drafts ([`SpecMode::Always`], the default) or greedy batches draft
    /// only while it is measured to pay ([`SpecMode::Auto`]).
    pub fn set_spec_mode(&mut self, mode: SpecMode) {
        tracing::info!(?mode, "DFlash speculation");
        self.gate = SpecGate::new(mode);
    }

    pub fn spec_mode(&self) -> SpecMode {
        self.gate.mode()
    }

    /// Opens a target row and its drafter row.
    fn open_rows(&mut self, capacity: usize) -> Result<(usize, usize)> {
        let trow = self.target.new_row(capacity)?;
        match self.drafter.new_row(capacity) {
            Ok(drow) => Ok((trow, drow)),
            Err(e) => {
                self.target.release_row(trow);
                Err(e.into())
            }
        }
    }

    /// After a forward that ran prefill `pieces` (the logits of the pieces that end a prompt
    /// from logits row `logit0` on, started at `t0`): records the pieces, and the rows whose
    /// prefill ended choose their first tokens and join the live rows. Their drafter context
    /// must already hold every prompt position.
    fn join(
        &mut self,
        pieces: &[Piece],
        logit0: usize,
        t0: Instant,
        out: &mut Vec<(RowId, Vec<u32>)>,
    ) {
        let joined = self.queue.advance(pieces, t0);
        if joined.is_empty() {
            return;
        }
        let mut fresh: Vec<RowSampling> = joined
            .iter()
            .map(|q| RowSampling::new(&q.params, &q.prompt))
            .collect();
        let firsts = choose_next(
            self.target.backend(),
            self.target.logits(),
            logit0,
            &mut fresh.iter_mut().collect::<Vec<_>>(),
            &mut self.host,
        );
        for ((q, sampling), first) in joined.into_iter().zip(fresh).zip(firsts) {
            if self.rows.len() <= q.row {
                self.rows.resize_with(q.row + 1, || None);
            }
            self.rows[q.row] = Some(SpecRow {
                drow: q.extra,
                cur: first,
                sampling,
                stats: RowStats {
                    accepted_at: vec![0; self.block - 1],
                    ..first_stats(q.prompt.len(), q.started.unwrap_or(t0))
                },
            });
            out.push((q.row, vec![first]));
        }
    }

    /// The drafter context entries of prefill `pieces` whose taps start at tap row `tap0`:
    /// appended to `rows` and `tap_rows`.
    fn piece_context(
        &self,
        pieces: &[Piece],
        tap0: usize,
        rows: &mut Vec<(usize, usize)>,
        tap_rows: &mut Vec<u32>,
    ) {
        let mut at = tap0;
        for p in pieces {
            let n = p.range.len();
            rows.push((self.queue.get(p.at).extra, n));
            tap_rows.extend((at..at + n).map(|j| j as u32));
            at += n;
        }
    }

    /// A step with no live rows: feeds queued prompts only.
    fn prefill_step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        let t0 = Instant::now();
        let granule = self.target.prefill_granule();
        let pieces = self
            .queue
            .plan(prompt_budget(self.batch_tokens, 0, granule), granule);
        self.target.forward(&prefill_steps(&self.queue, &pieces))?;
        let (mut rows, mut tap_rows) = (Vec::new(), Vec::new());
        self.piece_context(&pieces, 0, &mut rows, &mut tap_rows);
        self.drafter.extend(&rows, self.target.taps(), &tap_rows)?;
        self.join(&pieces, 0, t0, out);
        Ok(())
    }
}

/// Drafts for one row from its slot-1.. logits (`u.len()` slots of `vocab` values) with
/// uniforms `u`: slot i is drawn from its distribution given `history` and the drafts before
/// it. Returns the tokens and the distributions q they were drawn from. The host definition of
/// `Backend::draft_rows`.
pub fn propose(
    params: &SamplingParams,
    history: &[u32],
    logits: &[f32],
    vocab: usize,
    u: &[f32],
    scratch: &mut Vec<f32>,
) -> (Vec<u32>, Vec<Dist>) {
    let n = u.len();
    let mut drafts = Vec::with_capacity(n);
    let mut qs = Vec::with_capacity(n);
    let mut history = history.to_vec();
    for (i, &u) in u.iter().enumerate() {
        let q = params.distribution(&logits[i * vocab..(i + 1) * vocab], &history, scratch);
        let d = q.pick(u);
        history.push(d);
        drafts.push(d);
        qs.push(q);
    }
    (drafts, qs)
}

/// Verifies one row's drafts against the target's logits for its block (`drafts.len() + 1`
/// rows of `vocab` values): greedy, the longest prefix equal to the target's argmax, then the
/// argmax; at T > 0, draft i is accepted when `u_i * q(d) < p(d)` (p of slot i given `history`
/// and the drafts before it); at the first rejection the token is drawn from [`residual`],
/// after all accepted from the last slot's p, with the round's last uniform. The host
/// definition of `Backend::verify_rows`.
pub fn judge(
    params: &SamplingParams,
    history: &[u32],
    block_logits: &[f32],
    vocab: usize,
    (drafts, qs): (&[u32], &[Dist]),
    draws: &Draws,
    scratch: &mut Vec<f32>,
) -> Verdict {
    let mut history = history.to_vec();
    for (i, &d) in drafts.iter().enumerate() {
        let p = params.distribution(&block_logits[i * vocab..(i + 1) * vocab], &history, scratch);
        let accept = if params.is_greedy() {
            p.items[0].0 == d
        } else {
            draws.accept[i] * qs[i].prob(d) < p.prob(d)
        };
        if !accept {
            let token = if params.is_greedy() {
                p.items[0].0
            } else {
                residual(&p, &qs[i]).pick(draws.last)
            };
            return Verdict { accepted: i, token };
        }
        history.push(d);
    }
    let n = drafts.len();
    let p = params.distribution(&block_logits[n * vocab..(n + 1) * vocab], &history, scratch);
    Verdict {
        accepted: n,
        token: p.pick(draws.last),
    }
}

/// `normalize(max(p - q, 0))` in p's order (the mass an f64 sum), or `p` when that is empty.
/// `q` may be sparse (a DFlash2 selector's top-k candidates): every id it does not list has
/// q = 0.
pub fn residual(p: &Dist, q: &Dist) -> Dist {
    // Both can cover the whole vocabulary at T > 0: look q up by id, not by search.
    let q_by_id = q.probs_by_id();
    let q_prob = |id: u32| q_by_id.get(id as usize).copied().unwrap_or(0.0);
    let mut items: Vec<(u32, f32)> = p
        .items
        .iter()
        .map(|&(id, pp)| (id, (pp - q_prob(id)).max(0.0)))
        .filter(|x| x.1 > 0.0)
        .collect();
    let mass: f64 = items.iter().map(|x| x.1 as f64).sum();
    if items.is_empty() || mass <= 0.0 {
        return p.clone();
    }
    for it in &mut items {
        it.1 = (it.1 as f64 / mass) as f32;
    }
    Dist { items }
}

impl<T: Target, D: Drafter<B = T::B>> Decoder for DflashDecoder<T, D> {
    fn start_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<(RowId, u32)> {
        check_row(prompt, params)?;
        let t0 = Instant::now();
        let (trow, drow) = self.open_rows(capacity)?;
        let drafter = &mut self.drafter;
        let greedy = params.argmax_only();
        let prefill = prefill(&mut self.target, trow, prompt, greedy, &mut |t, len| {
            let rows: Vec<u32> = (0..len as u32).collect();
            Ok(drafter.extend(&[(drow, len)], t.taps(), &rows)?)
        });
        if let Err(e) = prefill {
            self.target.release_row(trow);
            self.drafter.release_row(drow);
            return Err(e);
        }
        let mut sampling = RowSampling::new(params, prompt);
        let first = choose_next(
            self.target.backend(),
            self.target.logits(),
            0,
            &mut [&mut sampling],
            &mut self.host,
        )[0];
        if self.rows.len() <= trow {
            self.rows.resize_with(trow + 1, || None);
        }
        self.rows[trow] = Some(SpecRow {
            drow,
            cur: first,
            sampling,
            stats: RowStats {
                accepted_at: vec![0; self.block - 1],
                ..first_stats(prompt.len(), t0)
            },
        });
        Ok((trow, first))
    }

    fn queue_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<RowId> {
        check_row(prompt, params)?;
        let (trow, drow) = self.open_rows(capacity)?;
        self.queue.push(trow, prompt, params, drow);
        Ok(trow)
    }

    fn set_batch_tokens(&mut self, tokens: usize) {
        self.batch_tokens = tokens.max(1);
    }

    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        let live: Vec<usize> = (0..self.rows.len())
            .filter(|&r| self.rows[r].is_some())
            .collect();
        if live.is_empty() {
            return if self.queue.is_empty() {
                Ok(())
            } else {
                self.prefill_step(out)
            };
        }
        let vocab = self.target.vocab();
        let ctx = self.target.context_length();
        // Near the end of the context the block shrinks so verification stays inside it.
        let room = live
            .iter()
            .map(|&r| ctx.saturating_sub(self.target.row_len(r)))
            .min()
            .unwrap_or(0);
        let all_greedy = live.iter().all(|&r| {
            let row = self.rows[r].as_ref().expect("live");
            row.sampling.params.is_greedy()
        });
        // The gate keys its measurements by the rows the batch holds, prefilling ones included.
        let held = live.len() + self.queue.len();
        let speculate = self.gate.speculate(held, all_greedy);
        if speculate {
            // The context upkeep deferred by plain rounds is theirs, not this round's.
            self.drafter.flush()?;
        }
        let t_round = Instant::now();
        let block = if speculate {
            self.block.min(room)
        } else {
            room.min(1)
        };
        if block < 1 {
            return Err(EngineError::Invalid(
                "a row reached the end of the model's context".into(),
            ));
        }

        // Every uniform of the round, drawn before anything is chosen.
        let n = block - 1;
        let batch = live.len();
        let draws: Vec<Draws> = live
            .iter()
            .map(|&r| Draws::new(&mut self.rows[r].as_mut().expect("live").sampling, n))
            .collect();

        // Draft.
        let t_draft = Instant::now();
        let drafted = Layout::from_start(n);
        let blocks_at = Layout::from_start(block);
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); batch];
        let mut qs: Vec<Vec<Dist>> = vec![Vec::new(); batch];
        // Rows whose drafts were chosen on the device (they verify there too).
        let mut drafted_on_device = vec![false; batch];
        if n > 0 {
            let firsts: Vec<(usize, u32)> = live
                .iter()
                .map(|&r| {
                    let row = self.rows[r].as_ref().expect("live");
                    (row.drow, row.cur)
                })
                .collect();
            let greedy = live.iter().all(|&r| {
                let row = self.rows[r].as_ref().expect("live");
                row.sampling.params.argmax_only()
            });
            self.drafter.set_argmax_only(greedy);
            self.drafter.draft(
                &firsts,
                block,
                self.target.embedding(),
                self.target.lm_head(),
            )?;
            let backend = self.target.backend();
            let dlog = self.drafter.logits();
            let samplings: Vec<&RowSampling> = live
                .iter()
                .map(|&r| &self.rows[r].as_ref().expect("live").sampling)
                .collect();
            if let Some(lattice) = self.drafter.lattice() {
                // DFlash2: each row walks its candidate lattice on the host, drawing from the
                // selector's q with the round's draft uniforms (so it verifies on the host).
                for (i, s) in samplings.iter().enumerate() {
                    (drafts[i], qs[i]) = walk(lattice, i, &s.params, &draws[i].draft);
                }
            } else {
                let (mut device, mut host) = split(samplings.iter().copied());
                if self.shortlist.is_some() {
                    // The device would draw from and verify against q by column: only a plain
                    // argmax (whose column maps to its id) drafts there.
                    let (argmax, other): (Vec<usize>, Vec<usize>) =
                        device.iter().partition(|&&i| {
                            let p = samplings[i].device.expect("device row");
                            p.is_greedy() && !p.penalized()
                        });
                    device = argmax;
                    host.extend(other);
                    host.sort_unstable();
                }
                if !device.is_empty() {
                    let spec: Vec<DraftRow<'_>> = device
                        .iter()
                        .map(|&i| DraftRow {
                            params: samplings[i].device.expect("device row"),
                            history: &samplings[i].history,
                            u: &draws[i].draft,
                        })
                        .collect();
                    match with_rows(backend, dlog, drafted, &device, &mut self.host.tmp, |t| {
                        backend.draft_rows(t, n, &spec)
                    }) {
                        Some(ids) => {
                            for (k, &i) in device.iter().enumerate() {
                                let row = &ids[k * n..(k + 1) * n];
                                drafts[i] = match &self.shortlist {
                                    Some(map) => row.iter().map(|&c| map.target_id(c)).collect(),
                                    None => row.to_vec(),
                                };
                                drafted_on_device[i] = true;
                            }
                        }
                        None => {
                            host.append(&mut device);
                            host.sort_unstable();
                        }
                    }
                }
                if !host.is_empty() {
                    let per_row = n * self.shortlist.as_ref().map_or(vocab, VocabMap::len);
                    copy_rows(
                        backend,
                        dlog,
                        drafted,
                        &host,
                        &mut self.host.tmp,
                        &mut self.draft_host,
                    );
                    for (k, &i) in host.iter().enumerate() {
                        let logits = &self.draft_host[k * per_row..(k + 1) * per_row];
                        let (params, history) = (&samplings[i].params, &samplings[i].history);
                        let (u, scratch) = (&draws[i].draft, &mut self.host.scratch);
                        (drafts[i], qs[i]) = match &self.shortlist {
                            Some(map) => propose_listed(map, params, history, logits, u, scratch),
                            None => propose(params, history, logits, vocab, u, scratch),
                        };
                    }
                }
            }
        }
        let draft_s = t_draft.elapsed().as_secs_f64();

        // Verify every row's block in one target forward.
        let t_verify = Instant::now();
        let blocks: Vec<Vec<u32>> = live
            .iter()
            .zip(&drafts)
            .map(|(&r, drafts)| {
                let mut b = Vec::with_capacity(block);
                b.push(self.rows[r].as_ref().expect("live").cur);
                b.extend_from_slice(drafts);
                b
            })
            .collect();
        let mut steps: Vec<RowStep<'_>> = live
            .iter()
            .zip(&blocks)
            .map(|(&r, b)| RowStep {
                row: r,
                tokens: b,
                logits: LogitRows::All,
                prompt: false,
                argmax_only: self.rows[r]
                    .as_ref()
                    .expect("live")
                    .sampling
                    .params
                    .argmax_only(),
            })
            .collect();
        // Queued prompts' pieces ride in the same forward, in what the blocks leave of the
        // step's budget but never less than its reserve: rows join while many rows draft.
        let granule = self.target.prefill_granule();
        let pieces = self.queue.plan(
            prompt_budget(self.batch_tokens, batch * block, granule),
            granule,
        );
        steps.extend(prefill_steps(&self.queue, &pieces));
        let starts: Vec<usize> = live.iter().map(|&r| self.target.row_len(r)).collect();
        self.target.forward(&steps)?;
        let verify_s = t_verify.elapsed().as_secs_f64();

        // Accept (on the device where the row drafted there, or, in a plain step, where it
        // can choose), then commit.
        let t_commit = Instant::now();
        let backend = self.target.backend();
        let tlog = self.target.logits();
        let samplings: Vec<&RowSampling> = live
            .iter()
            .map(|&r| &self.rows[r].as_ref().expect("live").sampling)
            .collect();
        let (mut device, mut host) = if n > 0 {
            (0..batch).partition(|&i| drafted_on_device[i])
        } else {
            split(samplings.iter().copied())
        };
        let mut verdicts = vec![
            Verdict {
                accepted: 0,
                token: 0,
            };
            batch
        ];
        if !device.is_empty() {
            let spec: Vec<VerifyRow<'_>> = device
                .iter()
                .map(|&i| VerifyRow {
                    params: samplings[i].device.expect("device row"),
                    history: &samplings[i].history,
                    drafts: &drafts[i],
                    accept_u: &draws[i].accept,
                    last_u: draws[i].last,
                })
                .collect();
            let dlog = self.drafter.logits();
            let draft_tmp = &mut self.draft_tmp;
            let found = with_rows(backend, tlog, blocks_at, &device, &mut self.host.tmp, |t| {
                with_rows(backend, dlog, drafted, &device, draft_tmp, |d| {
                    backend.verify_rows(t, d, block, &spec)
                })
            });
            match found {
                Some(v) => {
                    for (&i, v) in device.iter().zip(v) {
                        verdicts[i] = v;
                    }
                }
                None if n > 0 => {
                    return Err(EngineError::Invalid(format!(
                        "the {} backend drafted on the device but declined to verify",
                        backend.name()
                    )))
                }
                None => {
                    host.append(&mut device);
                    host.sort_unstable();
                }
            }
        }
        // Where each host row's block sits in the copied logits.
        let mut host_at = vec![None; batch];
        if !host.is_empty() {
            let per_row = block * vocab;
            copy_rows(
                backend,
                tlog,
                blocks_at,
                &host,
                &mut self.host.tmp,
                &mut self.host.logits,
            );
            for (k, &i) in host.iter().enumerate() {
                let logits = &self.host.logits[k * per_row..(k + 1) * per_row];
                verdicts[i] = judge(
                    &samplings[i].params,
                    &samplings[i].history,
                    logits,
                    vocab,
                    (&drafts[i], &qs[i]),
                    &draws[i],
                    &mut self.host.scratch,
                );
                host_at[i] = Some(k * per_row);
            }
        }
        if self.policy == AcceptPolicy::Clamp {
            let floor = verdicts.iter().map(|v| v.accepted).min().unwrap_or(0);
            for (v, drafts) in verdicts.iter_mut().zip(&drafts) {
                if v.accepted > floor {
                    // The draft at the floor was accepted, so it is a valid next token.
                    v.token = drafts[floor];
                    v.accepted = floor;
                }
            }
        }
        let mut extend_rows = Vec::with_capacity(live.len());
        let mut tap_rows = Vec::new();
        for (i, &r) in live.iter().enumerate() {
            let v = &verdicts[i];
            let row = self.rows[r].as_mut().expect("live");
            let committed = v.accepted + 1;
            self.target.truncate_row(r, starts[i] + committed)?;
            extend_rows.push((row.drow, committed));
            tap_rows.extend((0..committed).map(|j| (i * block + j) as u32));
            let mut emitted = drafts[i][..v.accepted].to_vec();
            emitted.push(v.token);
            if let (true, Some(at)) = (row.sampling.params.keep_logits, host_at[i]) {
                row.sampling.logits.clear();
                row.sampling
                    .logits
                    .extend_from_slice(&self.host.logits[at..at + committed * vocab]);
            }
            row.sampling.history.extend_from_slice(&emitted);
            row.cur = v.token;
            let st = &mut row.stats;
            if block >= 2 {
                st.rounds += 1;
                st.drafted += block - 1;
                st.accepted += v.accepted;
                for a in st.accepted_at.iter_mut().take(v.accepted) {
                    *a += 1;
                }
            } else {
                st.plain_steps += 1;
            }
            st.generated_tokens += emitted.len();
            out.push((r, emitted));
        }
        self.piece_context(&pieces, batch * block, &mut extend_rows, &mut tap_rows);
        // After a plain round the next one is most likely plain too: the drafter may keep the
        // new context's features and write it when it next drafts.
        let taps = self.target.taps();
        if block >= 2 {
            self.drafter.extend(&extend_rows, taps, &tap_rows)?;
        } else {
            self.drafter
                .extend_deferred(&extend_rows, taps, &tap_rows)?;
        }
        let commit_s = t_commit.elapsed().as_secs_f64();
        let committed: usize = verdicts.iter().map(|v| v.accepted + 1).sum();
        let prompt_tokens: usize = pieces.iter().map(|p| p.range.len()).sum();
        self.gate.record(Round {
            rows: held,
            speculated: block >= 2,
            committed,
            tokens: batch * block + prompt_tokens,
            prompt_tokens,
            seconds: t_round.elapsed().as_secs_f64(),
            draft_seconds: draft_s,
        });
        for &r in &live {
            let st = &mut self.rows[r].as_mut().expect("live").stats;
            st.draft_s += draft_s;
            st.verify_s += verify_s;
            st.commit_s += commit_s;
            st.decode_s += draft_s + verify_s + commit_s;
        }
        self.join(&pieces, batch * block, t_round, out);
        Ok(())
    }

    fn finish_row(&mut self, row: RowId) -> RowStats {
        if let Some(q) = self.queue.remove(row) {
            self.target.release_row(row);
            self.drafter.release_row(q.extra);
            return RowStats {
                prompt_tokens: q.prompt.len(),
                accepted_at: vec![0; self.block - 1],
                ..Default::default()
            };
        }
        match self.rows.get_mut(row).and_then(Option::take) {
            Some(r) => {
                self.target.release_row(row);
                self.drafter.release_row(r.drow);
                r.stats
            }
            None => RowStats::default(),
        }
    }

    fn token_logits(&self, row: RowId) -> &[f32] {
        self.rows
            .get(row)
            .and_then(Option::as_ref)
            .map_or(&[], |r| &r.sampling.logits)
    }

    fn kv_usage(&self) -> KvUsage {
        self.target.kv_usage().plus(self.drafter.kv_usage())
    }

    fn live_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.is_some()).count() + self.queue.len()
    }

    fn context_length(&self) -> usize {
        self.target.context_length()
    }

    fn lookahead(&self) -> usize {
        self.block
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residual_treats_a_sparse_q_as_zero_elsewhere() {
        let p = Dist {
            items: vec![(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        };
        // A selector's q over two candidates, listed in candidate (not id) order.
        let q = Dist {
            items: vec![(3, 0.7), (1, 0.3)],
        };
        let r = residual(&p, &q);
        // max(p - q, 0) = [0.1, 0, 0.3, 0] -> normalised over 0.4.
        let want = [(0, 0.25), (2, 0.75)];
        assert_eq!(r.items.len(), 2);
        for (got, w) in r.items.iter().zip(want) {
            assert_eq!(got.0, w.0);
            assert!((got.1 - w.1).abs() < 1e-6);
        }
        // q covering p entirely (p <= q everywhere it is positive): falls back to p.
        let all = Dist {
            items: vec![(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)],
        };
        assert_eq!(residual(&p, &all), p);
    }
}
