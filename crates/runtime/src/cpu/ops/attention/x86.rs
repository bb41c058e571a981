//! The AVX-512 attention kernels (the AVX2 ones are in `avx2`), and the loads both use: one
//! query, or up to `MAX_QUERIES` sharing a KV head, over the keys of one chunk, giving each
//! query's softmax max and sum and its weighted sum of values (normalised by the caller once
//! the chunks are merged).
use std::arch::x86_64::*;

use half::f16;

use super::super::vexp::{exp16, lane_mask, LANES};
use super::{ChunkStats, KvValue, Part, Typed, MAX_QUERIES};

/// `softmax_weights` in 16 lanes: `exp(s - max)` by [`exp16`], summed in 16 partial sums
/// reduced at the end (one order for a given count, whichever query asks).
#[target_feature(enable = "avx512f")]
unsafe fn softmax_weights_avx512(scores: &mut [f32]) -> ChunkStats {
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    for s in scores.chunks(LANES) {
        let v = _mm512_mask_loadu_ps(mx, lane_mask(s.len()), s.as_ptr());
        mx = _mm512_max_ps(mx, v);
    }
    let max = _mm512_reduce_max_ps(mx);
    let mx = _mm512_set1_ps(max);
    let mut sum = _mm512_setzero_ps();
    for s in scores.chunks_mut(LANES) {
        let m = lane_mask(s.len());
        let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s.as_ptr()), mx));
        _mm512_mask_storeu_ps(s.as_mut_ptr(), m, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
    }
    ChunkStats {
        max,
        sum: _mm512_reduce_add_ps(sum),
    }
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

/// Queries whose value sums [`add_values`] runs together for heads of 64 values (their 4 × 4
/// accumulators, plus one loaded value, in registers); half as many for heads of 128.
const VALUE_QUERIES: usize = 4;

/// Keys per tile: the tile's keys (or values) of one KV head, 16 KB at most, stay in L1
/// while every head of the group reads them.
const TILE: usize = 64;

/// What the many-query register kernels share: where each query's scores lie in `scores`
/// (query `i`'s keys at `off[i]..off[i + 1]`, one query after another) and the tiles of `TILE`
/// positions over the queries' span, each tile's part a query sees.
pub(super) struct Walk {
    off: [usize; MAX_QUERIES + 1],
    lo: usize,
    hi: usize,
}

impl Walk {
    /// The walk over `queries` (heads of `hd` values), their sums in `part` zeroed; `None` when
    /// no query sees a key.
    pub fn new(queries: &[Part<'_>], hd: usize, part: &mut [f32]) -> Option<Self> {
        debug_assert!(queries.len() <= MAX_QUERIES && part.len() >= queries.len() * hd);
        let mut off = [0usize; MAX_QUERIES + 1];
        for (i, q) in queries.iter().enumerate() {
            debug_assert!(q.q.len() == hd);
            off[i + 1] = off[i] + (q.end - q.start);
            part[i * hd..(i + 1) * hd].fill(0.0);
        }
        let (lo, hi) = super::span(queries);
        (lo < hi).then_some(Walk { off, lo, hi })
    }

    /// The tiles `(t0, t1)`, in order.
    pub fn tiles(&self) -> impl Iterator<Item = (usize, usize)> {
        let hi = self.hi;
        (self.lo..hi)
            .step_by(TILE)
            .map(move |t0| (t0, (t0 + TILE).min(hi)))
    }

    /// The positions `(a, b)` of tile `t0..t1` query `q` sees (empty when `a >= b`).
    pub fn cut(q: &Part<'_>, (t0, t1): (usize, usize)) -> (usize, usize) {
        (q.start.max(t0), q.end.min(t1))
    }

    /// Where the scores of positions `a..b` of query `i` (`q`) lie in `scores`.
    pub fn at(&self, i: usize, q: &Part<'_>, (a, b): (usize, usize)) -> std::ops::Range<usize> {
        self.off[i] + a - q.start..self.off[i] + b - q.start
    }

    /// Every query's scores, tile by tile: `score(query, first position, its scores)`.
    pub fn score(
        &self,
        queries: &[Part<'_>],
        scores: &mut [f32],
        mut score: impl FnMut(&Part<'_>, usize, &mut [f32]),
    ) {
        for tile in self.tiles() {
            for (i, q) in queries.iter().enumerate() {
                let (a, b) = Self::cut(q, tile);
                if a < b {
                    score(q, a, &mut scores[self.at(i, q, (a, b))]);
                }
            }
        }
    }

    /// Every query's softmax weights over all its keys by `weights`, its stats in `stats`.
    pub fn softmax(
        &self,
        scores: &mut [f32],
        stats: &mut [ChunkStats],
        weights: impl Fn(&mut [f32]) -> ChunkStats,
    ) {
        for (i, st) in stats.iter_mut().enumerate() {
            let (a, b) = (self.off[i], self.off[i + 1]);
            if b > a {
                *st = weights(&mut scores[a..b]);
            }
        }
    }
}

/// Scores of `scores.len()` keys from key `first` on (`kbase` points at key 0 of the head)
/// for one query head of `16 · C` values held in registers, `KEYS` keys at a time; every
/// key takes the same chain of operations, alone or with others.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn score_keys<T: Lanes, const C: usize>(
    q: &[f32],
    kbase: *const T,
    stride: usize,
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
                let key = kbase.add((first + s + u) * stride + 16 * c);
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
            let key = kbase.add((first + j) * stride + 16 * c);
            acc = _mm512_fmadd_ps(*qc, T::load16(key), acc);
        }
        *sc = hsum16(acc) * scale;
    }
}

/// For each of `G` queries seeing the same keys, adds `Σ_j p_g[j] · v[first + j]` to its
/// `16 · C` outputs at `outs[g]` (loaded, accumulated in registers key by key, stored: the
/// chain of one pass over all keys, the same for each query as alone). Each value is loaded
/// once for the `G` queries.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn add_values<T: Lanes, const C: usize, const G: usize>(
    ps: [&[f32]; G],
    vbase: *const T,
    stride: usize,
    first: usize,
    outs: [*mut f32; G],
) {
    let mut o = [[_mm512_setzero_ps(); C]; G];
    for (og, out) in o.iter_mut().zip(outs) {
        for (c, oc) in og.iter_mut().enumerate() {
            *oc = _mm512_loadu_ps(out.add(16 * c));
        }
    }
    let n = ps[0].len();
    debug_assert!(ps.iter().all(|p| p.len() == n));
    let weights = ps.map(|p| p.as_ptr());
    for j in 0..n {
        let val = vbase.add((first + j) * stride);
        let pv: [__m512; G] = weights.map(|w| _mm512_set1_ps(*w.add(j)));
        for c in 0..C {
            let v = T::load16(val.add(16 * c));
            for (og, pg) in o.iter_mut().zip(&pv) {
                og[c] = _mm512_fmadd_ps(*pg, v, og[c]);
            }
        }
    }
    for (og, out) in o.iter().zip(outs) {
        for (c, oc) in og.iter().enumerate() {
            _mm512_storeu_ps(out.add(16 * c), *oc);
        }
    }
}

/// `attend_avx512` for up to `MAX_QUERIES` query heads of `16 · C` values on one KV head,
/// each over its own positions (inside one key chunk): keys and values are walked in tiles of
/// `TILE` positions, each tile read by every query that sees part of it before the next. A
/// query's scores, softmax and weighted sum take exactly the operations of `attend_avx512`
/// (same chains, in the same order; sums pass through memory between tiles, which is exact),
/// so every query gets its bits. `scores` holds each query's keys, one query after another;
/// query `i` seeing a key gets its stats in `stats[i]` and its sum in `part[16 C i..]`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn attend_many_regs<T: Lanes, const C: usize>(
    kv: Typed<'_, T>,
    queries: &[Part<'_>],
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
    stats: &mut [ChunkStats],
) {
    debug_assert!(stats.len() >= queries.len());
    let Some(walk) = Walk::new(queries, 16 * C, part) else {
        return;
    };
    let at = kv.head_off;
    let (kbase, vbase) = (kv.k.as_ptr().add(at), kv.v.as_ptr().add(at));
    walk.score(queries, scores, |q, a, sc| {
        // SAFETY: the caller's features and bounds (this function's contract).
        unsafe { score_keys::<T, C>(q.q, kbase, kv.stride, a, scale, sc) }
    });
    // SAFETY: as above.
    walk.softmax(scores, &mut stats[..queries.len()], |s| unsafe {
        softmax_weights_avx512(s)
    });
    // Runs of up to `VALUE_QUERIES` queries seeing the same keys of a tile (the heads of a
    // GQA group, a verify block's tokens inside their common range) share each value's load.
    let group = VALUE_QUERIES / C.div_ceil(4);
    let sums = part.as_mut_ptr();
    for tile in walk.tiles() {
        let mut i = 0;
        while i < queries.len() {
            let (a, b) = Walk::cut(&queries[i], tile);
            let mut n = 1;
            while n < group && i + n < queries.len() && Walk::cut(&queries[i + n], tile) == (a, b) {
                n += 1;
            }
            if a < b {
                let p = |k: usize| &scores[walk.at(i + k, &queries[i + k], (a, b))];
                let out = |k: usize| sums.add((i + k) * 16 * C);
                let (vb, st) = (vbase, kv.stride);
                match n {
                    1 => add_values::<T, C, 1>([p(0)], vb, st, a, [out(0)]),
                    2 => add_values::<T, C, 2>([p(0), p(1)], vb, st, a, [out(0), out(1)]),
                    3 => add_values::<T, C, 3>(
                        [p(0), p(1), p(2)],
                        vb,
                        st,
                        a,
                        [out(0), out(1), out(2)],
                    ),
                    _ => add_values::<T, C, 4>(
                        [p(0), p(1), p(2), p(3)],
                        vb,
                        st,
                        a,
                        [out(0), out(1), out(2), out(3)],
                    ),
                }
            }
            i += n;
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
) -> ChunkStats {
    let hd = q.len();
    let chunks = hd / 16;
    for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
        let key = kv.k.as_ptr().add(j * kv.stride + kv.head_off);
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
    let stats = softmax_weights_avx512(scores);
    for (&p, j) in scores.iter().zip(kv.start..kv.end) {
        let val = kv.v.as_ptr().add(j * kv.stride + kv.head_off);
        let pv = _mm512_set1_ps(p);
        for c in 0..chunks {
            let o = out.as_mut_ptr().add(16 * c);
            _mm512_storeu_ps(
                o,
                _mm512_fmadd_ps(pv, T::load16(val.add(16 * c)), _mm512_loadu_ps(o)),
            );
        }
    }
    stats
}
