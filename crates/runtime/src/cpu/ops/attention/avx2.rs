//! The AVX2 attention kernels: one query over the keys of one chunk ([`attend_avx2`], heads of
//! any multiple of 8 values), or up to `MAX_QUERIES` query heads sharing a KV head
//! ([`attend_many_avx2`], heads of 64 or 128 values), giving each query's softmax max and sum
//! and its weighted sum of values. Both run the same operations for a query, so a query gets
//! the same bits from either, alone or with others.
use std::arch::x86_64::*;

use super::super::vexp::{exp8, load8, store8, LANES8};
use super::x86::{Lanes, Walk};
use super::{ChunkStats, Part, Typed};

/// `softmax_weights` in 8 lanes (AVX2): `exp(s - max)` by [`exp8`], summed in 8 partial sums
/// reduced by halves at the end (one order for a given count, whichever query asks).
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_weights_avx2(scores: &mut [f32]) -> ChunkStats {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mx = _mm256_set1_ps(max);
    let mut sum = _mm256_setzero_ps();
    for s in scores.chunks_mut(LANES8) {
        let n = s.len();
        let e = exp8(_mm256_sub_ps(load8(s.as_ptr(), n), mx));
        store8(s.as_mut_ptr(), e, n);
        // Lanes past n hold exp(0 - max): left out of the sum.
        let keep = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(n as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(keep)));
    }
    let h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    ChunkStats {
        max,
        sum: _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h))),
    }
}

/// One query over the keys of `kv`: scores into `scores`, the weighted sum of values into
/// `out`, the softmax's max and sum returned.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_avx2<T: Lanes>(
    q: &[f32],
    kv: Typed<'_, T>,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> ChunkStats {
    let hd = q.len();
    let chunks = hd / 8;
    for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
        let key = kv.k.as_ptr().add(j * kv.stride + kv.head_off);
        let mut acc = _mm256_setzero_ps();
        for c in 0..chunks {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(q.as_ptr().add(8 * c)),
                T::load8(key.add(8 * c)),
                acc,
            );
        }
        *s = hsum8(acc) * scale;
    }
    out.fill(0.0);
    let stats = softmax_weights_avx2(scores);
    for (&p, j) in scores.iter().zip(kv.start..kv.end) {
        let val = kv.v.as_ptr().add(j * kv.stride + kv.head_off);
        let pv = _mm256_set1_ps(p);
        for c in 0..chunks {
            let o = out.as_mut_ptr().add(8 * c);
            _mm256_storeu_ps(
                o,
                _mm256_fmadd_ps(pv, T::load8(val.add(8 * c)), _mm256_loadu_ps(o)),
            );
        }
    }
    stats
}

/// The sum of a score's 8 lanes by halves: lanes i + (i + 4), then i + (i + 2), then
/// i + (i + 1). Every AVX2 score is summed in this order, alone (here) or eight at a time
/// ([`hsum8x8`]).
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum8(a: __m256) -> f32 {
    let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps::<1>(h, h)))
}

/// [`hsum8`] of 8 vectors at once, lane u holding the sum of `a[u]`: the same pairs added at
/// each level. Level 1 pairs vectors 2m, 2m + 1 into [lanes i + (i + 4) of each]; levels 2 and
/// 3 work inside 128-bit lanes, leaving key 2k + h in lane 4h + k, which the final permutation
/// puts in order.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn hsum8x8(a: &[__m256; KEYS]) -> __m256 {
    let mut s = [_mm256_setzero_ps(); 4];
    for (m, sm) in s.iter_mut().enumerate() {
        let (x, y) = (a[2 * m], a[2 * m + 1]);
        *sm = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(x, y),
            _mm256_permute2f128_ps::<0x31>(x, y),
        );
    }
    let pairs = |x: __m256, y: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0x44>(x, y),
            _mm256_shuffle_ps::<0xEE>(x, y),
        )
    };
    let (u0, u1) = (pairs(s[0], s[1]), pairs(s[2], s[3]));
    let f = _mm256_add_ps(
        _mm256_shuffle_ps::<0x88>(u0, u1),
        _mm256_shuffle_ps::<0xDD>(u0, u1),
    );
    _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Keys scored together: independent dependency chains, summed over their lanes together
/// ([`hsum8x8`]).
const KEYS: usize = 8;

/// Value vectors of one query's output held in registers while the keys' values are added
/// (a head of 128 values takes two passes).
const OUT_REGS: usize = 8;

/// Scores of `scores.len()` keys from key `first` on (`kbase` points at key 0 of the head)
/// for one query head of `8 · C` values, `KEYS` keys at a time; every key takes the chain of
/// [`attend_avx2`], alone or with others.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn score_keys<T: Lanes, const C: usize>(
    q: &[f32],
    kbase: *const T,
    stride: usize,
    first: usize,
    scale: f32,
    scores: &mut [f32],
) {
    let n = scores.len();
    let mut s = 0;
    while s + KEYS <= n {
        let mut acc = [_mm256_setzero_ps(); KEYS];
        for c in 0..C {
            let qc = _mm256_loadu_ps(q.as_ptr().add(8 * c));
            for (u, a) in acc.iter_mut().enumerate() {
                let key = kbase.add((first + s + u) * stride + 8 * c);
                *a = _mm256_fmadd_ps(qc, T::load8(key), *a);
            }
        }
        let sums = _mm256_mul_ps(hsum8x8(&acc), _mm256_set1_ps(scale));
        _mm256_storeu_ps(scores.as_mut_ptr().add(s), sums);
        s += KEYS;
    }
    for (j, sc) in scores.iter_mut().enumerate().skip(s) {
        let mut acc = _mm256_setzero_ps();
        for c in 0..C {
            let key = kbase.add((first + j) * stride + 8 * c);
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(8 * c)), T::load8(key), acc);
        }
        *sc = hsum8(acc) * scale;
    }
}

/// Adds `Σ_j p[j] · v[first + j]` to the `8 · C` outputs at `out`, `OUT_REGS` vectors at a
/// time held in registers key by key (the chain of [`attend_avx2`]'s pass over the keys).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_values<T: Lanes, const C: usize>(
    p: &[f32],
    vbase: *const T,
    stride: usize,
    first: usize,
    out: *mut f32,
) {
    debug_assert!(C.is_multiple_of(OUT_REGS));
    for c0 in (0..C).step_by(OUT_REGS) {
        let mut o = [_mm256_setzero_ps(); OUT_REGS];
        for (i, oi) in o.iter_mut().enumerate() {
            *oi = _mm256_loadu_ps(out.add(8 * (c0 + i)));
        }
        for (j, &w) in p.iter().enumerate() {
            let val = vbase.add((first + j) * stride + 8 * c0);
            let pv = _mm256_set1_ps(w);
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = _mm256_fmadd_ps(pv, T::load8(val.add(8 * i)), *oi);
            }
        }
        for (i, oi) in o.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * (c0 + i)), *oi);
        }
    }
}

/// [`attend_avx2`] for up to `MAX_QUERIES` query heads of `8 · C` values (C = 8 or 16) on
/// one KV head, each over its own positions inside one key chunk: keys and values are walked in
/// tiles of 64 positions ([`Walk`]), each tile read by every query that sees part of it before the
/// next, so the heads of a GQA group and a verify block's tokens find it in L1. A query takes
/// exactly the operations of [`attend_avx2`] (its sums pass through memory between tiles, which
/// is exact), so it gets its bits. `scores` holds each query's keys, one query after another;
/// query `i` seeing a key gets its stats in `stats[i]` and its sum in `part[8 C i..]`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn attend_many_avx2<T: Lanes, const C: usize>(
    kv: Typed<'_, T>,
    queries: &[Part<'_>],
    scale: f32,
    scores: &mut [f32],
    part: &mut [f32],
    stats: &mut [ChunkStats],
) {
    debug_assert!(stats.len() >= queries.len());
    let Some(walk) = Walk::new(queries, 8 * C, part) else {
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
        softmax_weights_avx2(s)
    });
    let sums = part.as_mut_ptr();
    for tile in walk.tiles() {
        for (i, q) in queries.iter().enumerate() {
            let (a, b) = Walk::cut(q, tile);
            if a < b {
                let p = &scores[walk.at(i, q, (a, b))];
                add_values::<T, C>(p, vbase, kv.stride, a, sums.add(i * 8 * C));
            }
        }
    }
}
