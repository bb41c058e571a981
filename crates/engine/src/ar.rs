//! Plain autoregressive decoding: one target forward per token for every live row.

use std::time::Instant;

use dflash_models::{LogitRows, RowStep, Target};
use dflash_runtime::Backend;

use crate::decoder::{Decoder, EngineError, Result, RowId};
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::sampling::{Sampler, SamplingParams};
use crate::stats::RowStats;

/// Longest prompt piece prefilled in one forward (bounds activation memory).
pub const PREFILL_CHUNK: usize = 512;

/// Per-row sampling state shared by the decoders.
pub(crate) struct RowSampling {
    pub params: SamplingParams,
    pub sampler: Sampler,
    /// Prompt and generated ids (for the repetition penalty).
    pub history: Vec<u32>,
    /// Log-probabilities of tokens emitted since the caller last took them (only when the
    /// parameters ask for them).
    pub logprobs: Vec<TokenLogprob>,
}

impl RowSampling {
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        Self {
            params: params.clone(),
            sampler: Sampler::new(params.seed),
            history: prompt.to_vec(),
            logprobs: Vec::new(),
        }
    }

    /// Samples the next token from `logits` and records it.
    pub fn next(&mut self, logits: &[f32], scratch: &mut Vec<f32>) -> u32 {
        let dist = self.params.distribution(logits, &self.history, scratch);
        let t = self.sampler.sample(&dist);
        self.history.push(t);
        self.note_logprob(logits, t);
        t
    }

    /// Records the log-probability of emitted token `id` at a position with `logits`, when
    /// the row asked for log-probabilities.
    pub fn note_logprob(&mut self, logits: &[f32], id: u32) {
        if let Some(top) = self.params.logprobs {
            self.logprobs.push(token_logprob(logits, id, top));
        }
    }
}

/// Feeds `prompt` into row `row` of `target` in chunks; returns the last position's logits.
pub(crate) fn prefill<T: Target>(
    target: &mut T,
    row: usize,
    prompt: &[u32],
    logits: &mut Vec<f32>,
) -> Result<()> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
    }
    let chunks: Vec<&[u32]> = prompt.chunks(PREFILL_CHUNK).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        target.forward(&[RowStep {
            row,
            tokens: chunk,
            logits: if last {
                LogitRows::Last
            } else {
                LogitRows::None
            },
        }])?;
    }
    target.backend().copy_to_host(target.logits(), logits);
    Ok(())
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
    logits: Vec<f32>,
    scratch: Vec<f32>,
}

impl<T: Target> ArDecoder<T> {
    pub fn new(target: T) -> Self {
        Self {
            target,
            rows: Vec::new(),
            logits: Vec::new(),
            scratch: Vec::new(),
        }
    }
}

impl<T: Target> Decoder for ArDecoder<T> {
    fn start_row(
        &mut self,
        prompt: &[u32],
        capacity: usize,
        params: &SamplingParams,
    ) -> Result<(RowId, u32)> {
        params.validate().map_err(|e| EngineError::Invalid(e.0))?;
        let t0 = Instant::now();
        let row = self.target.new_row(capacity)?;
        if let Err(e) = prefill(&mut self.target, row, prompt, &mut self.logits) {
            self.target.release_row(row);
            return Err(e);
        }
        let mut sampling = RowSampling::new(params, prompt);
        let first = sampling.next(&self.logits, &mut self.scratch);
        let stats = RowStats {
            prompt_tokens: prompt.len(),
            generated_tokens: 1,
            prefill_s: t0.elapsed().as_secs_f64(),
            ..Default::default()
        };
        if self.rows.len() <= row {
            self.rows.resize_with(row + 1, || None);
        }
        self.rows[row] = Some(ArRow {
            pending: first,
            sampling,
            stats,
        });
        Ok((row, first))
    }

    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        let t0 = Instant::now();
        let live: Vec<(usize, u32)> = self
            .rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i, r.pending)))
            .collect();
        if live.is_empty() {
            return Ok(());
        }
        let tokens: Vec<[u32; 1]> = live.iter().map(|&(_, t)| [t]).collect();
        let steps: Vec<RowStep<'_>> = live
            .iter()
            .zip(&tokens)
            .map(|(&(row, _), tok)| RowStep {
                row,
                tokens: tok,
                logits: LogitRows::Last,
            })
            .collect();
        self.target.forward(&steps)?;
        self.target
            .backend()
            .copy_to_host(self.target.logits(), &mut self.logits);
        let vocab = self.target.vocab();
        let dt = t0.elapsed().as_secs_f64();
        for (i, &(row, _)) in live.iter().enumerate() {
            let r = self.rows[row].as_mut().expect("live row");
            let t = r
                .sampling
                .next(&self.logits[i * vocab..(i + 1) * vocab], &mut self.scratch);
            r.pending = t;
            r.stats.generated_tokens += 1;
            r.stats.decode_s += dt;
            out.push((row, vec![t]));
        }
        Ok(())
    }

    fn take_logprobs(&mut self, row: RowId) -> Vec<TokenLogprob> {
        self.rows
            .get_mut(row)
            .and_then(Option::as_mut)
            .map(|r| std::mem::take(&mut r.sampling.logprobs))
            .unwrap_or_default()
    }

    fn finish_row(&mut self, row: RowId) -> RowStats {
        self.target.release_row(row);
        self.rows
            .get_mut(row)
            .and_then(Option::take)
            .map(|r| r.stats)
            .unwrap_or_default()
    }

    fn live_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.is_some()).count()
    }

    fn context_length(&self) -> usize {
        self.target.context_length()
    }
}
