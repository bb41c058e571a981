//! Server-sent event streams of chat and completion chunks, ending with `data: [DONE]`.
//!
//! The stream owns the request's event receiver: when the client disconnects, the response
//! body is dropped with it, and the scheduler cancels the request at its next round.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use dflash_models::tokenizer::TextTokenizer;
use futures_util::stream::{self, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{ChunkChoice, CompletionChoice, Delta};
use crate::respond::{
    chat_chunk, chat_logprobs, chat_role_chunk, chat_usage_chunk, completion_chunk,
    completion_logprobs, finish_reason, spec_stats, usage, Meta,
};
use crate::scheduler::JobEvent;
use crate::validate::Prepared;

fn json_event<T: Serialize>(v: &T) -> Event {
    // Our response types always serialize.
    Event::default().data(serde_json::to_string(v).unwrap_or_default())
}

fn sse(
    head: Vec<Event>,
    body: impl futures_util::Stream<Item = Event> + Send + 'static,
) -> Response {
    let done = stream::iter([Event::default().data("[DONE]")]);
    let events = stream::iter(head).chain(body).chain(done);
    Sse::new(events.map(Ok::<_, Infallible>))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
        .into_response()
}

/// A chat completion stream: the role chunk, content chunks, the finish chunk, the usage
/// chunk when asked for.
pub fn chat(
    meta: Meta,
    tok: Arc<TextTokenizer>,
    p: &Prepared,
    rx: UnboundedReceiver<JobEvent>,
) -> Response {
    let want_logprobs = p.request.params.logprobs.is_some();
    let want_ids = p.return_token_ids;
    let include_usage = p.include_usage;
    let head = vec![json_event(&chat_role_chunk(&meta))];
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let mut out = Vec::new();
        match ev {
            JobEvent::Progress {
                text,
                ids,
                logprobs,
            } => {
                if !text.is_empty() || (want_logprobs || want_ids) && !ids.is_empty() {
                    let choice = ChunkChoice {
                        index: 0,
                        delta: Delta {
                            role: None,
                            content: Some(text),
                        },
                        logprobs: want_logprobs.then(|| chat_logprobs(&tok, &logprobs)),
                        finish_reason: None,
                        token_ids: want_ids.then_some(ids),
                    };
                    out.push(json_event(&chat_chunk(&meta, choice)));
                }
            }
            JobEvent::Done(c) => {
                let choice = ChunkChoice {
                    index: 0,
                    delta: Delta::default(),
                    logprobs: None,
                    finish_reason: Some(finish_reason(c.finish_reason)),
                    token_ids: None,
                };
                out.push(json_event(&chat_chunk(&meta, choice)));
                if include_usage {
                    out.push(json_event(&chat_usage_chunk(&meta, &c.stats)));
                }
            }
            JobEvent::Failed(e) => out.push(json_event(&e.body())),
        }
        stream::iter(out)
    });
    sse(head, body)
}

/// A completion stream: text chunks, the finish chunk, the usage chunk when asked for.
pub fn completion(
    meta: Meta,
    tok: Arc<TextTokenizer>,
    p: &Prepared,
    rx: UnboundedReceiver<JobEvent>,
) -> Response {
    let want_logprobs = p.request.params.logprobs.is_some();
    let want_ids = p.return_token_ids;
    let include_usage = p.include_usage;
    let mut offset = 0usize;
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let mut out = Vec::new();
        match ev {
            JobEvent::Progress {
                text,
                ids,
                logprobs,
            } => {
                if !text.is_empty() || (want_logprobs || want_ids) && !ids.is_empty() {
                    let choice = CompletionChoice {
                        index: 0,
                        text,
                        logprobs: want_logprobs
                            .then(|| completion_logprobs(&tok, &logprobs, &mut offset)),
                        finish_reason: None,
                        token_ids: want_ids.then_some(ids),
                    };
                    out.push(json_event(&completion_chunk(&meta, choice)));
                }
            }
            JobEvent::Done(c) => {
                let choice = CompletionChoice {
                    index: 0,
                    text: String::new(),
                    logprobs: None,
                    finish_reason: Some(finish_reason(c.finish_reason)),
                    token_ids: None,
                };
                out.push(json_event(&completion_chunk(&meta, choice)));
                if include_usage {
                    let mut last = completion_chunk(
                        &meta,
                        CompletionChoice {
                            index: 0,
                            text: String::new(),
                            logprobs: None,
                            finish_reason: None,
                            token_ids: None,
                        },
                    );
                    last.choices.clear();
                    last.usage = Some(usage(&c.stats));
                    last.dflash = Some(spec_stats(&c.stats));
                    out.push(json_event(&last));
                }
            }
            JobEvent::Failed(e) => out.push(json_event(&e.body())),
        }
        stream::iter(out)
    });
    sse(Vec::new(), body)
}
