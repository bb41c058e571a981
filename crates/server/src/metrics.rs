//! Prometheus metrics (`GET /metrics`, OpenMetrics text format) with the `dflash_` prefix:
//! requests by endpoint and status, prompt and generated tokens, time to first token and
//! inter-token latency, running and queued rows, batch occupancy, decoding rounds, KV cache
//! memory in use, and DFlash drafts, accepts (by block slot) and τ.

use std::sync::atomic::AtomicU64;

use dflash_engine::RowStats;
use dflash_models::KvUsage;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde_json::{json, Value};

/// `endpoint` and `status` of a finished HTTP request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: u16,
}

/// Why a request was ended before its end.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CancelLabels {
    pub reason: &'static str,
}

/// A draft block slot (1 = the first drafted token).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlotLabels {
    pub slot: u32,
}

/// Every metric the server exports.
pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub cancelled: Family<CancelLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub running: Gauge,
    pub queued: Gauge,
    pub batch_capacity: Gauge,
    pub occupancy: Histogram,
    pub rounds: Counter,
    pub spec_rounds: Counter,
    pub plain_steps: Counter,
    pub drafted: Counter,
    pub accepted: Counter,
    pub accepted_by_slot: Family<SlotLabels, Counter>,
    pub tau: Gauge<f64, AtomicU64>,
    pub kv_bytes: Gauge,
    pub kv_rows: Gauge,
    pub kv_positions: Gauge,
    pub kv_reserved_positions: Gauge,
}

impl Metrics {
    /// Metrics for a server that runs up to `max_batch` rows at once.
    pub fn new(max_batch: usize) -> Self {
        let mut registry = Registry::with_prefix("dflash");
        let m = Self {
            requests: Family::default(),
            cancelled: Family::default(),
            prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            itl: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            running: Gauge::default(),
            queued: Gauge::default(),
            batch_capacity: Gauge::default(),
            occupancy: Histogram::new((0..=max_batch.min(512)).map(|r| r as f64)),
            rounds: Counter::default(),
            spec_rounds: Counter::default(),
            plain_steps: Counter::default(),
            drafted: Counter::default(),
            accepted: Counter::default(),
            accepted_by_slot: Family::default(),
            tau: Gauge::default(),
            kv_bytes: Gauge::default(),
            kv_rows: Gauge::default(),
            kv_positions: Gauge::default(),
            kv_reserved_positions: Gauge::default(),
            registry: Registry::default(),
        };
        m.batch_capacity.set(max_batch as i64);
        let r = &mut registry;
        r.register(
            "requests",
            "HTTP requests by endpoint and status",
            m.requests.clone(),
        );
        r.register(
            "requests_cancelled",
            "Requests ended early, by reason (disconnect, timeout, shutdown, error)",
            m.cancelled.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens prefilled",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            m.generated_tokens.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between generated tokens of a request (a round's tokens share its time)",
            m.itl.clone(),
        );
        r.register(
            "running_rows",
            "Requests decoding in the batch",
            m.running.clone(),
        );
        r.register(
            "queued_requests",
            "Requests waiting for a row",
            m.queued.clone(),
        );
        r.register(
            "batch_capacity_rows",
            "Most rows decoding at once",
            m.batch_capacity.clone(),
        );
        r.register(
            "batch_occupancy_rows",
            "Rows in the batch at each decoding round",
            m.occupancy.clone(),
        );
        r.register(
            "rounds",
            "Decoding rounds (one per batch step)",
            m.rounds.clone(),
        );
        r.register(
            "speculative_rounds",
            "Speculative rounds, counted per row",
            m.spec_rounds.clone(),
        );
        r.register(
            "plain_steps",
            "Rounds a row ran without drafting (speculation judged not to pay)",
            m.plain_steps.clone(),
        );
        r.register("draft_tokens", "Draft tokens proposed", m.drafted.clone());
        r.register(
            "accepted_tokens",
            "Draft tokens accepted",
            m.accepted.clone(),
        );
        r.register(
            "accepted_by_slot",
            "Rounds in which the draft at each block slot was accepted",
            m.accepted_by_slot.clone(),
        );
        r.register(
            "tau",
            "Mean tokens committed per speculative round over finished requests",
            m.tau.clone(),
        );
        r.register(
            "kv_cache_bytes",
            "KV cache memory allocated for open rows (target and drafter)",
            m.kv_bytes.clone(),
        );
        r.register(
            "kv_cache_rows",
            "Rows holding KV cache (target and drafter rows counted apart)",
            m.kv_rows.clone(),
        );
        r.register(
            "kv_cache_positions",
            "Positions cached, summed over rows",
            m.kv_positions.clone(),
        );
        r.register(
            "kv_cache_reserved_positions",
            "Positions the rows' caches can hold before they grow",
            m.kv_reserved_positions.clone(),
        );
        Self { registry, ..m }
    }

    /// Publishes the decoder's KV cache memory in use.
    pub fn record_kv(&self, kv: &KvUsage) {
        self.kv_bytes.set(kv.bytes as i64);
        self.kv_rows.set(kv.rows as i64);
        self.kv_positions.set(kv.positions as i64);
        self.kv_reserved_positions.set(kv.reserved_positions as i64);
    }

    /// The state of the batch as JSON (served by `/health`): rows and KV cache memory.
    pub fn stats_json(&self) -> Value {
        json!({
            "running_rows": self.running.get(),
            "queued_requests": self.queued.get(),
            "kv_cache": {
                "bytes": self.kv_bytes.get(),
                "rows": self.kv_rows.get(),
                "positions": self.kv_positions.get(),
                "reserved_positions": self.kv_reserved_positions.get(),
            },
        })
    }

    /// Adds a finished request's decoding statistics.
    pub fn record_row(&self, s: &RowStats) {
        self.spec_rounds.inc_by(s.rounds as u64);
        self.plain_steps.inc_by(s.plain_steps as u64);
        self.drafted.inc_by(s.drafted as u64);
        self.accepted.inc_by(s.accepted as u64);
        for (i, &a) in s.accepted_at.iter().enumerate() {
            self.accepted_by_slot
                .get_or_create(&SlotLabels { slot: i as u32 + 1 })
                .inc_by(a as u64);
        }
        let rounds = self.spec_rounds.get();
        if rounds > 0 {
            self.tau
                .set((self.accepted.get() + rounds) as f64 / rounds as f64);
        }
    }

    /// Counts an HTTP response.
    pub fn record_request(&self, endpoint: &str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels {
                endpoint: endpoint.to_string(),
                status,
            })
            .inc();
    }

    /// Counts a request ended early.
    pub fn record_cancel(&self, reason: &'static str) {
        self.cancelled.get_or_create(&CancelLabels { reason }).inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
