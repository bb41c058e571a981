//! Plain autoregressive decoding: one target forward per token for every live row.

use std::time::Instant;

use dflash_models::{KvUsage, LogitRows, RowStep, Target};
use dflash_runtime::choice::SampleRow;
use dflash_runtime::Backend;

use crate::choose::{copy_rows, split, with_rows, Layout, RowSampling};
use crate::decoder::{Decoder, EngineError, Result, RowId};
use crate::prefill::{prompt_budget, whole_pieces, Piece, PrefillQueue, DEFAULT_BATCH_TOKENS};
use crate::sampling::SamplingParams;
use crate::stats::RowStats;

/// Feeds `prompt` into row `row` of `target` whole ([`whole_pieces`]); the last position's
/// logits are left in `target.logits()` (exact only in their largest value with
/// `argmax_only`, see `SamplingParams::argmax_only`). `on_piece(target, len)` runs after each
/// piece's forward (the DFlash decoder feeds its drafter there).
pub(crate) fn prefill<T: Target>(
    target: &mut T,
    row: usize,
    prompt: &[u32],
    argmax_only: bool,
    on_piece: &mut dyn FnMut(&T, usize) -> Result<()>,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
    }
    let pieces = whole_pieces(prompt.len(), target.prefill_granule());
    let n = pieces.len();
    for (i, r) in pieces.into_iter().enumerate() {
        let len = r.len();
        target.forward(&[RowStep {
            row,
            tokens: &prompt[r],
            logits: if i + 1 == n {
                LogitRows::Last
            } else {
                LogitRows::None
            },
            prompt: true,
            argmax_only,
        }])?;
        on_piece(target, len)?;
    }
    Ok(())
}

/// Chooses one token for each of `rows` from the rows of `logits` from `first` on (`rows[i]`
/// for tensor row `first + i`), on the device where it can, and records it in the row's
/// history (and, when kept, its logits).
pub(crate) fn choose_next<B: Backend>(
    b: &B,
    logits: &B::Tensor,
    first: usize,
    rows: &mut [&mut RowSampling],
    host: &mut HostChoice<B>,
) -> Vec<u32> {
    let vocab = b.shape(logits).1;
    let batch = rows.len();
    let at = Layout { first, per: 1 };
    let us: Vec<f32> = rows.iter_mut().map(|r| r.uniform()).collect();
    let mut out = vec![0u32; batch];
    let (mut device, mut on_host) = split(rows.iter().map(|r| &**r));
    if !device.is_empty() {
        let spec: Vec<SampleRow<'_>> = device
            .iter()
            .map(|&i| SampleRow {
                params: rows[i].device.expect("device row"),
                history: &rows[i].history,
                u: us[i],
            })
            .collect();
        match with_rows(b, logits, at, &device, &mut host.tmp, |t| {
            b.sample_rows(t, &spec)
        }) {
            Some(ids) => {
                for (&i, id) in device.iter().zip(ids) {
                    out[i] = id;
                }
            }
            None => {
                on_host.append(&mut device);
                on_host.sort_unstable();
            }
        }
    }
    if !on_host.is_empty() {
        copy_rows(b, logits, at, &on_host, &mut host.tmp, &mut host.logits);
        for (k, &i) in on_host.iter().enumerate() {
            let row = &host.logits[k * vocab..(k + 1) * vocab];
            out[i] = rows[i].choose_host(row, us[i], &mut host.scratch);
            if rows[i].params.keep_logits {
                rows[i].logits.clear();
                rows[i].logits.extend_from_slice(row);
            }
        }
    }
    for (r, &t) in rows.iter_mut().zip(&out) {
        r.history.push(t);
    }
    out
}

/// Buffers of the host side of token choice, reused between steps.
pub(crate) struct HostChoice<B: Backend> {
    /// Logits rows copied to the host.
    pub logits: Vec<f32>,
    pub scratch: Vec<f32>,
    /// Gathered rows on the device.
    pub tmp: Option<B::Tensor>,
}

impl<B: Backend> HostChoice<B> {
    pub fn new() -> Self {
        Self {
            logits: Vec::new(),
            scratch: Vec::new(),
            tmp: None,
        }
    }
}

struct ArRow {
    pending: u32,
    sampling: RowSampling,
    stats: RowStats,
}

/// Autoregressive decoding over a batch of rows.
pub struct ArDecoder<T: Target> {
    pub target: T,
    rows: Vec<Option<ArRow>>,
    queue: PrefillQueue<()>,
    batch_tokens: usize,
    host: HostChoice<T::B>,
}

impl<T: Target> ArDecoder<T> {
    pub fn new(target: T) -> Self {
        Self {
            target,
            rows: Vec::new(),
            queue: PrefillQueue::default(),
            batch_tokens: DEFAULT_BATCH_TOKENS,
            host: HostChoice::new(),
        }
    }

    fn insert(&mut self, row: usize, r: ArRow) {
        if self.rows.len() <= row {
            self.rows.resize_with(row + 1, || None);
        }
        self.rows[row] = Some(r);
    }
}

/// A row's statistics when its prefill of `prompt_tokens` ends (begun at `t0`).
pub(crate) fn first_stats(prompt_tokens: usize, t0: Instant) -> RowStats {
    RowStats {
        prompt_tokens,
        generated_tokens: 1,
        prefill_s: t0.elapsed().as_secs_f64(),
        ..Default::default()
    }
}

/// Checks a new row's prompt and parameters.
pub(crate) fn check_row(prompt: &[u32], params: &SamplingParams) -> Result<()> {
    params.validate().map_err(|e| EngineError::Invalid(e.0))?;
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
    }
    Ok(())
}

impl<T: Target> Decoder for ArDecoder<T> {
    fn start_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<(RowId, u32)> {
        check_row(prompt, params)?;
        let t0 = Instant::now();
        let row = self.target.new_row(capacity)?;
        if let Err(e) = prefill(
            &mut self.target,
            row,
            prompt,
            params.argmax_only(),
            &mut |_, _| Ok(()),
        ) {
            self.target.release_row(row);
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
        let stats = first_stats(prompt.len(), t0);
        self.insert(
            row,
            ArRow {
                pending: first,
                sampling,
                stats,
            },
        );
        Ok((row, first))
    }

    fn queue_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<RowId> {
        check_row(prompt, params)?;
        let row = self.target.new_row(capacity)?;
        self.queue.push(row, prompt, params, ());
        Ok(row)
    }

    fn set_batch_tokens(&mut self, tokens: usize) {
        self.batch_tokens = tokens.max(1);
    }

    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        let t0 = Instant::now();
        let live: Vec<(usize, u32)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i, r.pending)))
            .collect();
        let granule = self.target.prefill_granule();
        // Queued prompts always get their reserve of the budget, so the queue always moves.
        let budget = prompt_budget(self.batch_tokens, live.len(), granule);
        let pieces = self.queue.plan(budget, granule);
        if live.is_empty() && pieces.is_empty() {
            return Ok(());
        }
        let tokens: Vec<[u32; 1]> = live.iter().map(|&(_, t)| [t]).collect();
        let mut steps: Vec<RowStep<'_>> = live
            .iter()
            .zip(&tokens)
            .map(|(&(row, _), tok)| RowStep {
                row,
                tokens: tok,
                logits: LogitRows::Last,
                prompt: false,
                argmax_only: self.rows[row]
                    .as_ref()
                    .expect("live")
                    .sampling
                    .params
                    .argmax_only(),
            })
            .collect();
        steps.extend(prefill_steps(&self.queue, &pieces));
        self.target.forward(&steps)?;
        let joined = self.queue.advance(&pieces, t0);
        // Logits rows: the live rows' in order, then those of the rows whose prefill ended.
        let mut fresh: Vec<RowSampling> = joined
            .iter()
            .map(|q| RowSampling::new(&q.params, &q.prompt))
            .collect();
        let mut rows: Vec<&mut ArRow> = self.rows.iter_mut().flatten().collect();
        let mut sampling: Vec<&mut RowSampling> = rows
            .iter_mut()
            .map(|r| &mut r.sampling)
            .chain(fresh.iter_mut())
            .collect();
        let chosen = choose_next(
            self.target.backend(),
            self.target.logits(),
            0,
            &mut sampling,
            &mut self.host,
        );
        let dt = t0.elapsed().as_secs_f64();
        for ((r, &t), &(row, _)) in rows.into_iter().zip(&chosen).zip(&live) {
            r.pending = t;
            r.stats.generated_tokens += 1;
            r.stats.decode_s += dt;
            out.push((row, vec![t]));
        }
        for ((q, sampling), &first) in joined.into_iter().zip(fresh).zip(&chosen[live.len()..]) {
            let stats = first_stats(q.prompt.len(), q.started.unwrap_or(t0));
            self.insert(
                q.row,
                ArRow {
                    pending: first,
                    sampling,
                    stats,
                },
            );
            out.push((q.row, vec![first]));
        }
        Ok(())
    }

    fn finish_row(&mut self, row: RowId) -> RowStats {
        self.target.release_row(row);
        if let Some(q) = self.queue.remove(row) {
            return RowStats {
                prompt_tokens: q.prompt.len(),
                ..Default::default()
            };
        }
        self.rows
            .get_mut(row)
            .and_then(Option::take)
            .map(|r| r.stats)
            .unwrap_or_default()
    }

    fn token_logits(&self, row: RowId) -> &[f32] {
        self.rows
            .get(row)
            .and_then(Option::as_ref)
            .map_or(&[], |r| &r.sampling.logits)
    }

    fn kv_usage(&self) -> KvUsage {
        self.target.kv_usage()
    }

    fn live_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.is_some()).count() + self.queue.len()
    }

    fn context_length(&self) -> usize {
        self.target.context_length()
    }
}

/// The forward steps of prefill `pieces` of `queue`: the last piece of a prompt asks for its
/// last position's logits.
pub(crate) fn prefill_steps<'a, X>(
    queue: &'a PrefillQueue<X>,
    pieces: &[Piece],
) -> Vec<RowStep<'a>> {
    pieces
        .iter()
        .map(|p| {
            let q = queue.get(p.at);
            RowStep {
                row: q.row,
                tokens: &q.prompt[p.range.clone()],
                logits: if p.last {
                    LogitRows::Last
                } else {
                    LogitRows::None
                },
                prompt: true,
                argmax_only: q.params.argmax_only(),
            }
        })
        .collect()
}
