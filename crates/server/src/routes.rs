//! The HTTP surface: routes, body limits, the request flow from body to scheduler and back,
//! JSON 404s, and a panic in a handler contained as a 500.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tower_http::catch_panic::CatchPanicLayer;

use crate::api::{ChatRequest, CompletionRequest, ModelCard, ModelList};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::respond::{chat_response, completion_response, Meta};
use crate::scheduler::{Job, JobEvent, SchedulerHandle};
use crate::stream;
use crate::validate::{self, ModelInfo, Prepared};

/// Limits applied per HTTP request.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Largest request body, in bytes (more: 413).
    pub max_body_bytes: usize,
    /// Longest a request may take from arrival to its last token (more: 504).
    pub request_timeout: Duration,
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub info: Arc<ModelInfo>,
    pub scheduler: SchedulerHandle,
    pub metrics: Arc<Metrics>,
    pub limits: HttpLimits,
    pub started: u64,
    pub next_id: Arc<AtomicU64>,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The router with every endpoint.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(CatchPanicLayer::custom(|_| {
            tracing::error!("a panic in a request handler was contained");
            ApiError::internal("internal error").into_response()
        }))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "no such endpoint")
}

async fn health(State(st): State<AppState>) -> Response {
    if st.scheduler.is_draining() {
        return ApiError::unavailable("shutting down").into_response();
    }
    let mut body = st.metrics.stats_json();
    body["status"] = json!("ok");
    Json(body).into_response()
}

async fn models(State(st): State<AppState>) -> Json<ModelList> {
    Json(ModelList {
        object: "list",
        data: vec![ModelCard {
            id: st.info.id.clone(),
            object: "model",
            created: st.started,
            owned_by: "dflash",
            context_length: st.info.context_length,
        }],
    })
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}

/// Reads the body up to the limit: 413 beyond it. The rest of a too-large body is read and
/// dropped (up to a bound) before the answer, so the client, still sending, gets the 413
/// instead of a reset connection.
async fn read_body(body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut out = Vec::new();
    let mut seen = 0usize;
    let drain_cap = limit.saturating_mul(8).max(16 << 20);
    while let Some(frame) = body.frame().await {
        let frame = frame
            .map_err(|e| ApiError::bad_request(format!("cannot read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            out.extend_from_slice(&data);
        } else if seen > drain_cap {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body exceeds {limit} bytes"),
        ));
    }
    Ok(out)
}

/// Queues a validated request; returns its event receiver.
fn submit(st: &AppState, p: &Prepared) -> Result<UnboundedReceiver<JobEvent>, ApiError> {
    let (tx, rx) = unbounded_channel();
    let now = Instant::now();
    st.scheduler.submit(Job {
        request: p.request.clone(),
        arrived: now,
        deadline: now + st.limits.request_timeout,
        events: tx,
    })?;
    Ok(rx)
}

/// Waits for the end of a non-streamed request.
async fn finish(
    mut rx: UnboundedReceiver<JobEvent>,
) -> Result<dflash_engine::Completion, ApiError> {
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Progress { .. } => {}
            JobEvent::Done(c) => return Ok(c),
            JobEvent::Failed(e) => return Err(e),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

fn meta(st: &AppState, prefix: &str) -> Meta {
    Meta {
        id: format!(
            "{prefix}-{:016x}",
            st.next_id.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_now(),
        model: st.info.id.clone(),
    }
}

/// Counts the response and hands it out.
fn counted(st: &AppState, endpoint: &str, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    st.metrics.record_request(endpoint, resp.status().as_u16());
    resp
}

async fn chat(State(st): State<AppState>, body: Body) -> Response {
    let result = async {
        let bytes = read_body(body, st.limits.max_body_bytes).await?;
        let req: ChatRequest = validate::parse(&bytes)?;
        let p = validate::chat(&st.info, req)?;
        let rx = submit(&st, &p)?;
        let meta = meta(&st, "chatcmpl");
        if p.stream {
            return Ok(stream::chat(meta, st.info.tokenizer.clone(), &p, rx));
        }
        let c = finish(rx).await?;
        let body = chat_response(
            &meta,
            &st.info.tokenizer,
            &c,
            p.request.params.logprobs.is_some(),
            p.return_token_ids,
        );
        Ok(Json(body).into_response())
    }
    .await;
    counted(&st, "chat_completions", result)
}

async fn completions(State(st): State<AppState>, body: Body) -> Response {
    let result = async {
        let bytes = read_body(body, st.limits.max_body_bytes).await?;
        let req: CompletionRequest = validate::parse(&bytes)?;
        let p = validate::completion(&st.info, req)?;
        let rx = submit(&st, &p)?;
        let meta = meta(&st, "cmpl");
        if p.stream {
            return Ok(stream::completion(meta, st.info.tokenizer.clone(), &p, rx));
        }
        let c = finish(rx).await?;
        let body = completion_response(
            &meta,
            &st.info.tokenizer,
            &c,
            p.request.params.logprobs.is_some(),
            p.return_token_ids,
        );
        Ok(Json(body).into_response())
    }
    .await;
    counted(&st, "completions", result)
}
