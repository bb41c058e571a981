//! The CPU attention op: a step's queries cut into tasks for the worker pool.
//!
//! A task takes one query head of one token; or, once some token sees [`GROUP_MIN_KEYS`] keys,
//! a piece of a row's consecutive tokens (a whole verify block when the step is split by key
//! chunk) with all query heads of one KV head, whose queries then read each tile of keys and
//! values once instead of once each. When those tasks are too
//! few to keep the threads busy (a decode step's few KV heads at a long context), each is split
//! further by key chunk ([`attention::KEY_CHUNK`]): the chunks' partial softmaxes go to a
//! buffer, and a second pass merges each query's chunks in order. Every query gets the same
//! bits whichever way it was cut (`attention::attend_many`, `attention::Running`).

use std::cell::RefCell;

use super::kv::CpuKv;
use super::matmul::Isa;
use super::ops::attention::{self, ChunkStats, Part, Query, Running, Scratch, KEY_CHUNK};
use super::pool::{CpuPool, SyncPtr};
use super::tensor::CpuTensor;
use crate::backend::{AttnShape, TokenMeta};

/// Visible keys from which attention takes a task per KV head (and piece of a row's tokens)
/// rather than per (token, query head): past one key chunk, where a step with too few such
/// tasks splits them by chunk. With position-major rows a task per KV head lost 3–7 % of decode
/// speed at ~600 keys on a 2-vCPU Xeon (docs/benchmarks/2026-12-03-cpu-attention-grouping.md),
/// so it started at 1,024 keys; with head-major planes and the chunk split, 256 decoded 3 %
/// faster at 800 keys than 1,024 did and verified 16 tokens 6 % faster, and the same at 300
/// and 512 (docs/benchmarks/2026-12-05-cpu-kv-planes.md). The bits are the same either way.
const GROUP_MIN_KEYS: usize = KEY_CHUNK;

/// Tasks per thread below which a step's attention tasks are split by key chunk.
const SPLIT_BELOW_PER_THREAD: usize = 4;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Tokens of one row a task takes together when the step is split by key chunk anyway (a
/// verify block): each of their KV bytes is then read once per step.
const SHARED_TOKENS: usize = 16;

/// Runs of consecutive tokens of one row, cut into pieces of at most `most` tokens.
fn token_pieces(meta: &[TokenMeta], most: usize) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let mut t0 = 0;
    while t0 < meta.len() {
        let mut t1 = t0 + 1;
        while t1 < meta.len() && t1 - t0 < most && meta[t1].row == meta[t0].row {
            t1 += 1;
        }
        pieces.push((t0, t1));
        t0 = t1;
    }
    pieces
}

/// The queries of one task before any key split: tokens `t0..t1` (of one row) with query heads
/// `h0..h0 + heads` (of one KV head).
#[derive(Clone, Copy)]
struct Group {
    t0: usize,
    t1: usize,
    h0: usize,
    heads: usize,
}

impl Group {
    fn len(&self) -> usize {
        (self.t1 - self.t0) * self.heads
    }

    /// (token, query head) of the group's query `i`.
    fn query(&self, i: usize) -> (usize, usize) {
        (self.t0 + i / self.heads, self.h0 + i % self.heads)
    }
}

/// `out = softmax(q kᵀ · scale) v` for every token of `meta` and query head of `shape`, over
/// layer `layer` of `kv`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &CpuPool,
    isa: Isa,
    q: &CpuTensor,
    kv: &CpuKv,
    layer: usize,
    meta: &[TokenMeta],
    shape: AttnShape,
    out: &mut CpuTensor,
) {
    let AttnShape {
        n_heads,
        n_kv_heads,
        head_dim,
        scale,
    } = shape;
    assert_eq!(q.cols, n_heads * head_dim);
    assert_eq!(q.rows, meta.len());
    assert!(kv.head_dim == head_dim && kv.kv_heads == n_kv_heads);
    out.reshape(q.rows, q.cols);
    let group = n_heads / n_kv_heads;
    let longest = meta.iter().map(|m| m.kv_end.saturating_sub(m.kv_start));
    let long = longest.max().unwrap_or(0) as usize >= GROUP_MIN_KEYS;
    let chunks = meta
        .iter()
        .map(|m| (m.kv_end as usize).div_ceil(KEY_CHUNK))
        .max()
        .unwrap_or(0);
    let split_below = SPLIT_BELOW_PER_THREAD * pool.threads();
    let (pieces, heads) = if long {
        // A row's tokens together when the key split will keep the threads busy; else pieces
        // small enough that the KV heads' tasks give each thread a few.
        let runs = token_pieces(meta, SHARED_TOKENS);
        if chunks > 1 && runs.len() * n_kv_heads < split_below {
            (runs, group)
        } else {
            let most = (meta.len() * n_kv_heads / split_below).max(1);
            (token_pieces(meta, most), group)
        }
    } else {
        ((0..q.rows).map(|t| (t, t + 1)).collect(), 1)
    };
    let groups: Vec<Group> = pieces
        .iter()
        .flat_map(|&(t0, t1)| {
            (0..n_heads / heads).map(move |u| Group {
                t0,
                t1,
                h0: u * heads,
                heads,
            })
        })
        .collect();
    let out_ptr = SyncPtr(out.data.as_mut_ptr());
    let rows = &kv.layers[layer];
    let query_at = |t: usize, h: usize| t * q.cols + h * head_dim;
    let part = |t: usize, h: usize| {
        let (m, at) = (meta[t], query_at(t, h));
        Part {
            q: &q.data[at..at + head_dim],
            start: m.kv_start as usize,
            end: m.kv_end as usize,
        }
    };
    // The KV head of a group's row, all its positions (queries narrow it).
    let slice = |g: &Group| {
        let r = meta[g.t0].row as usize;
        let end = (g.t0..g.t1).map(|t| meta[t].kv_end as usize).max();
        attention::KvSlice {
            k: rows[r].k.data(),
            v: rows[r].v.data(),
            stride: head_dim,
            head_off: kv.head_offset(r, g.h0 / group),
            start: 0,
            end: end.unwrap_or(0),
        }
    };
    if chunks > 1 && groups.len() < split_below {
        return split_by_chunk(
            pool,
            isa,
            &groups,
            chunks,
            head_dim,
            scale,
            &part,
            &slice,
            move |t, h| out_ptr.get().wrapping_add(query_at(t, h)),
        );
    }
    pool.for_each(groups.len(), |task| {
        let g = &groups[task];
        let mut queries: Vec<Query<'_>> = (0..g.len())
            .map(|i| {
                let (t, h) = g.query(i);
                let p = part(t, h);
                Query {
                    q: p.q,
                    start: p.start,
                    end: p.end,
                    // SAFETY: each (token, head) slice of `out` belongs to one task.
                    out: unsafe {
                        std::slice::from_raw_parts_mut(out_ptr.get().add(query_at(t, h)), head_dim)
                    },
                }
            })
            .collect();
        SCRATCH.with(|s| {
            attention::attend_many(isa, slice(g), &mut queries, scale, &mut s.borrow_mut())
        });
    });
}

/// The split path: a task per (group, key chunk) writes each query's partial softmax over the
/// chunk to a buffer; then a task per group merges each of its queries' chunks in order into
/// its output (`out_at(token, head)`, `head_dim` values).
#[allow(clippy::too_many_arguments)]
fn split_by_chunk<'a>(
    pool: &CpuPool,
    isa: Isa,
    groups: &[Group],
    chunks: usize,
    head_dim: usize,
    scale: f32,
    part: &(impl Fn(usize, usize) -> Part<'a> + Sync),
    slice: &(impl Fn(&Group) -> attention::KvSlice<'a> + Sync),
    out_at: impl Fn(usize, usize) -> *mut f32 + Sync,
) {
    // Group g's queries' partials start at slot `first[g] · chunks`, chunk after chunk.
    let mut first = Vec::with_capacity(groups.len() + 1);
    let mut slots = 0;
    for g in groups {
        first.push(slots);
        slots += g.len();
    }
    let mut sums = vec![0f32; slots * chunks * head_dim];
    let mut stats = vec![ChunkStats::default(); slots * chunks];
    let (sums_ptr, stats_ptr) = (SyncPtr(sums.as_mut_ptr()), SyncPtr(stats.as_mut_ptr()));
    let sees = |p: &Part<'_>, c: usize| p.start.max(c * KEY_CHUNK) < p.end.min((c + 1) * KEY_CHUNK);
    pool.for_each(groups.len() * chunks, |task| {
        let (gi, c) = (task / chunks, task % chunks);
        let g = &groups[gi];
        let parts: Vec<Part<'_>> = (0..g.len())
            .map(|i| {
                let (t, h) = g.query(i);
                part(t, h)
            })
            .collect();
        if !parts.iter().any(|p| sees(p, c)) {
            return;
        }
        let full = slice(g);
        let window = attention::KvSlice {
            start: c * KEY_CHUNK,
            end: full.end.min((c + 1) * KEY_CHUNK),
            ..full
        };
        let parts: Vec<Part<'_>> = parts
            .iter()
            .map(|p| Part {
                start: p.start.clamp(window.start, window.end),
                end: p.end.clamp(window.start, window.end),
                ..*p
            })
            .collect();
        let at = (first[gi] * chunks + c * g.len()) as isize;
        // SAFETY: task (g, c) alone writes slots at..at + g.len() of both buffers.
        let (s, st) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    sums_ptr.get().offset(at * head_dim as isize),
                    g.len() * head_dim,
                ),
                std::slice::from_raw_parts_mut(stats_ptr.get().offset(at), g.len()),
            )
        };
        SCRATCH.with(|sc| {
            attention::attend_chunk(isa, window, &parts, scale, &mut sc.borrow_mut(), s, st)
        });
    });
    pool.for_each(groups.len(), |gi| {
        let g = &groups[gi];
        for i in 0..g.len() {
            let (t, h) = g.query(i);
            let p = part(t, h);
            // SAFETY: each (token, head) slice of the output belongs to one group.
            let out = unsafe { std::slice::from_raw_parts_mut(out_at(t, h), head_dim) };
            let mut run = Running::default();
            for c in 0..chunks {
                if sees(&p, c) {
                    let slot = first[gi] * chunks + c * g.len() + i;
                    run.add(
                        stats[slot],
                        &sums[slot * head_dim..(slot + 1) * head_dim],
                        out,
                    );
                }
            }
            run.finish(out);
        }
    });
}
