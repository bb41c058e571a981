//! Continuous batching: a set of live requests decoded together, which requests join and
//! leave between rounds.
//!
//! [`Batch`] owns the per-request output state (stop handling, held-back streaming, token
//! limits, log-probabilities) and turns each decoder round into [`Event`]s keyed by the
//! caller's request keys. The session driver ([`crate::session::run_scheduled`]) and the
//! server's scheduler both drive decoding through it, so a request ends at exactly the same
//! token whichever surface runs it.

use dflash_models::tokenizer::TextTokenizer;

use crate::decoder::{Decoder, Result, RowId};
use crate::logprobs::{token_logprob, TokenLogprob};
use crate::output::Output;
use crate::session::{Completion, FinishReason, Request};

/// What happened to a request in one call.
#[derive(Debug)]
pub enum Event<K> {
    /// A live request committed the tokens `ids`; `text` is output that became final
    /// (possibly empty while text is held back); `logprobs` are those tokens'
    /// log-probabilities when the request asked for them.
    Progress {
        key: K,
        text: String,
        ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// A request ended; its last text came in a `Progress` event before.
    Done { key: K, completion: Completion },
}

struct Live<K> {
    key: K,
    row: RowId,
    out: Output,
    /// Alternatives per token when the request asked for log-probabilities.
    top_logprobs: Option<usize>,
    logprobs: Vec<TokenLogprob>,
}

impl<K> Live<K> {
    fn new(key: K, row: RowId, max_tokens: usize, req: &Request) -> Self {
        Self {
            key,
            row,
            out: Output::new(max_tokens, &req.stop_strings),
            top_logprobs: req.params.logprobs,
            logprobs: Vec::new(),
        }
    }
}

/// The requests decoding together on one decoder.
pub struct Batch<K> {
    live: Vec<Live<K>>,
}

impl<K> Default for Batch<K> {
    fn default() -> Self {
        Self { live: Vec::new() }
    }
}

impl<K: Copy + PartialEq> Batch<K> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Live requests (those still in their prefill included).
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Keys of the live requests.
    pub fn keys(&self) -> impl Iterator<Item = K> + '_ {
        self.live.iter().map(|l| l.key)
    }

    /// Starts `req` in a new row with a whole prefill before this returns (its first token
    /// comes now). The request may end at once (a one-token limit, an immediate end of
    /// sequence). On error nothing was added.
    pub fn admit(
        &mut self,
        decoder: &mut dyn Decoder,
        tok: &TextTokenizer,
        key: K,
        req: &Request,
        events: &mut Vec<Event<K>>,
    ) -> Result<()> {
        let (max_tokens, capacity, params) = Self::prepare(decoder, req)?;
        let (row, first) = decoder.start_row(&req.prompt, capacity, &params)?;
        self.live.push(Live::new(key, row, max_tokens, req));
        let at = self.live.len() - 1;
        if let Err(e) = self.take(decoder, tok, at, &[first], events) {
            let l = self.live.swap_remove(at);
            decoder.finish_row(l.row);
            return Err(e);
        }
        Ok(())
    }

    /// Starts `req` in a new row whose prompt the next steps feed in pieces, inside the
    /// decoder's token budget, together with the other rows' tokens (chunked prefill); its
    /// first token comes from the step that feeds the last piece. On error nothing was added.
    pub fn enqueue(&mut self, decoder: &mut dyn Decoder, key: K, req: &Request) -> Result<()> {
        let (max_tokens, capacity, params) = Self::prepare(decoder, req)?;
        let row = decoder.queue_row(&req.prompt, capacity, &params)?;
        self.live.push(Live::new(key, row, max_tokens, req));
        Ok(())
    }

    /// Checks `req`; returns its token limit (cut to what fits the context), the positions
    /// its row starts with, and its decoder parameters.
    fn prepare(
        decoder: &dyn Decoder,
        req: &Request,
    ) -> Result<(usize, usize, crate::SamplingParams)> {
        let ctx = decoder.context_length();
        req.check(ctx)?;
        // Never run past the context: the token limit is cut to what fits.
        let max_tokens = req.max_tokens.min(ctx - req.prompt.len());
        // Room for the prompt and the first round; the row's cache grows as it generates, so
        // no row holds its whole token limit's worth of cache up front.
        let capacity = (req.prompt.len() + decoder.lookahead() + 1).min(ctx);
        let mut params = req.params.clone();
        // Log-probabilities are computed here from the logits behind each emitted token.
        params.keep_logits |= params.logprobs.is_some();
        Ok((max_tokens, capacity, params))
    }

    /// One decoding round for every live request.
    pub fn step(
        &mut self,
        decoder: &mut dyn Decoder,
        tok: &TextTokenizer,
        events: &mut Vec<Event<K>>,
    ) -> Result<()> {
        if self.live.is_empty() {
            return Ok(());
        }
        let mut produced = Vec::with_capacity(self.live.len());
        decoder.step(&mut produced)?;
        for (row, toks) in produced {
            if let Some(at) = self.live.iter().position(|l| l.row == row) {
                self.take(decoder, tok, at, &toks, events)?;
            }
        }
        Ok(())
    }

    /// Feeds live request `at` its new tokens; finishes it when it ends.
    fn take(
        &mut self,
        decoder: &mut dyn Decoder,
        tok: &TextTokenizer,
        at: usize,
        toks: &[u32],
        events: &mut Vec<Event<K>>,
    ) -> Result<()> {
        let l = &mut self.live[at];
        let before = l.out.tokens.len();
        let mut text = String::new();
        for &t in toks {
            text.push_str(&l.out.push(tok, t)?);
            if l.out.finish.is_some() {
                break;
            }
        }
        let ids = l.out.tokens[before..].to_vec();
        // Tokens after the end (and the end-of-sequence token) are not part of the output.
        let logprobs = match l.top_logprobs {
            Some(top) => token_logprobs(decoder.token_logits(l.row), toks, ids.len(), top),
            None => Vec::new(),
        };
        l.logprobs.extend_from_slice(&logprobs);
        events.push(Event::Progress {
            key: l.key,
            text,
            ids,
            logprobs,
        });
        if l.out.finish.is_some() {
            let l = self.live.swap_remove(at);
            events.push(Event::Done {
                key: l.key,
                completion: finish(decoder, l),
            });
        }
        Ok(())
    }

    /// Ends request `key` early (its client left, or it ran out of time) and frees its row.
    /// Returns what it had generated, with [`FinishReason::Cancelled`]; `None` if it is not live.
    pub fn cancel(
        &mut self,
        decoder: &mut dyn Decoder,
        tok: &TextTokenizer,
        key: K,
    ) -> Option<Completion> {
        let at = self.live.iter().position(|l| l.key == key)?;
        let mut l = self.live.swap_remove(at);
        // Held-back text becomes final; a decoding error here only loses that tail.
        let _ = l.out.flush(tok);
        l.out.finish = Some(FinishReason::Cancelled);
        Some(finish(decoder, l))
    }

    /// Ends every live request (after a decoding error left the batch in doubt); returns
    /// their keys.
    pub fn abort(&mut self, decoder: &mut dyn Decoder) -> Vec<K> {
        self.live
            .drain(..)
            .map(|l| {
                decoder.finish_row(l.row);
                l.key
            })
            .collect()
    }
}

/// Log-probabilities of the first `n` of `toks` from the logits the decoder kept behind them
/// (one vocabulary-wide row per emitted token).
fn token_logprobs(logits: &[f32], toks: &[u32], n: usize, top: usize) -> Vec<TokenLogprob> {
    if toks.is_empty() || logits.is_empty() || !logits.len().is_multiple_of(toks.len()) {
        return Vec::new();
    }
    let vocab = logits.len() / toks.len();
    toks.iter()
        .take(n)
        .enumerate()
        .map(|(i, &t)| token_logprob(&logits[i * vocab..(i + 1) * vocab], t, top))
        .collect()
}

fn finish<K>(decoder: &mut dyn Decoder, l: Live<K>) -> Completion {
    let mut stats = decoder.finish_row(l.row);
    let reason = l.out.finish.unwrap_or(FinishReason::Length);
    stats.generated_tokens = l.out.tokens.len() + usize::from(reason == FinishReason::Stop);
    Completion {
        text: l.out.text,
        tokens: l.out.tokens,
        finish_reason: reason,
        stats,
        logprobs: l.logprobs,
    }
}
