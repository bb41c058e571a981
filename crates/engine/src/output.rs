//! One request's output as it is generated: token ids to text, stop strings found across
//! token boundaries, text held back while it may still turn into a stop string, and the
//! reason the request ends.

use dflash_models::tokenizer::{StreamDecoder, TextTokenizer};

use crate::decoder::Result;
use crate::session::FinishReason;

/// Live state of one request's output.
pub(crate) struct Output {
    pub tokens: Vec<u32>,
    pub text: String,
    streamed: usize,
    decoder: StreamDecoder,
    max_tokens: usize,
    stops: Vec<String>,
    pub finish: Option<FinishReason>,
}

impl Output {
    /// An empty output that ends after `max_tokens` tokens or at one of `stops`.
    pub fn new(max_tokens: usize, stops: &[String]) -> Self {
        Self {
            tokens: Vec::new(),
            text: String::new(),
            streamed: 0,
            decoder: StreamDecoder::new(),
            max_tokens,
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            finish: None,
        }
    }

    /// Longest text that may still turn out to be the start of a stop string.
    fn hold_back(&self) -> usize {
        self.stops
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0)
    }

    /// Takes one generated token; returns newly streamable text. Sets `finish` when done.
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
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

    /// Ends the output early: every held-back character becomes final.
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
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
