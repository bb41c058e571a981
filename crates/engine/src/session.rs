//! The session driver: runs requests through a decoder, turns tokens into streamed text, and
//! ends each row exactly where plain decoding would (EOS, stop strings, token limit).

use dflash_models::tokenizer::{StreamDecoder, TextTokenizer};
use serde::Serialize;

use crate::decoder::{Decoder, EngineError, Result, RowId};
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
}

/// The result of one request.
#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    pub text: String,
    /// Generated token ids (the end-of-sequence token is not included).
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: RowStats,
}

/// Live state of one request's output.
struct Output {
    index: usize,
    tokens: Vec<u32>,
    text: String,
    streamed: usize,
    decoder: StreamDecoder,
    max_tokens: usize,
    stops: Vec<String>,
    finish: Option<FinishReason>,
}

impl Output {
    /// Longest text that may still turn out to be the start of a stop string.
    fn hold_back(&self) -> usize {
        self.stops
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0)
    }

    /// Takes one generated token; returns newly streamable text. Sets `finish` when done.
    fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
        if tok.stop_ids.contains(&id) {
            self.finish = Some(FinishReason::Stop);
            return self.flush(tok);
        }
        self.tokens.push(id);
        let piece = self.decoder.push(tok, id)?;
        self.text.push_str(&piece);
        if !self.stops.is_empty() && !piece.is_empty() {
            let from = self
                .text
                .len()
                .saturating_sub(piece.len() + self.hold_back());
            let from = (0..=from)
                .rev()
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            if let Some(at) = self
                .stops
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
                .min()
            {
                self.text.truncate(at);
                self.finish = Some(FinishReason::StopString);
                return Ok(self.take_streamable(true));
            }
        }
        if self.tokens.len() >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
            return self.flush(tok);
        }
        Ok(self.take_streamable(false))
    }

    fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let rest = self.decoder.flush(tok)?;
        self.text.push_str(&rest);
        Ok(self.take_streamable(true))
    }

    fn take_streamable(&mut self, all: bool) -> String {
        let mut end = if all {
            self.text.len()
        } else {
            self.text.len().saturating_sub(self.hold_back())
        };
        while end > self.streamed && !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.streamed {
            return String::new();
        }
        let s = self.text[self.streamed..end].to_string();
        self.streamed = end;
        s
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

/// Like [`run_batch`], with at most `max_live` rows decoding at once: when a row finishes,
/// the next waiting request joins the batch between rounds (continuous batching).
pub fn run_scheduled(
    decoder: &mut dyn Decoder,
    tok: &TextTokenizer,
    requests: &[Request],
    max_live: usize,
    on_text: &mut dyn FnMut(usize, &str),
) -> Result<Vec<Completion>> {
    let ctx = decoder.context_length();
    for (i, r) in requests.iter().enumerate() {
        if r.prompt.is_empty() {
            return Err(EngineError::Invalid(format!(
                "request {i}: the prompt is empty"
            )));
        }
        if r.max_tokens == 0 {
            return Err(EngineError::Invalid(format!(
                "request {i}: max tokens must be at least 1"
            )));
        }
        if r.prompt.len() + 1 > ctx {
            return Err(EngineError::Invalid(format!(
                "request {i}: the prompt has {} tokens but the model's context holds {ctx}",
                r.prompt.len()
            )));
        }
    }
    let max_live = max_live.max(1);
    let mut live: Vec<(RowId, Output)> = Vec::new();
    let mut done: Vec<Option<Completion>> = vec![None; requests.len()];
    let mut next = 0usize;
    let result = (|| -> Result<()> {
        let mut produced = Vec::new();
        loop {
            // Admit waiting requests while there is room.
            while next < requests.len() && live.len() < max_live {
                let (i, r) = (next, &requests[next]);
                next += 1;
                // Never run past the context: the token limit is cut to what fits.
                let max_tokens = r.max_tokens.min(ctx - r.prompt.len());
                let capacity = r.prompt.len() + max_tokens + decoder.lookahead() + 1;
                let (row, first) = decoder.start_row(&r.prompt, capacity.min(ctx), &r.params)?;
                let mut out = Output {
                    index: i,
                    tokens: Vec::new(),
                    text: String::new(),
                    streamed: 0,
                    decoder: StreamDecoder::new(),
                    max_tokens,
                    stops: r
                        .stop_strings
                        .iter()
                        .filter(|s| !s.is_empty())
                        .cloned()
                        .collect(),
                    finish: None,
                };
                let piece = out.push(tok, first);
                live.push((row, out));
                let (row, out) = live.last_mut().expect("just pushed");
                let piece = piece?;
                if !piece.is_empty() {
                    on_text(i, &piece);
                }
                if out.finish.is_some() {
                    let row = *row;
                    let (_, out) = live.pop().expect("just pushed");
                    done[i] = Some(finish(decoder, row, out));
                }
            }
            if live.is_empty() {
                return Ok(());
            }
            produced.clear();
            decoder.step(&mut produced)?;
            for (row, toks) in produced.drain(..) {
                let Some(pos) = live.iter().position(|(r, _)| *r == row) else {
                    continue;
                };
                let out = &mut live[pos].1;
                for &t in &toks {
                    let piece = out.push(tok, t)?;
                    if !piece.is_empty() {
                        on_text(out.index, &piece);
                    }
                    if out.finish.is_some() {
                        break;
                    }
                }
                if out.finish.is_some() {
                    let (row, out) = live.swap_remove(pos);
                    let index = out.index;
                    done[index] = Some(finish(decoder, row, out));
                }
            }
        }
    })();
    if let Err(e) = result {
        for (row, _) in live {
            decoder.finish_row(row);
        }
        return Err(e);
    }
    Ok(done
        .into_iter()
        .map(|c| c.expect("every request finished"))
        .collect())
}

fn finish(decoder: &mut dyn Decoder, row: RowId, out: Output) -> Completion {
    let mut stats = decoder.finish_row(row);
    let reason = out.finish.unwrap_or(FinishReason::Length);
    stats.generated_tokens = out.tokens.len() + usize::from(reason == FinishReason::Stop);
    Completion {
        text: out.text,
        tokens: out.tokens,
        finish_reason: reason,
        stats,
    }
}
