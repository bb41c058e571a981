//! Softmax attention of query heads over a slice of their row's KV cache.
//!
//! `attend_many` picks a SIMD implementation for the CPU (AVX-512, AVX2) or the scalar one, for
//! a cache of f32 or f16 values (widened exactly as they are loaded, so both types run the same
//! arithmetic on the stored values). A query's keys are taken in chunks of [`KEY_CHUNK`]
//! absolute positions: each chunk's softmax is taken alone (largest score, sum of weights,
//! weighted sum of values) and the chunks are merged in order ([`Running`]). Each query is
//! computed on its own with a fixed order that depends only on its positions, so a query's
//! result never depends on the other queries of the batch, nor on whether its chunks were
//! computed in one task ([`attend_many`]) or spread over several ([`attend_chunk`], then
//! [`Running`] over the chunks in order) — a verify block's rows get the bits decode steps get.

use half::f16;

use super::dot;
use crate::cpu::kv::KvData;
use crate::cpu::matmul::Isa;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod x86;

/// Positions per key chunk: chunk `c` holds positions `c · KEY_CHUNK .. (c + 1) · KEY_CHUNK`.
pub const KEY_CHUNK: usize = 256;

/// The chunks of positions `start..end` that hold some of them, in order, each cut to the range.
pub fn key_chunks(start: usize, end: usize) -> impl Iterator<Item = (usize, usize)> {
    let first = start / KEY_CHUNK;
    let last = end.div_ceil(KEY_CHUNK);
    (first..last.max(first))
        .map(move |c| (start.max(c * KEY_CHUNK), end.min((c + 1) * KEY_CHUNK)))
        .filter(|(a, b)| a < b)
}

/// Where one head's keys and values live: position `p`'s `head_dim` values at `head_off + p ·
/// stride` (a head-major cache plane has `stride = head_dim`; rows of several heads, a larger
/// stride), positions `start..end` visible.
#[derive(Clone, Copy)]
pub struct KvSlice<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub stride: usize,
    pub head_off: usize,
    pub start: usize,
    pub end: usize,
}

/// [`KvSlice`] with its values' type known.
#[derive(Clone, Copy)]
struct Typed<'a, T> {
    k: &'a [T],
    v: &'a [T],
    stride: usize,
    head_off: usize,
    start: usize,
    end: usize,
}

/// A value type a KV cache may hold.
trait KvValue: Copy {
    fn widen(self) -> f32;
}

impl KvValue for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvValue for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// One query head for [`attend_many`]: its values, the positions `start..end` it sees and its
/// output (as many values as the query).
pub struct Query<'a> {
    pub q: &'a [f32],
    pub start: usize,
    pub end: usize,
    pub out: &'a mut [f32],
}

/// One query head for [`attend_chunk`]: its values and the positions `start..end` it sees.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    pub q: &'a [f32],
    pub start: usize,
    pub end: usize,
}

/// A query's softmax over the keys of one chunk it sees: the largest score and the sum of the
/// weights `exp(s − max)` (the weighted sum of the values goes beside it).
#[derive(Clone, Copy, Debug, Default)]
pub struct ChunkStats {
    pub max: f32,
    pub sum: f32,
}

/// A query's chunks merged so far, in order; its output holds their weighted sum of values.
#[derive(Clone, Copy, Debug, Default)]
pub struct Running {
    max: f32,
    sum: f32,
    chunks: usize,
}

impl Running {
    /// Merges the next chunk (`stats`, weighted sum of values `part`) into `out`: the first is
    /// taken as it is; a later one rescales both sides to the larger maximum.
    pub fn add(&mut self, stats: ChunkStats, part: &[f32], out: &mut [f32]) {
        if self.chunks == 0 {
            out.copy_from_slice(part);
            (self.max, self.sum) = (stats.max, stats.sum);
        } else {
            let max = self.max.max(stats.max);
            let (a, b) = ((self.max - max).exp(), (stats.max - max).exp());
            for (o, &p) in out.iter_mut().zip(part) {
                *o = *o * a + p * b;
            }
            (self.max, self.sum) = (max, self.sum * a + stats.sum * b);
        }
        self.chunks += 1;
    }

    /// Normalises `out` (zeros when the query saw no key).
    pub fn finish(&self, out: &mut [f32]) {
        if self.chunks == 0 {
            out.fill(0.0);
            return;
        }
        let inv = 1.0 / self.sum;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// Per-thread buffers of [`attend_many`] and [`attend_chunk`].
#[derive(Default)]
pub struct Scratch {
    /// Each query's scores over the chunk at hand, one query after another.
    scores: Vec<f32>,
    /// Each query's weighted sum of values over the chunk at hand.
    part: Vec<f32>,
    stats: Vec<ChunkStats>,
    running: Vec<Running>,
}

/// Attends query head `q` to `kv`, writing `q.len()` outputs to `out`.
pub fn attend(
    isa: Isa,
    q: &[f32],
    kv: KvSlice<'_>,
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let (start, end) = (kv.start, kv.end);
    attend_many(isa, kv, &mut [Query { q, start, end, out }], scale, scratch)
}

/// Attends every query head of `queries` (the same size each) to its own positions of the KV
/// head of `kv`, whose `start..end` holds all of them, chunk after chunk. Each query gets the
/// bits [`attend`] gives it alone; the AVX-512 and AVX2 kernels for heads of 64 and 128 values
/// walk the keys and values in tiles, each tile read by every query that sees it before the next, so
/// queries sharing a KV head (a GQA group, the tokens of a verify block) read it once instead
/// of once each.
pub fn attend_many(
    isa: Isa,
    kv: KvSlice<'_>,
    queries: &mut [Query<'_>],
    scale: f32,
    scratch: &mut Scratch,
) {
    let hd = check(
        &kv,
        queries
            .iter()
            .map(|q| (q.q.len(), q.out.len(), q.start, q.end)),
    );
    for qs in queries.chunks_mut(MAX_QUERIES) {
        let parts: Vec<Part<'_>> = qs
            .iter()
            .map(|q| Part {
                q: q.q,
                start: q.start,
                end: q.end,
            })
            .collect();
        let (lo, hi) = span(&parts);
        scratch.running.clear();
        scratch.running.resize(qs.len(), Running::default());
        for (c0, c1) in key_chunks(lo, hi) {
            let window = KvSlice {
                start: c0,
                end: c1,
                ..kv
            };
            let mut part = std::mem::take(&mut scratch.part);
            let mut stats = std::mem::take(&mut scratch.stats);
            part.resize(parts.len() * hd, 0.0);
            stats.resize(parts.len(), ChunkStats::default());
            attend_chunk(isa, window, &parts, scale, scratch, &mut part, &mut stats);
            for (i, q) in qs.iter_mut().enumerate() {
                if q.start.max(c0) < q.end.min(c1) {
                    scratch.running[i].add(stats[i], &part[i * hd..(i + 1) * hd], q.out);
                }
            }
            (scratch.part, scratch.stats) = (part, stats);
        }
        for (q, r) in qs.iter_mut().zip(&scratch.running) {
            r.finish(q.out);
        }
    }
}

/// The softmax of every query of `queries` over its keys inside `kv.start..kv.end` (the window,
/// which lies inside one key chunk; a query may see positions outside it): for query `i` seeing some of them, its [`ChunkStats`] in `stats[i]`
/// and its weighted sum of values in `part[i · hd..(i + 1) · hd]` (others are left as they
/// are). [`Running`] merges a query's chunks in order into what [`attend_many`] gives.
pub fn attend_chunk(
    isa: Isa,
    kv: KvSlice<'_>,
    queries: &[Part<'_>],
    scale: f32,
    scratch: &mut Scratch,
    part: &mut [f32],
    stats: &mut [ChunkStats],
) {
    assert!(
        kv.start >= kv.end || kv.start / KEY_CHUNK == (kv.end - 1) / KEY_CHUNK,
        "a chunk's keys lie in one chunk"
    );
    // Each query cut to the window.
    let cut: Vec<Part<'_>> = queries
        .iter()
        .map(|q| {
            let (a, b) = (
                q.start.clamp(kv.start, kv.end),
                q.end.clamp(kv.start, kv.end),
            );
            Part {
                q: q.q,
                start: a,
                end: b.max(a),
            }
        })
        .collect();
    let hd = check(
        &kv,
        cut.iter().map(|q| (q.q.len(), q.q.len(), q.start, q.end)),
    );
    assert!(part.len() >= queries.len() * hd && stats.len() >= queries.len());
    let n: usize = cut.iter().map(|q| q.end - q.start).sum();
    scratch.scores.clear();
    scratch.scores.resize(n, 0.0);
    match (kv.k, kv.v) {
        (KvData::F32(k), KvData::F32(v)) => chunk_typed(
            isa,
            kv.typed(k, v),
            &cut,
            scale,
            &mut scratch.scores,
            part,
            stats,
        ),
        (KvData::F16(k), KvData::F16(v)) => chunk_typed(
            isa,
            kv.typed(k, v),
            &cut,
            scale,
            &mut scratch.scores,
            part,
            stats,
        ),
        _ => panic!("the keys and values of one cache have one type"),
    }
}

/// The queries' overall range of positions (empty when none sees a key).
fn span(queries: &[Part<'_>]) -> (usize, usize) {
    queries
        .iter()
        .filter(|q| q.end > q.start)
        .fold((usize::MAX, 0), |(lo, hi), q| {
            (lo.min(q.start), hi.max(q.end))
        })
}

/// Checks the bounds every kernel relies on: each query `(q len, out len, start, end)` has the
/// head's size and positions inside `kv`, whose positions lie inside its storage. Returns the
/// head size.
fn check(kv: &KvSlice<'_>, queries: impl Iterator<Item = (usize, usize, usize, usize)>) -> usize {
    let mut hd = None;
    for (ql, ol, start, end) in queries {
        let h = *hd.get_or_insert(ql);
        assert!(ql == h && ol == h, "queries of one head size");
        assert!(kv.start <= start && start <= end && end <= kv.end);
    }
    let hd = hd.unwrap_or(0);
    assert!(hd <= kv.stride);
    if kv.end > 0 {
        let need = kv.head_off + (kv.end - 1) * kv.stride + hd;
        let (kl, vl) = match (kv.k, kv.v) {
            (KvData::F32(k), KvData::F32(v)) => (k.len(), v.len()),
            (KvData::F16(k), KvData::F16(v)) => (k.len(), v.len()),
            _ => panic!("the keys and values of one cache have one type"),
        };
        assert!(need <= kl && need <= vl, "keys and values within the cache");
    }
    hd
}

impl<'a> KvSlice<'a> {
    /// This slice over keys `k` and values `v` of a known type.
    fn typed<T>(&self, k: &'a [T], v: &'a [T]) -> Typed<'a, T> {
        Typed {
            k,
            v,
            stride: self.stride,
            head_off: self.head_off,
            start: self.start,
            end: self.end,
        }
    }
}

impl<T> Typed<'_, T> {
    /// This slice narrowed to one query's positions.
    fn narrowed(self, q: &Part<'_>) -> Self {
        Typed {
            start: q.start,
            end: q.end,
            ..self
        }
    }
}

/// Queries the register kernels take at once (more are taken in turns).
const MAX_QUERIES: usize = 64;

/// [`attend_chunk`] once the value type is known; `queries` are cut to the window and
/// `scores` holds each one's keys, one query after another.
#[cfg(target_arch = "x86_64")]
fn chunk_typed<T: x86::Lanes>(
    isa: Isa,
    kv: Typed<'_, T>,
    queries: &[Part<'_>],
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
    stats: &mut [ChunkStats],
) {
    let hd = queries.first().map_or(0, |q| q.q.len());
    let mut off = 0;
    for (g, qs) in queries.chunks(MAX_QUERIES).enumerate() {
        let n: usize = qs.iter().map(|q| q.end - q.start).sum();
        let sc = &mut scores[off..off + n];
        off += n;
        let first = g * MAX_QUERIES;
        let part = &mut part[first * hd..(first + qs.len()) * hd];
        let stats = &mut stats[first..first + qs.len()];
        // SAFETY: the CPU supports the instruction set (checked when the backend was built;
        // AVX2 there includes F16C) and the bounds were asserted by `check`.
        unsafe {
            if isa == Isa::Avx512 && hd == 64 {
                x86::attend_many_regs::<T, 4>(kv, qs, scale, sc, part, stats);
                continue;
            }
            if isa == Isa::Avx512 && hd == 128 {
                x86::attend_many_regs::<T, 8>(kv, qs, scale, sc, part, stats);
                continue;
            }
            if isa == Isa::Avx2 && hd == 64 {
                avx2::attend_many_avx2::<T, 8>(kv, qs, scale, sc, part, stats);
                continue;
            }
            if isa == Isa::Avx2 && hd == 128 {
                avx2::attend_many_avx2::<T, 16>(kv, qs, scale, sc, part, stats);
                continue;
            }
            let mut at = 0;
            for (i, q) in qs.iter().enumerate() {
                let (kv, n) = (kv.narrowed(q), q.end - q.start);
                if n == 0 {
                    continue;
                }
                let sc = &mut sc[at..at + n];
                at += n;
                let out = &mut part[i * hd..(i + 1) * hd];
                stats[i] = if isa == Isa::Avx512 && hd.is_multiple_of(16) {
                    x86::attend_avx512(q.q, kv, scale, sc, out)
                } else if matches!(isa, Isa::Avx512 | Isa::Avx2) && hd.is_multiple_of(8) {
                    avx2::attend_avx2(q.q, kv, scale, sc, out)
                } else {
                    attend_scalar(q.q, kv, scale, sc, out)
                };
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn chunk_typed<T: KvValue>(
    isa: Isa,
    kv: Typed<'_, T>,
    queries: &[Part<'_>],
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
    stats: &mut [ChunkStats],
) {
    let _ = isa;
    let hd = queries.first().map_or(0, |q| q.q.len());
    let mut at = 0;
    for (i, q) in queries.iter().enumerate() {
        let (kv, n) = (kv.narrowed(q), q.end - q.start);
        if n == 0 {
            continue;
        }
        let out = &mut part[i * hd..(i + 1) * hd];
        stats[i] = attend_scalar(q.q, kv, scale, &mut scores[at..at + n], out);
        at += n;
    }
}

/// Turns raw scores into unnormalised weights `exp(s - max)`; returns the max and their sum.
fn softmax_weights(scores: &mut [f32]) -> ChunkStats {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    ChunkStats { max, sum }
}

/// The largest head the scalar kernel widens on the stack (larger heads widen on the heap).
const STACK_HEAD: usize = 256;

/// One query over the non-empty positions of `kv`: scores into `scores`, the weighted sum of
/// values into `out`, the softmax's max and sum returned.
fn attend_scalar<T: KvValue>(
    q: &[f32],
    kv: Typed<'_, T>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> ChunkStats {
    let hd = q.len();
    let mut stack = [0f32; STACK_HEAD];
    let mut heap = Vec::new();
    let key: &mut [f32] = if hd <= STACK_HEAD {
        &mut stack[..hd]
    } else {
        heap.resize(hd, 0.0);
        &mut heap
    };
    for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
        let at = j * kv.stride + kv.head_off;
        for (w, x) in key.iter_mut().zip(&kv.k[at..at + hd]) {
            *w = x.widen();
        }
        *s = dot(q, key) * scale;
    }
    let stats = softmax_weights(scores);
    out.fill(0.0);
    for (&p, j) in scores.iter().zip(kv.start..kv.end) {
        let at = j * kv.stride + kv.head_off;
        for (o, x) in out.iter_mut().zip(&kv.v[at..at + hd]) {
            *o += p * x.widen();
        }
    }
    stats
}

#[cfg(test)]
mod tests;
