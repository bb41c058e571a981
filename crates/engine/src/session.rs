//! The session driver: runs a list of requests through a decoder with continuous batching and
//! chunked prefill ([`crate::batch::Batch`]), turning tokens into streamed text, and ends each
//! row exactly where plain decoding would (EOS, stop strings, token limit). An [`Observer`]
//! sees every event and step (the load benchmark times tokens through it).

use dflash_models::tokenizer::TextTokenizer;
use serde::Serialize;

use crate::batch::{Batch, Event};
use crate::decoder::{Decoder, EngineError, Result};
use crate::logprobs::TokenLogprob;
use crate::sampling::SamplingParams;
use crate::stats::RowStats;

/// One generation request (already tokenized).
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop_strings: Vec<String>,
}

impl Request {
    /// Checks the request against a model whose context holds `ctx` positions (the checks
    /// every surface shares: the CLI's prompts and batch lines, the server's requests).
    pub fn check(&self, ctx: usize) -> Result<()> {
        let bad = |m: String| Err(EngineError::Invalid(m));
        if self.prompt.is_empty() {
            return bad("the prompt is empty".into());
        }
        if self.max_tokens == 0 {
            return bad("max tokens must be at least 1".into());
        }
        if self.prompt.len() + 1 > ctx {
            return bad(format!(
                "the prompt has {} tokens but the model's context holds {ctx}",
                self.prompt.len()
            ));
        }
        self.params
            .validate()
            .map_err(|e| EngineError::Invalid(format!("invalid sampling options: {e}")))
    }
}

/// Why a row ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Stop,
    /// The text reached one of the stop strings.
    StopString,
    /// `max_tokens` were generated.
    Length,
    /// The caller ended the request early (its client left, or it ran out of time).
    Cancelled,
}

/// The result of one request.
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    pub text: String,
    /// Generated token ids (the end-of-sequence token is not included).
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: RowStats,
    /// Log-probabilities of `tokens` (empty unless the request asked for them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
}

/// Watches a scheduled run ([`run_observed`]).
pub trait Observer {
    /// Something happened to request `key` (its index in the request list). A `Done` event's
    /// completion is also returned by the run.
    fn event(&mut self, event: &Event<usize>);
    /// A decoding step (with the prompt pieces it fed) ended; `decoder` can be asked about
    /// its state (live rows, KV memory).
    fn stepped(&mut self, _decoder: &dyn Decoder) {}
}

/// An observer that passes text as it becomes final to `on_text(request_index, piece)`.
struct TextSink<'a>(&'a mut dyn FnMut(usize, &str));

impl Observer for TextSink<'_> {
    fn event(&mut self, event: &Event<usize>) {
        if let Event::Progress { key, text, .. } = event {
            if !text.is_empty() {
                (self.0)(*key, text);
            }
        }
    }
}

/// Runs `requests` together on `decoder`, calling `on_text(request_index, piece)` as text
/// becomes final. Returns one completion per request, in request order.
pub fn run_batch(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    on_text: &mut dyn FnMut(usize, &str),
) -> Result<Vec<Completion>> {
    run_scheduled(decoder, tok, requests, usize::MAX, on_text)
}

/// Like [`run_batch`], with at most `max_live` rows at once: when a row finishes, the next
/// waiting request joins (continuous batching).
pub fn run_scheduled(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    max_live: usize,
    on_text: &mut dyn FnMut(usize, &str),
) -> Result<Vec<Completion>> {
    run_observed(decoder, tok, requests, max_live, &mut TextSink(on_text))
}

/// Runs `requests` with continuous batching and chunked prefill: at most `max_live` rows at
/// once; a waiting request joins as soon as there is room, and its prompt is fed in pieces
/// inside the steps of the live rows (the decoder's token budget,
/// [`Decoder::set_batch_tokens`]). `observer` sees every event and every step. Returns one
/// completion per request, in request order.
pub fn run_observed(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    max_live: usize,
    observer: &mut dyn Observer,
) -> Result<Vec<Completion>> {
    let ctx = decoder.context_length();
    for (i, r) in requests.iter().enumerate() {
        r.check(ctx)
            .map_err(|e| EngineError::Invalid(format!("request {i}: {e}")))?;
    }
    let max_live = max_live.max(1);
    let mut batch = Batch::new();
    let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
    let mut events = Vec::new();
    let mut next = 0usize;
    let result = (|| -> Result<()> {
        loop {
            // Queue waiting requests while there is room.
            while next < requests.len() && batch.len() < max_live {
                batch.enqueue(decoder, next, &requests[next])?;
                next += 1;
            }
            if batch.is_empty() {
                return Ok(());
            }
            batch.step(decoder, tok, &mut events)?;
            observer.stepped(decoder);
            for e in events.drain(..) {
                observer.event(&e);
                if let Event::Done { key, completion } = e {
                    done[key] = Some(completion);
                }
            }
        }
    })();
    if let Err(e) = result {
        batch.abort(decoder);
        return Err(e);
    }
    Ok(done
        .into_iter()
        .map(|c| c.expect("every request finished"))
        .collect())
}
