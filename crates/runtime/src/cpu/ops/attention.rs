//! Softmax attention of one query head over a slice of its row's KV cache.
//!
//! `attend` picks a SIMD implementation for the CPU (AVX-512, AVX2) or the scalar one, for a
//! cache of f32 or f16 values (widened exactly as they are loaded, so both types run the same
//! arithmetic on the stored values). Each query is computed on its own with a fixed order, so
//! a query's result never depends on the other queries of the batch.

use half::f16;

use super::dot;
use crate::cpu::kv::KvData;
use crate::cpu::matmul::Isa;

/// Where one head's keys and values live: position-major rows of `kv_dim` values, the head's
/// slice starting at `head_off`, positions `start..end` visible.
#[derive(Clone, Copy)]
pub struct KvSlice<'a> {
    pub k: KvData<'a>,
    pub v: KvData<'a>,
    pub kv_dim: usize,
    pub head_off: usize,
    pub start: usize,
    pub end: usize,
}

/// [`KvSlice`] with its values' type known.
#[derive(Clone, Copy)]
struct Typed<'a, T> {
    k: &'a [T],
    v: &'a [T],
    kv_dim: usize,
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

/// Attends query head `q` to `kv`, writing `q.len()` outputs to `out`; `scores` is scratch.
pub fn attend(
    isa: Isa,
    q: &[f32],
    kv: KvSlice<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (start, end) = (kv.start, kv.end);
    attend_many(isa, kv, &mut [Query { q, start, end, out }], scale, scores)
}

/// Attends every query head of `queries` (the same size each) to its own positions of the KV
/// head of `kv`, whose `start..end` holds all of them. Each query gets the bits [`attend`]
/// gives it alone; the AVX-512 kernels for heads of 64 and 128 values walk the keys and values
/// in tiles, each tile read by every query that sees it before the next, so queries sharing a
/// KV head (a GQA group, the tokens of a verify block) read it once instead of once each.
pub fn attend_many(
    isa: Isa,
    kv: KvSlice<'_>,
    queries: &mut [Query<'_>],
    scale: f32,
    scores: &mut Vec<f32>,
) {
    match (kv.k, kv.v) {
        (KvData::F32(k), KvData::F32(v)) => {
            attend_typed(isa, kv.typed(k, v), queries, scale, scores)
        }
        (KvData::F16(k), KvData::F16(v)) => {
            attend_typed(isa, kv.typed(k, v), queries, scale, scores)
        }
        _ => panic!("the keys and values of one cache have one type"),
    }
}

impl<'a> KvSlice<'a> {
    /// This slice over keys `k` and values `v` of a known type.
    fn typed<T>(&self, k: &'a [T], v: &'a [T]) -> Typed<'a, T> {
        Typed {
            k,
            v,
            kv_dim: self.kv_dim,
            head_off: self.head_off,
            start: self.start,
            end: self.end,
        }
    }
}

impl<T> Typed<'_, T> {
    /// This slice narrowed to one query's positions.
    fn narrowed(self, q: &Query<'_>) -> Self {
        Typed {
            start: q.start,
            end: q.end,
            ..self
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn attend_typed<T: x86::Lanes>(
    isa: Isa,
    kv: Typed<'_, T>,
    queries: &mut [Query<'_>],
    scale: f32,
    scores: &mut Vec<f32>,
) {
    let hd = prepare(&kv, queries, scores);
    let mut off = 0;
    for chunk in queries.chunks_mut(x86::MAX_QUERIES) {
        let n: usize = chunk.iter().map(|q| q.end - q.start).sum();
        let sc = &mut scores[off..off + n];
        off += n;
        // SAFETY: the CPU supports the instruction set (checked when the backend was built;
        // AVX2 there includes F16C) and the bounds were asserted by `prepare`.
        unsafe {
            if isa == Isa::Avx512 && hd == 64 {
                x86::attend_many_regs::<T, 4>(kv, chunk, scale, sc);
                continue;
            }
            if isa == Isa::Avx512 && hd == 128 {
                x86::attend_many_regs::<T, 8>(kv, chunk, scale, sc);
                continue;
            }
            let mut at = 0;
            for q in chunk.iter_mut() {
                let (kv, n) = (kv.narrowed(q), q.end - q.start);
                let sc = &mut sc[at..at + n];
                at += n;
                if isa == Isa::Avx512 && hd.is_multiple_of(16) {
                    x86::attend_avx512(q.q, kv, scale, sc, q.out);
                } else if matches!(isa, Isa::Avx512 | Isa::Avx2) && hd.is_multiple_of(8) {
                    x86::attend_avx2(q.q, kv, scale, sc, q.out);
                } else {
                    attend_scalar(q.q, kv, scale, sc, q.out);
                }
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn attend_typed<T: KvValue>(
    isa: Isa,
    kv: Typed<'_, T>,
    queries: &mut [Query<'_>],
    scale: f32,
    scores: &mut Vec<f32>,
) {
    let _ = (isa, prepare(&kv, queries, scores));
    let mut at = 0;
    for q in queries.iter_mut() {
        let (kv, n) = (kv.narrowed(q), q.end - q.start);
        attend_scalar(q.q, kv, scale, &mut scores[at..at + n], q.out);
        at += n;
    }
}

/// Checks the bounds every kernel relies on and sizes `scores` (each query's visible keys, one
/// query after another); returns the head size.
fn prepare<T>(kv: &Typed<'_, T>, queries: &[Query<'_>], scores: &mut Vec<f32>) -> usize {
    let hd = queries.first().map_or(0, |q| q.q.len());
    assert!(kv.end * kv.kv_dim <= kv.k.len() && kv.end * kv.kv_dim <= kv.v.len());
    assert!(kv.head_off + hd <= kv.kv_dim);
    let mut n = 0;
    for q in queries {
        assert!(
            q.q.len() == hd && q.out.len() == hd,
            "queries of one head size"
        );
        assert!(kv.start <= q.start && q.start <= q.end && q.end <= kv.end);
        n += q.end - q.start;
    }
    scores.clear();
    scores.resize(n, 0.0);
    hd
}

/// Turns raw scores into unnormalised weights `exp(s - max)`; returns their sum.
fn softmax_weights(scores: &mut [f32]) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// The largest head the scalar kernel widens on the stack (larger heads widen on the heap).
const STACK_HEAD: usize = 256;

fn attend_scalar<T: KvValue>(
    q: &[f32],
    kv: Typed<'_, T>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
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
        let at = j * kv.kv_dim + kv.head_off;
        for (w, x) in key.iter_mut().zip(&kv.k[at..at + hd]) {
            *w = x.widen();
        }
        *s = dot(q, key) * scale;
    }
    out.fill(0.0);
    if scores.is_empty() {
        return;
    }
    let inv = 1.0 / softmax_weights(scores);
    for (&p, j) in scores.iter().zip(kv.start..kv.end) {
        let at = j * kv.kv_dim + kv.head_off;
        for (o, x) in out.iter_mut().zip(&kv.v[at..at + hd]) {
            *o += p * x.widen();
        }
    }
    for o in out.iter_mut() {
        *o *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::super::vexp::{exp16, lane_mask, LANES};
    use super::{KvValue, Query, Typed};

    /// `softmax_weights` in 16 lanes: `exp(s - max)` by [`exp16`], summed in 16 partial sums
    /// reduced at the end (one order for a given count, whichever query asks).
    #[target_feature(enable = "avx512f")]
    unsafe fn softmax_weights_avx512(scores: &mut [f32]) -> f32 {
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for s in scores.chunks(LANES) {
            let v = _mm512_mask_loadu_ps(mx, lane_mask(s.len()), s.as_ptr());
            mx = _mm512_max_ps(mx, v);
        }
        let mx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        let mut sum = _mm512_setzero_ps();
        for s in scores.chunks_mut(LANES) {
            let m = lane_mask(s.len());
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s.as_ptr()), mx));
            _mm512_mask_storeu_ps(s.as_mut_ptr(), m, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
        }
        _mm512_reduce_add_ps(sum)
    }

    /// Keys scored together: independent dependency chains, summed over their lanes together
    /// ([`hsum16x16`]).
    const KEYS: usize = 16;

    /// The sum of a score's 16 lanes by halves: lanes i + (i + 8), then i + (i + 4), i + (i + 2),
    /// i + (i + 1). Every AVX-512 score is summed in this order, alone (here) or sixteen at a time
    /// ([`hsum16x16`]), so a query's scores never depend on how its keys are grouped.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn hsum16(a: __m512) -> f32 {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
        let h = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let r = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps::<1>(r, r)))
    }

    /// [`hsum16`] of 16 vectors at once, lane u holding the sum of `a[u]`: the same pairs added
    /// at each level (lane order within an add does not change its result), about three
    /// instructions a key instead of eight. Level 1 pairs vectors 2m, 2m + 1 into [lanes i + (i +
    /// 8) of each]; level 2 takes quarters of four keys; levels 3 and 4 work inside 128-bit lanes,
    /// leaving key 4k + j in lane 4j + k, which the final permutation puts in order.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn hsum16x16(a: &[__m512; 16]) -> __m512 {
        let mut s = [_mm512_setzero_ps(); 8];
        for (m, sm) in s.iter_mut().enumerate() {
            let (x, y) = (a[2 * m], a[2 * m + 1]);
            *sm = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x44>(x, y),
                _mm512_shuffle_f32x4::<0xEE>(x, y),
            );
        }
        let mut u = [_mm512_setzero_ps(); 4];
        for (n, un) in u.iter_mut().enumerate() {
            let (x, y) = (s[2 * n], s[2 * n + 1]);
            *un = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            );
        }
        let pairs = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(x, y),
                _mm512_shuffle_ps::<0xEE>(x, y),
            )
        };
        let (w0, w1) = (pairs(u[0], u[1]), pairs(u[2], u[3]));
        let f = _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(w0, w1),
            _mm512_shuffle_ps::<0xDD>(w0, w1),
        );
        // Key l sits in lane 4 (l % 4) + l / 4.
        let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(idx, f)
    }

    /// Loads of 16 (AVX-512) or 8 (AVX2) stored values as f32 lanes. Only called from the
    /// kernels below, which enable the features the loads need.
    pub trait Lanes: KvValue {
        /// # Safety
        /// AVX-512F is available; `p` is valid for 16 values.
        unsafe fn load16(p: *const Self) -> __m512;
        /// # Safety
        /// AVX2 and F16C are available; `p` is valid for 8 values.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }

        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
    }

    impl Lanes for f16 {
        #[inline(always)]
        unsafe fn load16(p: *const f16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
        }

        #[inline(always)]
        unsafe fn load8(p: *const f16) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
        }
    }

    /// Queries [`attend_many_regs`] takes at once (more are taken in turns).
    pub const MAX_QUERIES: usize = 64;

    /// Keys per tile: the tile's keys (or values) of one KV head, 16 KB at most, stay in L1
    /// while every head of the group reads them.
    const TILE: usize = 64;

    /// Scores of `scores.len()` keys from key `first` on (`kbase` points at key 0 of the head)
    /// for one query head of `16 · C` values held in registers, `KEYS` keys at a time; every
    /// key takes the same chain of operations, alone or with others.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn score_keys<T: Lanes, const C: usize>(
        q: &[f32],
        kbase: *const T,
        kv_dim: usize,
        first: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let mut qv = [_mm512_setzero_ps(); C];
        for (c, v) in qv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(q.as_ptr().add(16 * c));
        }
        let n = scores.len();
        let mut s = 0;
        while s + KEYS <= n {
            let mut acc = [_mm512_setzero_ps(); KEYS];
            for (c, qc) in qv.iter().enumerate() {
                for (u, a) in acc.iter_mut().enumerate() {
                    let key = kbase.add((first + s + u) * kv_dim + 16 * c);
                    *a = _mm512_fmadd_ps(*qc, T::load16(key), *a);
                }
            }
            let sums = _mm512_mul_ps(hsum16x16(&acc), _mm512_set1_ps(scale));
            _mm512_storeu_ps(scores.as_mut_ptr().add(s), sums);
            s += KEYS;
        }
        for (j, sc) in scores.iter_mut().enumerate().skip(s) {
            let mut acc = _mm512_setzero_ps();
            for (c, qc) in qv.iter().enumerate() {
                let key = kbase.add((first + j) * kv_dim + 16 * c);
                acc = _mm512_fmadd_ps(*qc, T::load16(key), acc);
            }
            *sc = hsum16(acc) * scale;
        }
    }

    /// Adds `Σ_j p[j] · v[first + j]` to the `16 · C` outputs `out` (loaded, accumulated in
    /// registers key by key, stored: the chain of one pass over all keys).
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn add_values<T: Lanes, const C: usize>(
        p: &[f32],
        vbase: *const T,
        kv_dim: usize,
        first: usize,
        out: &mut [f32],
    ) {
        let mut o = [_mm512_setzero_ps(); C];
        for (c, oc) in o.iter_mut().enumerate() {
            *oc = _mm512_loadu_ps(out.as_ptr().add(16 * c));
        }
        for (j, &pj) in p.iter().enumerate() {
            let (pv, val) = (_mm512_set1_ps(pj), vbase.add((first + j) * kv_dim));
            for (c, oc) in o.iter_mut().enumerate() {
                *oc = _mm512_fmadd_ps(pv, T::load16(val.add(16 * c)), *oc);
            }
        }
        for (c, oc) in o.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), *oc);
        }
    }

    /// `attend_avx512` for up to `MAX_QUERIES` query heads of `16 · C` values on one KV head,
    /// each over its own positions: keys and values are walked in tiles of `TILE` positions,
    /// each tile read by every query that sees part of it before the next. A query's scores,
    /// softmax and output take exactly the operations of `attend_avx512` (same chains, in the
    /// same order; outputs pass through memory between tiles, which is exact), so every query
    /// gets its bits. `scores` holds each query's visible keys, one query after another.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn attend_many_regs<T: Lanes, const C: usize>(
        kv: Typed<'_, T>,
        queries: &mut [Query<'_>],
        scale: f32,
        scores: &mut [f32],
    ) {
        debug_assert!(queries.len() <= MAX_QUERIES);
        let mut off = [0usize; MAX_QUERIES + 1];
        for (i, q) in queries.iter_mut().enumerate() {
            debug_assert!(q.q.len() == 16 * C && q.out.len() == 16 * C);
            off[i + 1] = off[i] + (q.end - q.start);
            q.out.fill(0.0);
        }
        let (lo, hi) = queries
            .iter()
            .filter(|q| q.end > q.start)
            .fold((usize::MAX, 0), |(lo, hi), q| {
                (lo.min(q.start), hi.max(q.end))
            });
        if lo >= hi {
            return;
        }
        let at = kv.head_off;
        let (kbase, vbase) = (kv.k.as_ptr().add(at), kv.v.as_ptr().add(at));
        // The part of tile `t0..t1` query `q` sees, as key positions.
        let part = |q: &Query<'_>, t0: usize, t1: usize| (q.start.max(t0), q.end.min(t1));
        for t0 in (lo..hi).step_by(TILE) {
            let t1 = (t0 + TILE).min(hi);
            for (i, q) in queries.iter().enumerate() {
                let (a, b) = part(q, t0, t1);
                if a < b {
                    let sc = &mut scores[off[i] + a - q.start..off[i] + b - q.start];
                    score_keys::<T, C>(q.q, kbase, kv.kv_dim, a, scale, sc);
                }
            }
        }
        let mut inv = [0f32; MAX_QUERIES];
        for (i, iv) in inv.iter_mut().enumerate().take(queries.len()) {
            if off[i + 1] > off[i] {
                *iv = 1.0 / softmax_weights_avx512(&mut scores[off[i]..off[i + 1]]);
            }
        }
        for t0 in (lo..hi).step_by(TILE) {
            let t1 = (t0 + TILE).min(hi);
            for (i, q) in queries.iter_mut().enumerate() {
                let (a, b) = part(q, t0, t1);
                if a < b {
                    let p = &scores[off[i] + a - q.start..off[i] + b - q.start];
                    add_values::<T, C>(p, vbase, kv.kv_dim, a, q.out);
                }
            }
        }
        for (q, &iv) in queries.iter_mut().zip(&inv) {
            if q.end > q.start {
                let iv = _mm512_set1_ps(iv);
                for c in 0..C {
                    let o = q.out.as_mut_ptr().add(16 * c);
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), iv));
                }
            }
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn attend_avx512<T: Lanes>(
        q: &[f32],
        kv: Typed<'_, T>,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = q.len();
        let chunks = hd / 16;
        for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
            let key = kv.k.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let mut acc = _mm512_setzero_ps();
            for c in 0..chunks {
                acc = _mm512_fmadd_ps(
                    _mm512_loadu_ps(q.as_ptr().add(16 * c)),
                    T::load16(key.add(16 * c)),
                    acc,
                );
            }
            *s = hsum16(acc) * scale;
        }
        out.fill(0.0);
        if scores.is_empty() {
            return;
        }
        let inv = 1.0 / softmax_weights_avx512(scores);
        for (&p, j) in scores.iter().zip(kv.start..kv.end) {
            let val = kv.v.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let pv = _mm512_set1_ps(p);
            for c in 0..chunks {
                let o = out.as_mut_ptr().add(16 * c);
                _mm512_storeu_ps(
                    o,
                    _mm512_fmadd_ps(pv, T::load16(val.add(16 * c)), _mm512_loadu_ps(o)),
                );
            }
        }
        let iv = _mm512_set1_ps(inv);
        for c in 0..chunks {
            let o = out.as_mut_ptr().add(16 * c);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), iv));
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_avx2<T: Lanes>(
        q: &[f32],
        kv: Typed<'_, T>,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = q.len();
        let chunks = hd / 8;
        for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
            let key = kv.k.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let mut acc = _mm256_setzero_ps();
            for c in 0..chunks {
                acc = _mm256_fmadd_ps(
                    _mm256_loadu_ps(q.as_ptr().add(8 * c)),
                    T::load8(key.add(8 * c)),
                    acc,
                );
            }
            let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            *s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1))) * scale;
        }
        out.fill(0.0);
        if scores.is_empty() {
            return;
        }
        let inv = 1.0 / super::softmax_weights(scores);
        for (&p, j) in scores.iter().zip(kv.start..kv.end) {
            let val = kv.v.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let pv = _mm256_set1_ps(p);
            for c in 0..chunks {
                let o = out.as_mut_ptr().add(8 * c);
                _mm256_storeu_ps(
                    o,
                    _mm256_fmadd_ps(pv, T::load8(val.add(8 * c)), _mm256_loadu_ps(o)),
                );
            }
        }
        let iv = _mm256_set1_ps(inv);
        for c in 0..chunks {
            let o = out.as_mut_ptr().add(8 * c);
            _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), iv));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(q: &[f32], k: &[f32], v: &[f32], kv: KvSlice<'_>, scale: f32) -> Vec<f64> {
        let hd = q.len();
        let s: Vec<f64> = (kv.start..kv.end)
            .map(|j| {
                (0..hd)
                    .map(|d| q[d] as f64 * k[j * kv.kv_dim + kv.head_off + d] as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        (0..hd)
            .map(|d| {
                (kv.start..kv.end)
                    .zip(&e)
                    .map(|(j, p)| p * v[j * kv.kv_dim + kv.head_off + d] as f64)
                    .sum::<f64>()
                    / sum
            })
            .collect()
    }

    /// Keys and values of `n` positions, with f16 copies (and the f32 values those hold).
    struct Cache {
        k: Vec<f32>,
        v: Vec<f32>,
        k16: Vec<f16>,
        v16: Vec<f16>,
        k_wide: Vec<f32>,
        v_wide: Vec<f32>,
    }

    impl Cache {
        fn new(n: usize, kv_dim: usize) -> Self {
            let k: Vec<f32> = (0..n * kv_dim)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0 + (i as f32 * 1e-4))
                .collect();
            let v: Vec<f32> = (0..n * kv_dim)
                .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0 - (i as f32 * 3e-5))
                .collect();
            let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
            let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
            let k_wide = k16.iter().map(|x| x.to_f32()).collect();
            let v_wide = v16.iter().map(|x| x.to_f32()).collect();
            Cache {
                k,
                v,
                k16,
                v16,
                k_wide,
                v_wide,
            }
        }

        fn slice<'a>(
            &'a self,
            half: bool,
            kv_dim: usize,
            head_off: usize,
            range: (usize, usize),
        ) -> KvSlice<'a> {
            let (k, v) = if half {
                (KvData::F16(&self.k16), KvData::F16(&self.v16))
            } else {
                (KvData::F32(&self.k), KvData::F32(&self.v))
            };
            KvSlice {
                k,
                v,
                kv_dim,
                head_off,
                start: range.0,
                end: range.1,
            }
        }
    }

    fn isas() -> Vec<Isa> {
        [Isa::detect(), Isa::Avx2, Isa::Portable(8)]
            .into_iter()
            .filter(|i| i.is_supported())
            .collect()
    }

    fn bits(o: &[f32]) -> Vec<u32> {
        o.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn every_isa_matches_an_f64_reference() {
        let (hd, kv_dim, n) = (32, 96, 40);
        let c = Cache::new(n, kv_dim);
        let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut scores = Vec::new();
        for half in [false, true] {
            let kv = c.slice(half, kv_dim, 32, (3, 37));
            let want = if half {
                reference(&q, &c.k_wide, &c.v_wide, kv, 0.2)
            } else {
                reference(&q, &c.k, &c.v, kv, 0.2)
            };
            for isa in isas() {
                let mut out = vec![0f32; hd];
                attend(isa, &q, kv, 0.2, &mut scores, &mut out);
                for (g, w) in out.iter().zip(&want) {
                    assert!((*g as f64 - w).abs() < 1e-5, "{isa} f16 {half}: {g} vs {w}");
                }
            }
        }
    }

    /// An f16 cache widens exactly, so every kernel gives the bits it gives for an f32 cache
    /// holding the widened values.
    #[test]
    fn an_f16_cache_gives_the_bits_of_its_widened_values() {
        for (hd, kv_dim) in [(64usize, 192usize), (128, 256), (32, 96), (24, 48)] {
            let n = 37;
            let c = Cache::new(n, kv_dim);
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.7).cos()).collect();
            for isa in isas() {
                for range in [(0, 0), (0, 1), (2, 7), (5, 37)] {
                    let half = c.slice(true, kv_dim, kv_dim - hd, range);
                    let wide = KvSlice {
                        k: KvData::F32(&c.k_wide),
                        v: KvData::F32(&c.v_wide),
                        ..half
                    };
                    let (mut got, mut want) = (vec![f32::NAN; hd], vec![f32::NAN; hd]);
                    attend(isa, &q, half, 0.125, &mut Vec::new(), &mut got);
                    attend(isa, &q, wide, 0.125, &mut Vec::new(), &mut want);
                    assert_eq!(bits(&got), bits(&want), "{isa} hd {hd} keys {range:?}");
                }
            }
        }
    }

    /// Query heads over their own positions (a GQA group, the causal rows of a verify block),
    /// `n` query heads of `hd` values: `(start, end)` of query `i`.
    fn ranges(n: usize, first: (usize, usize), causal: bool) -> Vec<(usize, usize)> {
        (0..n)
            .map(|i| {
                if causal {
                    (first.0, first.1 + i)
                } else {
                    first
                }
            })
            .collect()
    }

    /// A score's lanes are summed by halves (i + (i + 8), i + (i + 4), i + (i + 2), i + (i + 1)),
    /// alone or sixteen scores at a time, bit for bit, on values whose sum depends on the order.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn scores_sum_their_lanes_by_halves_alone_or_sixteen_at_once() {
        use std::arch::x86_64::{__m512, _mm512_loadu_ps, _mm512_storeu_ps};
        if Isa::detect() != Isa::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let halves = |l: &[f32]| -> f32 {
            let mut v = l.to_vec();
            while v.len() > 1 {
                let h = v.len() / 2;
                v = (0..h).map(|i| v[i] + v[i + h]).collect();
            }
            v[0]
        };
        for seed in 0..20u32 {
            // Magnitudes from 1e-8 to 1e8 with both signs: most sums depend on the order.
            let lanes: Vec<[f32; 16]> = (0..16u32)
                .map(|u| {
                    std::array::from_fn(|i| {
                        let h = (seed * 7919 + u * 131 + i as u32 * 17).wrapping_mul(2654435761);
                        let mag = 10f32.powi((h % 17) as i32 - 8);
                        if h & 1 == 0 {
                            mag
                        } else {
                            -mag * 1.37
                        }
                    })
                })
                .collect();
            // SAFETY: AVX-512F is present (checked above); every pointer covers 16 f32.
            unsafe {
                let vecs: [__m512; 16] =
                    std::array::from_fn(|u| _mm512_loadu_ps(lanes[u].as_ptr()));
                let mut all = [0f32; 16];
                _mm512_storeu_ps(all.as_mut_ptr(), x86::hsum16x16(&vecs));
                for (u, l) in lanes.iter().enumerate() {
                    let want = halves(l);
                    assert_eq!(
                        x86::hsum16(vecs[u]).to_bits(),
                        want.to_bits(),
                        "seed {seed} key {u} alone"
                    );
                    assert_eq!(
                        all[u].to_bits(),
                        want.to_bits(),
                        "seed {seed} key {u} of 16"
                    );
                }
            }
        }
    }

    /// The many-query register kernels, for one query or several, over one tile of keys or
    /// several, give every query the bits of the generic AVX-512 kernel on that query alone.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn many_query_register_kernels_give_each_query_the_bits_of_the_generic_avx512_kernel() {
        if Isa::detect() != Isa::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        fn check<T: x86::Lanes>(k: &[T], v: &[T], hd: usize, rs: &[(usize, usize)]) {
            let kv = Typed {
                k,
                v,
                kv_dim: 2 * hd,
                head_off: hd,
                start: 0,
                end: k.len() / (2 * hd),
            };
            let qs: Vec<Vec<f32>> = (0..rs.len())
                .map(|i| (0..hd).map(|d| ((i * hd + d) as f32 * 0.3).sin()).collect())
                .collect();
            let mut outs = vec![vec![f32::NAN; hd]; rs.len()];
            let mut queries: Vec<Query<'_>> = qs
                .iter()
                .zip(outs.iter_mut())
                .zip(rs)
                .map(|((q, out), &(start, end))| Query { q, start, end, out })
                .collect();
            let mut sc = vec![0f32; rs.iter().map(|r| r.1 - r.0).sum()];
            // SAFETY: AVX-512F was detected; the slices are in bounds.
            unsafe {
                if hd == 64 {
                    x86::attend_many_regs::<T, 4>(kv, &mut queries, 0.125, &mut sc);
                } else {
                    x86::attend_many_regs::<T, 8>(kv, &mut queries, 0.125, &mut sc);
                }
                drop(queries);
                for (i, &(start, end)) in rs.iter().enumerate() {
                    let mut want = vec![f32::NAN; hd];
                    let mut sc = vec![0f32; end - start];
                    let kv = Typed { start, end, ..kv };
                    x86::attend_avx512(&qs[i], kv, 0.125, &mut sc, &mut want);
                    assert_eq!(bits(&outs[i]), bits(&want), "hd {hd}, query {i} of {rs:?}");
                }
            }
        }
        for hd in [64usize, 128] {
            let c = Cache::new(210, 2 * hd);
            for n in [1, 3, 4, 16] {
                for first in [
                    (0, 0),
                    (2, 3),
                    (1, 5),
                    (0, 8),
                    (3, 40),
                    (0, 64),
                    (1, 129),
                    (5, 190),
                ] {
                    for causal in [false, true] {
                        let rs = ranges(n, first, causal);
                        check(&c.k, &c.v, hd, &rs);
                        check(&c.k16, &c.v16, hd, &rs);
                    }
                }
            }
        }
    }

    /// `attend_many` gives each query the bits `attend` gives it alone, on every ISA and for
    /// more queries than the register kernels take at once.
    #[test]
    fn many_queries_give_each_query_its_own_bits() {
        for (hd, n, causal) in [
            (64usize, 3usize, false),
            (128, 5, true),
            (32, 3, true),
            (64, 70, true),
        ] {
            let kv_dim = 2 * hd;
            let c = Cache::new(150, kv_dim);
            let qs: Vec<Vec<f32>> = (0..n)
                .map(|i| {
                    (0..hd)
                        .map(|d| ((i * hd + d) as f32 * 0.37).cos())
                        .collect()
                })
                .collect();
            for isa in isas() {
                for half in [false, true] {
                    for first in [(0, 0), (0, 1), (7, 70)] {
                        let rs = ranges(n, first, causal);
                        let all = c.slice(half, kv_dim, hd, (0, 150));
                        let mut outs = vec![vec![f32::NAN; hd]; n];
                        let mut queries: Vec<Query<'_>> = qs
                            .iter()
                            .zip(outs.iter_mut())
                            .zip(&rs)
                            .map(|((q, out), &(start, end))| Query { q, start, end, out })
                            .collect();
                        attend_many(isa, all, &mut queries, 0.2, &mut Vec::new());
                        drop(queries);
                        for (i, &r) in rs.iter().enumerate() {
                            let mut want = vec![f32::NAN; hd];
                            let kv = c.slice(half, kv_dim, hd, r);
                            attend(isa, &qs[i], kv, 0.2, &mut Vec::new(), &mut want);
                            assert_eq!(
                                bits(&outs[i]),
                                bits(&want),
                                "{isa} hd {hd} query {i} {r:?} f16 {half}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn empty_slice_gives_zeros() {
        let mut out = [1f32; 8];
        let kv = KvSlice {
            k: KvData::F16(&[f16::ZERO; 8]),
            v: KvData::F16(&[f16::ZERO; 8]),
            kv_dim: 8,
            head_off: 0,
            start: 0,
            end: 0,
        };
        attend(Isa::detect(), &[1.0; 8], kv, 1.0, &mut Vec::new(), &mut out);
        assert_eq!(out, [0.0; 8]);
    }

    #[test]
    #[should_panic(expected = "one type")]
    fn mixed_types_are_refused() {
        let kv = KvSlice {
            k: KvData::F16(&[f16::ZERO; 8]),
            v: KvData::F32(&[0.0; 8]),
            kv_dim: 8,
            head_off: 0,
            start: 0,
            end: 1,
        };
        attend(
            Isa::detect(),
            &[1.0; 8],
            kv,
            1.0,
            &mut Vec::new(),
            &mut [0.0; 8],
        );
    }
}
