//! dflash-server: the OpenAI-compatible HTTP server of dflash-rs (`dflash serve`).
//!
//! `POST /v1/chat/completions`, `POST /v1/completions` (JSON or server-sent events),
//! `GET /v1/models`, `GET /health`, `GET /metrics`. One scheduler thread owns the decoder and
//! runs continuous batching over DFlash rounds ([`scheduler`]); axum handlers validate
//! requests ([`validate`]), queue them, and stream the events back ([`stream`]). SIGINT or
//! SIGTERM stops accepting, lets running rows finish within a grace period, cancels the rest
//! and returns.
//!
//! The server is generic over the device: the caller loads the model (the CLI's `--model`,
//! `--draft`, `--device` flags) in the closure given to [`serve`], which runs on the
//! scheduler thread.

pub mod api;
pub mod error;
pub mod metrics;
mod respond;
mod routes;
pub mod scheduler;
mod stream;
pub mod validate;

use std::net::SocketAddr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use dflash_engine::Decoder;
use dflash_models::chat::ChatTemplate;
use dflash_models::tokenizer::TextTokenizer;

pub use routes::HttpLimits;
use routes::{router, unix_now, AppState};
use scheduler::{scheduler, SchedulerHandle, SchedulerLimits};
use validate::ModelInfo;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port (the bound address is printed).
    pub port: u16,
    /// The id clients name in `model` (default: the model's name).
    pub model_id: Option<String>,
    pub scheduler: SchedulerLimits,
    pub http: HttpLimits,
    /// How long running rows may take to finish after SIGINT/SIGTERM before they are cancelled.
    pub shutdown_grace: Duration,
}

/// A model ready to serve, as the caller's loader builds it.
pub struct ServedModel {
    pub decoder: Box<dyn Decoder>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub name: String,
}

/// Loads the model on the scheduler thread (which then owns the decoder), starts the
/// scheduler, and returns what the HTTP side needs.
fn start_scheduler<F>(
    config: &ServerConfig,
    metrics: Arc<Metrics>,
    load: F,
) -> Result<(Arc<ModelInfo>, SchedulerHandle, std::thread::JoinHandle<()>)>
where
    F: FnOnce() -> Result<ServedModel> + Send + 'static,
{
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let limits = config.scheduler.clone();
    let model_id = config.model_id.clone();
    let thread = std::thread::Builder::new()
        .name("dflash-scheduler".into())
        .spawn(move || {
            let loaded = match catch_unwind(AssertUnwindSafe(load)) {
                Ok(r) => r,
                Err(_) => Err(anyhow!("loading the model panicked")),
            };
            let m = match loaded {
                Ok(m) => m,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let tokenizer = Arc::new(m.tokenizer);
            let info = Arc::new(ModelInfo {
                id: model_id.unwrap_or(m.name),
                tokenizer: tokenizer.clone(),
                template: m.template,
                context_length: m.decoder.context_length(),
            });
            let (handle, run) = scheduler(m.decoder, tokenizer, metrics, limits);
            if ready_tx.send(Ok((info, handle))).is_ok() {
                run();
            }
        })
        .context("cannot start the scheduler thread")?;
    match ready_rx.recv() {
        Ok(Ok((info, handle))) => Ok((info, handle, thread)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(anyhow!(
            "the scheduler thread ended while loading the model"
        )),
    }
}

/// Waits for SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

use metrics::Metrics;

/// Runs the server until SIGINT/SIGTERM; returns once in-flight requests have finished or
/// been cancelled (within the grace period plus a second).
pub fn serve<F>(config: ServerConfig, load: F) -> Result<()>
where
    F: FnOnce() -> Result<ServedModel> + Send + 'static,
{
    if config.scheduler.max_batch == 0 {
        return Err(anyhow!("the batch must hold at least one row"));
    }
    let metrics = Arc::new(Metrics::new(config.scheduler.max_batch));
    let (info, handle, thread) = start_scheduler(&config, metrics.clone(), load)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let state = AppState {
        info,
        scheduler: handle.clone(),
        metrics,
        limits: config.http.clone(),
        started: unix_now(),
        next_id: Arc::new(AtomicU64::new(0)),
    };
    let result = runtime.block_on(async {
        let addr = format!("{}:{}", config.host, config.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        let local: SocketAddr = listener.local_addr()?;
        eprintln!("dflash serve: listening on http://{local}");
        tracing::info!(%local, "listening");
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let grace = config.shutdown_grace;
        let drain = handle.clone();
        let graceful = async move {
            shutdown_signal().await;
            eprintln!("dflash serve: shutting down (running requests get {grace:?} to finish)");
            drain.drain(grace);
            let _ = stop_tx.send(true);
        };
        let server = axum::serve(listener, router(state)).with_graceful_shutdown(graceful);
        let mut stop_rx = stop_rx;
        let bound = async move {
            // After the signal, connections get the grace period and a second to close.
            let _ = stop_rx.wait_for(|s| *s).await;
            tokio::time::sleep(grace + Duration::from_secs(1)).await;
        };
        tokio::select! {
            r = server => r.context("the server failed"),
            _ = bound => {
                tracing::warn!("connections still open after the grace period; closing them");
                Ok(())
            }
        }
    });
    // Let the scheduler finish its drain (it exits once every row has ended).
    handle.drain(config.shutdown_grace);
    drop(handle);
    runtime.shutdown_timeout(Duration::from_secs(1));
    if thread.join().is_err() {
        tracing::error!("the scheduler thread panicked");
    }
    result
}
