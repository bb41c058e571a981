//! Engine results as OpenAI response bodies: whole responses, streamed chunks, usage,
//! log-probabilities and the `dflash` speculation statistics.

use dflash_engine::logprobs::TokenLogprob;
use dflash_engine::{Completion, FinishReason, RowStats};
use dflash_models::tokenizer::TextTokenizer;

use crate::api::{
    AssistantMessage, ChatChoice, ChatChunk, ChatLogprobs, ChatResponse, ChatTokenLogprob,
    ChunkChoice, CompletionChoice, CompletionLogprobs, CompletionResponse, Delta, SpecStats,
    TopLogprob, Usage,
};

/// Identity of one response: its id, creation time and the model name.
#[derive(Clone, Debug)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// OpenAI's `finish_reason`: `stop` for an end-of-sequence token or a stop string.
pub fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop | FinishReason::StopString => "stop",
        FinishReason::Length | FinishReason::Cancelled => "length",
    }
}

/// Token counts; the end-of-sequence token counts as generated (as other servers count it).
pub fn usage(s: &RowStats) -> Usage {
    Usage {
        prompt_tokens: s.prompt_tokens,
        completion_tokens: s.generated_tokens,
        total_tokens: s.prompt_tokens + s.generated_tokens,
    }
}

pub fn spec_stats(s: &RowStats) -> SpecStats {
    SpecStats {
        rounds: s.rounds,
        plain_steps: s.plain_steps,
        drafted: s.drafted,
        accepted: s.accepted,
        tau: s.tau(),
        acceptance_by_position: s.acceptance_by_position(),
    }
}

fn token_text(tok: &TextTokenizer, id: u32) -> String {
    tok.decode(&[id]).unwrap_or_default()
}

/// Chat `logprobs.content` entries for `lps`.
pub fn chat_logprobs(tok: &TextTokenizer, lps: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| {
                let token = token_text(tok, lp.id);
                ChatTokenLogprob {
                    bytes: token.as_bytes().to_vec(),
                    token,
                    logprob: lp.logprob,
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(id, logprob)| {
                            let token = token_text(tok, id);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob,
                            }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Legacy completion `logprobs` for `lps`; `offset` is the text length before them (advanced).
pub fn completion_logprobs(
    tok: &TextTokenizer,
    lps: &[TokenLogprob],
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        let token = token_text(tok, lp.id);
        out.text_offset.push(*offset);
        *offset += token.len();
        out.tokens.push(token);
        out.token_logprobs.push(lp.logprob);
        out.top_logprobs.push(
            lp.top
                .iter()
                .map(|&(id, l)| (token_text(tok, id), serde_json::Value::from(l)))
                .collect(),
        );
    }
    out
}

/// A whole chat response.
pub fn chat_response(
    meta: &Meta,
    tok: &TextTokenizer,
    c: &Completion,
    logprobs: bool,
    token_ids: bool,
) -> ChatResponse {
    ChatResponse {
        id: meta.id.clone(),
        object: "chat.completion",
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![ChatChoice {
            index: 0,
            message: AssistantMessage {
                role: "assistant",
                content: c.text.clone(),
            },
            logprobs: logprobs.then(|| chat_logprobs(tok, &c.logprobs)),
            finish_reason: finish_reason(c.finish_reason),
            token_ids: token_ids.then(|| c.tokens.clone()),
        }],
        usage: usage(&c.stats),
        dflash: spec_stats(&c.stats),
    }
}

/// A whole completion response.
pub fn completion_response(
    meta: &Meta,
    tok: &TextTokenizer,
    c: &Completion,
    logprobs: bool,
    token_ids: bool,
) -> CompletionResponse {
    CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion",
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![CompletionChoice {
            index: 0,
            text: c.text.clone(),
            logprobs: logprobs.then(|| completion_logprobs(tok, &c.logprobs, &mut 0)),
            finish_reason: Some(finish_reason(c.finish_reason)),
            token_ids: token_ids.then(|| c.tokens.clone()),
        }],
        usage: Some(usage(&c.stats)),
        dflash: Some(spec_stats(&c.stats)),
    }
}

/// A streamed chat chunk with one choice.
pub fn chat_chunk(meta: &Meta, choice: ChunkChoice) -> ChatChunk {
    ChatChunk {
        id: meta.id.clone(),
        object: "chat.completion.chunk",
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![choice],
        usage: None,
        dflash: None,
    }
}

/// The first chunk of a chat stream: the assistant role.
pub fn chat_role_chunk(meta: &Meta) -> ChatChunk {
    chat_chunk(
        meta,
        ChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: Some(String::new()),
            },
            logprobs: None,
            finish_reason: None,
            token_ids: None,
        },
    )
}

/// The chunk that carries usage only (`stream_options.include_usage`), with no choices.
pub fn chat_usage_chunk(meta: &Meta, s: &RowStats) -> ChatChunk {
    ChatChunk {
        choices: Vec::new(),
        usage: Some(usage(s)),
        dflash: Some(spec_stats(s)),
        ..chat_chunk(
            meta,
            ChunkChoice {
                index: 0,
                delta: Delta::default(),
                logprobs: None,
                finish_reason: None,
                token_ids: None,
            },
        )
    }
}

/// A streamed completion chunk.
pub fn completion_chunk(meta: &Meta, choice: CompletionChoice) -> CompletionResponse {
    CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion",
        created: meta.created,
        model: meta.model.clone(),
        choices: vec![choice],
        usage: None,
        dflash: None,
    }
}
