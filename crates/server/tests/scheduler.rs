//! The scheduler with a scripted decoder: the queue bound, per-request timeouts, clients
//! that leave, a panic inside a decoding round, and the shutdown drain. Each is a behaviour
//! the HTTP tests cannot force deterministically.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use dflash_engine::decoder::Result;
use dflash_engine::{Decoder, Request, RowId, RowStats, SamplingParams};
use dflash_models::source::gguf::GgufFile;
use dflash_models::synthetic::{synthetic_gguf, SyntheticSpec};
use dflash_models::tokenizer::TextTokenizer;
use dflash_models::KvUsage;
use dflash_server::metrics::Metrics;
use dflash_server::scheduler::{scheduler, Job, JobEvent, SchedulerHandle, SchedulerLimits};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Emits the byte token `a` forever, one per row and round, after `delay`; panics in the
/// round numbered `panic_at` (counting from 1). A queued row's first `a` comes from the next
/// round; each live row claims 100 cached positions of 1 KiB each.
struct Scripted {
    rows: Vec<bool>,
    delay: Duration,
    panic_at: Option<usize>,
    rounds: usize,
    live: Arc<AtomicUsize>,
}

impl Decoder for Scripted {
    fn start_row(&mut self, _: &[u32], _: usize, _: &SamplingParams) -> Result<(RowId, u32)> {
        let row = self.rows.iter().position(|r| !r).unwrap_or(self.rows.len());
        if row == self.rows.len() {
            self.rows.push(true);
        }
        self.rows[row] = true;
        self.live.fetch_add(1, Ordering::SeqCst);
        Ok((row, u32::from(b'a')))
    }

    fn queue_row(&mut self, prompt: &[u32], cap: usize, params: &SamplingParams) -> Result<RowId> {
        // The next round emits its first token with every live row's.
        self.start_row(prompt, cap, params).map(|(row, _)| row)
    }

    fn set_batch_tokens(&mut self, _: usize) {}

    fn kv_usage(&self) -> KvUsage {
        let rows = self.live_rows();
        KvUsage {
            rows,
            positions: 100 * rows,
            reserved_positions: 100 * rows,
            bytes: 102_400 * rows,
        }
    }

    fn step(&mut self, out: &mut Vec<(RowId, Vec<u32>)>) -> Result<()> {
        self.rounds += 1;
        if self.panic_at == Some(self.rounds) {
            panic!("scripted failure in round {}", self.rounds);
        }
        std::thread::sleep(self.delay);
        for (r, live) in self.rows.iter().enumerate() {
            if *live {
                out.push((r, vec![u32::from(b'a')]));
            }
        }
        Ok(())
    }

    fn finish_row(&mut self, row: RowId) -> RowStats {
        if self.rows.get(row).copied().unwrap_or(false) {
            self.rows[row] = false;
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
        RowStats::default()
    }

    fn live_rows(&self) -> usize {
        self.rows.iter().filter(|r| **r).count()
    }

    fn token_logits(&self, _: RowId) -> &[f32] {
        &[]
    }

    fn context_length(&self) -> usize {
        10_000
    }
}

fn tokenizer() -> Arc<TextTokenizer> {
    let f = GgufFile::parse(
        Path::new("t.gguf"),
        Arc::new(synthetic_gguf(&SyntheticSpec::tiny())),
    )
    .unwrap();
    Arc::new(TextTokenizer::from_gguf(&f).unwrap())
}

struct Setup {
    handle: SchedulerHandle,
    thread: std::thread::JoinHandle<()>,
    live: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

fn start(delay_ms: u64, panic_at: Option<usize>, max_batch: usize, max_queue: usize) -> Setup {
    let live = Arc::new(AtomicUsize::new(0));
    let metrics = Arc::new(Metrics::new(max_batch));
    let (tx, rx) = std::sync::mpsc::channel();
    let (l, m) = (live.clone(), metrics.clone());
    // The decoder lives on the scheduler thread (it need not be Send), as in the server.
    let thread = std::thread::spawn(move || {
        let dec = Scripted {
            rows: Vec::new(),
            delay: Duration::from_millis(delay_ms),
            panic_at,
            rounds: 0,
            live: l,
        };
        let limits = SchedulerLimits {
            max_batch,
            max_queue,
            max_batch_tokens: 512,
        };
        let (handle, run) = scheduler(Box::new(dec), tokenizer(), m, limits);
        tx.send(handle).unwrap();
        run();
    });
    Setup {
        handle: rx.recv().unwrap(),
        thread,
        live,
        metrics,
    }
}

fn job(max_tokens: usize, timeout: Duration) -> (Job, UnboundedReceiver<JobEvent>) {
    let (tx, rx) = unbounded_channel();
    let now = Instant::now();
    (
        Job {
            request: Request {
                prompt: vec![1, 2, 3],
                max_tokens,
                params: SamplingParams::greedy(),
                stop_strings: Vec::new(),
            },
            arrived: now,
            deadline: now + timeout,
            events: tx,
        },
        rx,
    )
}

/// The request's end: its completion's text, or its error.
fn outcome(rx: &mut UnboundedReceiver<JobEvent>) -> std::result::Result<String, StatusCode> {
    loop {
        match rx.blocking_recv() {
            Some(JobEvent::Progress { .. }) => {}
            Some(JobEvent::Done(c)) => return Ok(c.text),
            Some(JobEvent::Failed(e)) => return Err(e.status),
            None => panic!("the request ended without an outcome"),
        }
    }
}

fn wait_until(cond: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out waiting");
        std::thread::sleep(Duration::from_millis(2));
    }
}

const LONG: Duration = Duration::from_secs(60);

fn stop(s: Setup) {
    s.handle.drain(Duration::ZERO);
    drop(s.handle);
    s.thread.join().unwrap();
}

#[test]
fn requests_complete_and_the_queue_bound_answers_429() {
    let s = start(5, None, 1, 1);
    let (j1, r1) = job(1000, LONG);
    s.handle.submit(j1).unwrap();
    wait_until(|| s.live.load(Ordering::SeqCst) == 1);
    // The decoder's KV cache memory is published while the row runs.
    wait_until(|| s.metrics.render().contains("dflash_kv_cache_bytes 102400"));
    let stats = s.metrics.stats_json();
    assert_eq!(stats["kv_cache"]["rows"], 1, "{stats}");
    assert_eq!(stats["kv_cache"]["positions"], 100, "{stats}");
    let (j2, mut r2) = job(3, LONG);
    s.handle.submit(j2).unwrap();
    let (j3, _r3) = job(3, LONG);
    let err = s.handle.submit(j3).unwrap_err();
    assert_eq!(err.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(err.retry_after, Some(1));
    drop(r1);
    // The first client left: its row is freed and the queued request runs.
    assert_eq!(outcome(&mut r2), Ok("aaa".into()));
    wait_until(|| s.live.load(Ordering::SeqCst) == 0);
    assert!(s
        .metrics
        .render()
        .contains("dflash_requests_cancelled_total{reason=\"disconnect\"} 1"));
    wait_until(|| s.metrics.render().contains("dflash_kv_cache_bytes 0"));
    stop(s);
}

#[test]
fn a_request_past_its_deadline_gets_504_and_frees_its_row() {
    let s = start(10, None, 4, 4);
    let (j, mut r) = job(100_000, Duration::from_millis(150));
    let t0 = Instant::now();
    s.handle.submit(j).unwrap();
    assert_eq!(outcome(&mut r), Err(StatusCode::GATEWAY_TIMEOUT));
    assert!(t0.elapsed() < Duration::from_secs(5));
    wait_until(|| s.live.load(Ordering::SeqCst) == 0);
    let (j, mut r) = job(2, LONG);
    s.handle.submit(j).unwrap();
    assert_eq!(outcome(&mut r), Ok("aa".into()));
    stop(s);
}

#[test]
fn a_panic_in_a_round_fails_that_batch_with_500_and_the_scheduler_goes_on() {
    let s = start(1, Some(3), 4, 4);
    let (ja, mut ra) = job(50, LONG);
    let (jb, mut rb) = job(50, LONG);
    s.handle.submit(ja).unwrap();
    s.handle.submit(jb).unwrap();
    assert_eq!(outcome(&mut ra), Err(StatusCode::INTERNAL_SERVER_ERROR));
    assert_eq!(outcome(&mut rb), Err(StatusCode::INTERNAL_SERVER_ERROR));
    wait_until(|| s.live.load(Ordering::SeqCst) == 0);
    let (j, mut r) = job(4, LONG);
    s.handle.submit(j).unwrap();
    assert_eq!(outcome(&mut r), Ok("aaaa".into()));
    stop(s);
}

#[test]
fn the_drain_refuses_new_requests_and_cancels_rows_after_the_grace_period() {
    let s = start(5, None, 1, 4);
    let (j1, mut r1) = job(100_000, LONG);
    let (j2, mut r2) = job(3, LONG);
    s.handle.submit(j1).unwrap();
    wait_until(|| s.live.load(Ordering::SeqCst) == 1);
    s.handle.submit(j2).unwrap();
    s.handle.drain(Duration::from_millis(100));
    let (j3, _r3) = job(3, LONG);
    assert_eq!(
        s.handle.submit(j3).unwrap_err().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // The queued request is refused, the running one cancelled after the grace period.
    assert_eq!(outcome(&mut r2), Err(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(outcome(&mut r1), Err(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(s.live.load(Ordering::SeqCst), 0);
    drop(s.handle);
    s.thread.join().unwrap();
}
