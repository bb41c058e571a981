//! From an HTTP body to an engine [`Request`]: JSON parsing, field ranges, the prompt through
//! the chat template, and the context check. Every refusal is an [`ApiError`] with status 4xx.
//!
//! Sampling ranges end in [`SamplingParams::validate`] and the prompt/limit checks in
//! [`Request::check`], the same checks the CLI runs on its flags and batch lines.

use std::sync::Arc;

use axum::http::StatusCode;
use dflash_engine::sampling::MAX_TOP_LOGPROBS;
use dflash_engine::{Request, SamplingParams};
use dflash_models::chat::{conversation_ids, ChatTemplate, Message};
use dflash_models::tokenizer::TextTokenizer;
use serde::de::DeserializeOwned;

use crate::api::{ChatRequest, CompletionRequest, Content, Prompt, Sampling, Stop};
use crate::error::ApiError;

/// Most stop strings a request may give.
pub const MAX_STOPS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// OpenAI's default `max_tokens` for `/v1/completions`.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// What the server knows about the model it serves.
pub struct ModelInfo {
    /// The id clients name in `model` (and `/v1/models` lists).
    pub id: String,
    pub tokenizer: Arc<TextTokenizer>,
    pub template: Option<ChatTemplate>,
    pub context_length: usize,
}

/// A validated request and how to answer it.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub request: Request,
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
}

/// Parses a JSON body; any failure (bad JSON, wrong types, invalid UTF-8) is a 400.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("the request body is empty"));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

fn check_model(info: &ModelInfo, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &info.id => Err(ApiError {
            param: Some("model"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model `{m}` does not exist; this server serves `{}`",
                    info.id
                ),
            )
        }),
        _ => Ok(()),
    }
}

fn in_range(param: &'static str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => Err(ApiError::bad_param(
            param,
            format!("`{param}` must be between {lo} and {hi}, got {x}"),
        )),
        _ => Ok(()),
    }
}

/// Sampling parameters from the request's fields (OpenAI defaults where absent: temperature
/// 1, a random seed).
fn sampling(s: &Sampling, logprobs: Option<usize>) -> Result<SamplingParams, ApiError> {
    if let Some(n) = s.n {
        if n != 1 {
            return Err(ApiError::bad_param("n", "only n = 1 is supported"));
        }
    }
    in_range("temperature", s.temperature, 0.0, 2.0)?;
    in_range("top_p", s.top_p, 0.0, 1.0)?;
    in_range("min_p", s.min_p, 0.0, 1.0)?;
    in_range("frequency_penalty", s.frequency_penalty, -2.0, 2.0)?;
    in_range("presence_penalty", s.presence_penalty, -2.0, 2.0)?;
    in_range(
        "repetition_penalty",
        s.repetition_penalty,
        f32::MIN_POSITIVE,
        10.0,
    )?;
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("`top_k` must be -1 or 0 (off) or positive, got {k}"),
            ))
        }
    };
    let p = SamplingParams {
        temperature: s.temperature.unwrap_or(1.0),
        top_k,
        top_p: s.top_p.unwrap_or(1.0),
        min_p: s.min_p.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        // Any i64 is a valid seed; negative ones wrap.
        seed: s.seed.map_or_else(rand::random, |x| x as u64),
        logprobs,
        // (set by the batch when log-probabilities are asked for)
        keep_logits: false,
    };
    p.validate().map_err(|e| ApiError::bad_request(e.0))?;
    Ok(p)
}

fn stops(stop: &Option<Stop>) -> Result<Vec<String>, ApiError> {
    let list = match stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::bad_param(
            "stop",
            format!("at most {MAX_STOPS} stop strings are supported"),
        ));
    }
    if list.iter().any(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad_param(
            "stop",
            format!("a stop string may have at most {MAX_STOP_BYTES} bytes"),
        ));
    }
    Ok(list)
}

fn top_logprobs(n: Option<u64>, param: &'static str) -> Result<usize, ApiError> {
    match n {
        None => Ok(0),
        Some(n) if n as usize <= MAX_TOP_LOGPROBS => Ok(n as usize),
        Some(n) => Err(ApiError::bad_param(
            param,
            format!("`{param}` must be at most {MAX_TOP_LOGPROBS}, got {n}"),
        )),
    }
}

/// The token limit: what was asked (at least 1), else `default`; prompt and limit must fit
/// the context.
fn limit(
    info: &ModelInfo,
    prompt: &[u32],
    asked: Option<u64>,
    default: Option<usize>,
) -> Result<usize, ApiError> {
    let ctx = info.context_length;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::bad_request(format!(
            "the prompt has {} tokens but the model's context holds {ctx}",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let max = match asked {
        Some(0) => {
            return Err(ApiError::bad_param(
                "max_tokens",
                "`max_tokens` must be at least 1",
            ))
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => default.map_or(room, |d| d.min(room)),
    };
    if max > room {
        return Err(ApiError::bad_param(
            "max_tokens",
            format!(
                "the model's context holds {ctx} tokens: the prompt has {} and max_tokens asks for {max} more",
                prompt.len()
            ),
        ));
    }
    Ok(max)
}

fn finish_request(
    info: &ModelInfo,
    prompt: Vec<u32>,
    max_tokens: usize,
    params: SamplingParams,
    stop_strings: Vec<String>,
) -> Result<Request, ApiError> {
    let request = Request {
        prompt,
        max_tokens,
        params,
        stop_strings,
    };
    request
        .check(info.context_length)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(request)
}

/// A chat request: messages through the chat template.
pub fn chat(info: &ModelInfo, req: ChatRequest) -> Result<Prepared, ApiError> {
    check_model(info, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` is empty"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("message {i}: role `{other}` is not supported (system, developer, user, assistant)"),
                ))
            }
        };
        let content = match &m.content {
            None if role == "assistant" => String::new(),
            None => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("message {i} has no content"),
                ))
            }
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad_param(
                                "messages",
                                format!("message {i}: content parts of type `{kind}` are not supported (only text)"),
                            ))
                        }
                    }
                }
                text
            }
        };
        messages.push(Message::new(role, &content));
    }
    let top = top_logprobs(req.top_logprobs, "top_logprobs")?;
    let logprobs = req.logprobs.unwrap_or(false).then_some(top);
    if !req.logprobs.unwrap_or(false) && req.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    let params = sampling(&req.sampling, logprobs)?;
    let stop_strings = stops(&req.sampling.stop)?;
    let prompt = conversation_ids(&info.tokenizer, info.template.as_ref(), &messages, false)
        .map_err(|e| ApiError::bad_param("messages", e.to_string()))?;
    let asked = req.max_completion_tokens.or(req.max_tokens);
    let max_tokens = limit(info, &prompt, asked, None)?;
    let stream = req.stream.unwrap_or(false);
    Ok(Prepared {
        request: finish_request(info, prompt, max_tokens, params, stop_strings)?,
        stream,
        include_usage: stream_usage(stream, &req.stream_options)?,
        return_token_ids: req.return_token_ids.unwrap_or(false),
    })
}

fn stream_usage(
    stream: bool,
    options: &Option<crate::api::StreamOptions>,
) -> Result<bool, ApiError> {
    match options {
        Some(_) if !stream => Err(ApiError::bad_param(
            "stream_options",
            "`stream_options` is only allowed with `stream: true`",
        )),
        Some(o) => Ok(o.include_usage.unwrap_or(false)),
        None => Ok(false),
    }
}

/// A completion request: a raw prompt (text or token ids).
pub fn completion(info: &ModelInfo, req: CompletionRequest) -> Result<Prepared, ApiError> {
    check_model(info, &req.model)?;
    if req.echo.unwrap_or(false) {
        return Err(ApiError::bad_param("echo", "`echo` is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_param("suffix", "`suffix` is not supported"));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::bad_param(
            "best_of",
            "only best_of = 1 is supported",
        ));
    }
    let vocab = info.tokenizer.vocab_size();
    let check_ids = |ids: &[u32]| -> Result<Vec<u32>, ApiError> {
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(ApiError::bad_param(
                "prompt",
                format!("token id {id} is outside the vocabulary of {vocab}"),
            )),
            None => Ok(ids.to_vec()),
        }
    };
    let encode = |text: &str| {
        if text.is_empty() {
            return Err(ApiError::bad_param("prompt", "the prompt is empty"));
        }
        info.tokenizer
            .encode(text, true)
            .map_err(|e| ApiError::bad_param("prompt", e.to_string()))
    };
    let one = || ApiError::bad_param("prompt", "only one prompt per request is supported");
    let prompt = match &req.prompt {
        Prompt::Text(t) => encode(t)?,
        Prompt::Ids(ids) => check_ids(ids)?,
        Prompt::Texts(v) if v.len() == 1 => encode(&v[0])?,
        Prompt::IdLists(v) if v.len() == 1 => check_ids(&v[0])?,
        Prompt::Texts(_) | Prompt::IdLists(_) => return Err(one()),
    };
    let top = top_logprobs(req.logprobs, "logprobs")?;
    let params = sampling(&req.sampling, req.logprobs.map(|_| top))?;
    let stop_strings = stops(&req.sampling.stop)?;
    let max_tokens = limit(
        info,
        &prompt,
        req.max_tokens,
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
    )?;
    let stream = req.stream.unwrap_or(false);
    Ok(Prepared {
        request: finish_request(info, prompt, max_tokens, params, stop_strings)?,
        stream,
        include_usage: stream_usage(stream, &req.stream_options)?,
        return_token_ids: req.return_token_ids.unwrap_or(false),
    })
}

/// One line of a `dflash generate --batch` file: `{"prompt": ..., "max_tokens": N}`.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchLine {
    pub prompt: String,
    pub max_tokens: Option<usize>,
}

/// Parses and checks one batch line (the prompt non-empty, `max_tokens` at least 1).
pub fn batch_line(line: &str) -> Result<BatchLine, String> {
    let l: BatchLine = serde_json::from_str(line)
        .map_err(|e| format!("expected {{\"prompt\": ..., \"max_tokens\": N}} ({e})"))?;
    if l.prompt.trim().is_empty() {
        return Err("the prompt is empty".into());
    }
    if l.max_tokens == Some(0) {
        return Err("max_tokens must be at least 1".into());
    }
    Ok(l)
}
