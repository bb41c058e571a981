//! The scheduler: one thread that owns the decoder and runs decoding rounds over a
//! [`Batch`], admitting queued requests between rounds (continuous batching) and ending
//! those whose client left, whose time ran out, or that the shutdown cancels. A new request's
//! prompt is fed in pieces inside the following rounds, within the per-step token budget,
//! so the live rows keep producing tokens while it joins (chunked prefill).
//!
//! HTTP handlers talk to it through a [`SchedulerHandle`]: a request is submitted as a
//! [`Job`] carrying the sending half of its event channel; dropping the receiving half (the
//! client disconnected) cancels the request and frees its row at the next round.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use dflash_engine::logprobs::TokenLogprob;
use dflash_engine::{Batch, Completion, Decoder, EngineError, Event, Request};
use dflash_models::tokenizer::TextTokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::error::ApiError;
use crate::metrics::Metrics;

/// What a request's handler hears from the scheduler.
#[derive(Debug)]
pub enum JobEvent {
    /// More output: the new tokens `ids`, `text` that became final.
    Progress {
        text: String,
        ids: Vec<u32>,
        logprobs: Vec<TokenLogprob>,
    },
    /// The request ended normally.
    Done(Completion),
    /// The request failed or was ended early (timeout, shutdown, decoding error).
    Failed(ApiError),
}

/// A request waiting for, or holding, a row.
pub struct Job {
    pub request: Request,
    pub arrived: Instant,
    pub deadline: Instant,
    pub events: UnboundedSender<JobEvent>,
}

enum Command {
    Submit(Job),
    /// Stop admitting; cancel live rows still running at `deadline`; then exit.
    Drain {
        deadline: Instant,
    },
}

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerLimits {
    /// Most rows decoding at once.
    pub max_batch: usize,
    /// Most requests waiting for a row; more get 429.
    pub max_queue: usize,
    /// Token budget of one decoding step: the live rows' tokens, then pieces of new rows'
    /// prompts (chunked prefill) in the rest, at least a quarter of it (the decoder's
    /// reserve for joining rows, `Decoder::set_batch_tokens`).
    pub max_batch_tokens: usize,
}

/// The HTTP side's way to the scheduler thread.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: Sender<Command>,
    queued: Arc<AtomicUsize>,
    draining: Arc<AtomicBool>,
    max_queue: usize,
}

impl SchedulerHandle {
    /// Queues `job`: 429 with `Retry-After` when the queue is full, 503 while shutting down.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let reserved = self
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_queue).then_some(n + 1)
            });
        if reserved.is_err() {
            return Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "the server is busy: {} requests are already waiting",
                        self.max_queue
                    ),
                )
            });
        }
        self.tx.send(Command::Submit(job)).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            ApiError::unavailable("the scheduler has stopped")
        })
    }

    /// Starts the shutdown: no new requests; rows still running after `grace` are cancelled.
    pub fn drain(&self, grace: Duration) {
        self.draining.store(true, Ordering::SeqCst);
        let _ = self.tx.send(Command::Drain {
            deadline: Instant::now() + grace,
        });
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// A live request's bookkeeping.
struct Running {
    id: u64,
    job: Job,
    /// When it last produced a token (None before the first).
    last_token: Option<Instant>,
}

/// The scheduler's state, owned by its thread.
struct Scheduler {
    decoder: Box<dyn Decoder>,
    tokenizer: Arc<TextTokenizer>,
    metrics: Arc<Metrics>,
    limits: SchedulerLimits,
    queued: Arc<AtomicUsize>,
    queue: VecDeque<Job>,
    running: Vec<Running>,
    batch: Batch<u64>,
    next_id: u64,
    drain_deadline: Option<Instant>,
}

/// Creates the handle and the loop to run on the scheduler thread.
pub fn scheduler(
    decoder: Box<dyn Decoder>,
    tokenizer: Arc<TextTokenizer>,
    metrics: Arc<Metrics>,
    limits: SchedulerLimits,
) -> (SchedulerHandle, impl FnOnce()) {
    let mut decoder = decoder;
    decoder.set_batch_tokens(limits.max_batch_tokens);
    let (tx, rx) = std::sync::mpsc::channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let handle = SchedulerHandle {
        tx,
        queued: queued.clone(),
        draining: Arc::new(AtomicBool::new(false)),
        max_queue: limits.max_queue,
    };
    let mut s = Scheduler {
        decoder,
        tokenizer,
        metrics,
        limits,
        queued,
        queue: VecDeque::new(),
        running: Vec::new(),
        batch: Batch::new(),
        next_id: 0,
        drain_deadline: None,
    };
    (handle, move || s.run(rx))
}

impl Scheduler {
    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            if !self.receive(&rx) {
                // Every handle is gone: nothing more can arrive.
                self.drain_deadline.get_or_insert_with(Instant::now);
            }
            self.drop_abandoned();
            self.expire();
            if let Some(deadline) = self.drain_deadline {
                self.reject_queue();
                if Instant::now() >= deadline {
                    self.cancel_all("shutdown", || {
                        ApiError::unavailable("the server shut down before the request finished")
                    });
                }
                if self.running.is_empty() {
                    return;
                }
            }
            self.admit();
            self.publish_gauges();
            if !self.running.is_empty() {
                self.round();
                self.publish_gauges();
            }
        }
    }

    /// Takes commands: waits a little when there is nothing to decode, else only takes what
    /// already arrived. Returns false when every sender is gone.
    fn receive(&mut self, rx: &Receiver<Command>) -> bool {
        let mut wait = self.running.is_empty() && self.queue.is_empty();
        loop {
            let cmd = if wait {
                match rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => return true,
                    Err(RecvTimeoutError::Disconnected) => return false,
                }
            } else {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(std::sync::mpsc::TryRecvError::Empty) => return true,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return false,
                }
            };
            wait = false;
            match cmd {
                Command::Submit(job) => self.queue.push_back(job),
                Command::Drain { deadline } => self.drain_deadline = Some(deadline),
            }
        }
    }

    fn dequeued(&self, n: usize) {
        self.queued.fetch_sub(n, Ordering::SeqCst);
    }

    /// Cancels requests whose client has gone (queued or running).
    fn drop_abandoned(&mut self) {
        let before = self.queue.len();
        self.queue.retain(|j| !j.events.is_closed());
        let gone = before - self.queue.len();
        self.dequeued(gone);
        for _ in 0..gone {
            self.metrics.record_cancel("disconnect");
        }
        let ids: Vec<u64> = self
            .running
            .iter()
            .filter(|r| r.job.events.is_closed())
            .map(|r| r.id)
            .collect();
        for id in ids {
            self.cancel(id, "disconnect", None);
        }
    }

    /// Ends requests past their deadline with 504.
    fn expire(&mut self) {
        let now = Instant::now();
        let timeout = || ApiError::new(StatusCode::GATEWAY_TIMEOUT, "the request timed out");
        let mut kept = VecDeque::with_capacity(self.queue.len());
        for job in self.queue.drain(..) {
            if job.deadline <= now {
                let _ = job.events.send(JobEvent::Failed(timeout()));
                self.queued.fetch_sub(1, Ordering::SeqCst);
                self.metrics.record_cancel("timeout");
            } else {
                kept.push_back(job);
            }
        }
        self.queue = kept;
        let ids: Vec<u64> = self
            .running
            .iter()
            .filter(|r| r.job.deadline <= now)
            .map(|r| r.id)
            .collect();
        for id in ids {
            self.cancel(id, "timeout", Some(timeout()));
        }
    }

    fn reject_queue(&mut self) {
        let n = self.queue.len();
        for job in self.queue.drain(..) {
            let _ = job.events.send(JobEvent::Failed(ApiError::unavailable(
                "the server is shutting down",
            )));
        }
        self.dequeued(n);
        for _ in 0..n {
            self.metrics.record_cancel("shutdown");
        }
    }

    /// Ends running request `id` early and frees its row; tells its client `error` if any.
    fn cancel(&mut self, id: u64, reason: &'static str, error: Option<ApiError>) {
        self.batch
            .cancel(self.decoder.as_mut(), &self.tokenizer, id);
        if let Some(at) = self.running.iter().position(|r| r.id == id) {
            let r = self.running.swap_remove(at);
            if let Some(e) = error {
                let _ = r.job.events.send(JobEvent::Failed(e));
            }
        }
        self.metrics.record_cancel(reason);
    }

    fn cancel_all(&mut self, reason: &'static str, error: impl Fn() -> ApiError) {
        let ids: Vec<u64> = self.running.iter().map(|r| r.id).collect();
        for id in ids {
            self.cancel(id, reason, Some(error()));
        }
    }

    /// Moves queued requests into the batch while there is room.
    fn admit(&mut self) {
        if self.drain_deadline.is_some() {
            return;
        }
        while self.batch.len() < self.limits.max_batch {
            let Some(job) = self.queue.pop_front() else {
                break;
            };
            self.dequeued(1);
            let id = self.next_id;
            self.next_id += 1;
            let prompt_tokens = job.request.prompt.len();
            let admitted = catch_unwind(AssertUnwindSafe(|| {
                self.batch.enqueue(self.decoder.as_mut(), id, &job.request)
            }));
            match admitted {
                Ok(Ok(())) => {
                    self.metrics.prompt_tokens.inc_by(prompt_tokens as u64);
                    self.running.push(Running {
                        id,
                        job,
                        last_token: None,
                    });
                }
                Ok(Err(e)) => {
                    let err = match e {
                        EngineError::Invalid(m) => ApiError::bad_request(m),
                        other => ApiError::internal(other.to_string()),
                    };
                    let _ = job.events.send(JobEvent::Failed(err));
                    self.metrics.record_cancel("error");
                }
                Err(_) => {
                    tracing::error!("a panic while starting a request was contained");
                    let _ = job.events.send(JobEvent::Failed(ApiError::internal(
                        "internal error while starting the request",
                    )));
                    self.metrics.record_cancel("error");
                    // The decoder may hold a half-made row; start over with an empty batch.
                    self.fail_batch("internal error while decoding");
                }
            }
        }
    }

    /// One decoding round for the batch.
    fn round(&mut self) {
        let mut events = Vec::new();
        self.metrics.rounds.inc();
        self.metrics.occupancy.observe(self.batch.len() as f64);
        let stepped = catch_unwind(AssertUnwindSafe(|| {
            self.batch
                .step(self.decoder.as_mut(), &self.tokenizer, &mut events)
        }));
        match stepped {
            Ok(Ok(())) => self.dispatch(&mut events),
            Ok(Err(e)) => {
                tracing::error!("decoding failed: {e}");
                self.dispatch(&mut events);
                self.fail_batch(&format!("decoding failed: {e}"));
            }
            Err(_) => {
                tracing::error!("a panic while decoding was contained");
                self.fail_batch("internal error while decoding");
            }
        }
    }

    /// Ends every running request with 500 after a failed round.
    fn fail_batch(&mut self, message: &str) {
        self.batch.abort(self.decoder.as_mut());
        for r in self.running.drain(..) {
            let _ = r
                .job
                .events
                .send(JobEvent::Failed(ApiError::internal(message)));
            self.metrics.record_cancel("error");
        }
    }

    /// Sends the round's events to their requests and records latencies. The gauges are
    /// published before anything is sent, so a client that has seen its tokens also sees
    /// the batch that made them in `/metrics`.
    fn dispatch(&mut self, events: &mut Vec<Event<u64>>) {
        let now = Instant::now();
        let mut outbox = Vec::with_capacity(events.len());
        for e in events.drain(..) {
            match e {
                Event::Progress {
                    key,
                    text,
                    ids,
                    logprobs,
                } => {
                    let tokens = ids.len();
                    let Some(r) = self.running.iter_mut().find(|r| r.id == key) else {
                        continue;
                    };
                    if tokens > 0 {
                        match r.last_token {
                            None => {
                                let ttft = now.duration_since(r.job.arrived).as_secs_f64();
                                self.metrics.ttft.observe(ttft);
                            }
                            Some(last) => {
                                let gap = now.duration_since(last).as_secs_f64() / tokens as f64;
                                for _ in 0..tokens {
                                    self.metrics.itl.observe(gap);
                                }
                            }
                        }
                        r.last_token = Some(now);
                        self.metrics.generated_tokens.inc_by(tokens as u64);
                    }
                    outbox.push((
                        r.job.events.clone(),
                        JobEvent::Progress {
                            text,
                            ids,
                            logprobs,
                        },
                    ));
                }
                Event::Done { key, completion } => {
                    let Some(at) = self.running.iter().position(|r| r.id == key) else {
                        continue;
                    };
                    let r = self.running.swap_remove(at);
                    self.metrics.record_row(&completion.stats);
                    outbox.push((r.job.events, JobEvent::Done(completion)));
                }
            }
        }
        self.publish_gauges();
        for (to, event) in outbox {
            let _ = to.send(event);
        }
    }

    fn publish_gauges(&self) {
        self.metrics.record_kv(&self.decoder.kv_usage());
        self.metrics.running.set(self.running.len() as i64);
        self.metrics
            .queued
            .set(self.queued.load(Ordering::SeqCst) as i64);
    }
}
