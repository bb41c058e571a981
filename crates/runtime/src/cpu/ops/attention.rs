//! Softmax attention of one query head over a slice of its row's KV cache.
//!
//! `attend` picks a SIMD implementation for the CPU (AVX-512, AVX2) or the scalar one. Each
//! query is computed on its own with a fixed order, so a query's result never depends on the
//! other queries of the batch.

use super::dot;
use crate::cpu::matmul::Isa;

/// Where one head's keys and values live: position-major rows of `kv_dim` values, the head's
/// slice starting at `head_off`, positions `start..end` visible.
#[derive(Clone, Copy)]
pub struct KvSlice<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub kv_dim: usize,
    pub head_off: usize,
    pub start: usize,
    pub end: usize,
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
    let hd = q.len();
    assert!(kv.end * kv.kv_dim <= kv.k.len() && kv.end * kv.kv_dim <= kv.v.len());
    assert!(kv.head_off + hd <= kv.kv_dim && out.len() == hd);
    scores.clear();
    scores.resize(kv.end.saturating_sub(kv.start), 0.0);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the CPU supports the instruction set (checked when the backend was built)
        // and the bounds were asserted above.
        if isa == Isa::Avx512 && hd == 64 {
            return unsafe { x86::attend_avx512_regs::<4>(q, kv, scale, scores, out) };
        }
        if isa == Isa::Avx512 && hd == 128 {
            return unsafe { x86::attend_avx512_regs::<8>(q, kv, scale, scores, out) };
        }
        if isa == Isa::Avx512 && hd.is_multiple_of(16) {
            return unsafe { x86::attend_avx512(q, kv, scale, scores, out) };
        }
        if matches!(isa, Isa::Avx512 | Isa::Avx2) && hd.is_multiple_of(8) {
            return unsafe { x86::attend_avx2(q, kv, scale, scores, out) };
        }
    }
    let _ = isa;
    attend_scalar(q, kv, scale, scores, out)
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

fn attend_scalar(q: &[f32], kv: KvSlice<'_>, scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let hd = q.len();
    for (s, j) in scores.iter_mut().zip(kv.start..kv.end) {
        let at = j * kv.kv_dim + kv.head_off;
        *s = dot(q, &kv.k[at..at + hd]) * scale;
    }
    out.fill(0.0);
    if scores.is_empty() {
        return;
    }
    let inv = 1.0 / softmax_weights(scores);
    for (&p, j) in scores.iter().zip(kv.start..kv.end) {
        let at = j * kv.kv_dim + kv.head_off;
        for (o, &x) in out.iter_mut().zip(&kv.v[at..at + hd]) {
            *o += p * x;
        }
    }
    for o in out.iter_mut() {
        *o *= inv;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{softmax_weights, KvSlice};

    /// Keys scored together (independent dependency chains).
    const KEYS: usize = 4;

    /// `attend_avx512` for a head of `16 · C` values with the query and the output held in
    /// registers and `KEYS` keys scored at a time; every score and every output lane takes
    /// the same operations in the same order, so the results are the same bits.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn attend_avx512_regs<const C: usize>(
        q: &[f32],
        kv: KvSlice<'_>,
        scale: f32,
        scores: &mut [f32],
        out: &mut [f32],
    ) {
        debug_assert!(q.len() == 16 * C && out.len() == 16 * C);
        let mut qv = [_mm512_setzero_ps(); C];
        for (c, v) in qv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(q.as_ptr().add(16 * c));
        }
        let base = kv.k.as_ptr().add(kv.start * kv.kv_dim + kv.head_off);
        let n = scores.len();
        let mut s = 0;
        while s + KEYS <= n {
            let mut acc = [_mm512_setzero_ps(); KEYS];
            for (c, qc) in qv.iter().enumerate() {
                for (u, a) in acc.iter_mut().enumerate() {
                    let key = base.add((s + u) * kv.kv_dim + 16 * c);
                    *a = _mm512_fmadd_ps(*qc, _mm512_loadu_ps(key), *a);
                }
            }
            for (u, a) in acc.iter().enumerate() {
                scores[s + u] = _mm512_reduce_add_ps(*a) * scale;
            }
            s += KEYS;
        }
        for (j, sc) in scores.iter_mut().enumerate().skip(s) {
            let mut acc = _mm512_setzero_ps();
            for (c, qc) in qv.iter().enumerate() {
                let key = base.add(j * kv.kv_dim + 16 * c);
                acc = _mm512_fmadd_ps(*qc, _mm512_loadu_ps(key), acc);
            }
            *sc = _mm512_reduce_add_ps(acc) * scale;
        }
        if n == 0 {
            out.fill(0.0);
            return;
        }
        let inv = 1.0 / softmax_weights(scores);
        let vbase = kv.v.as_ptr().add(kv.start * kv.kv_dim + kv.head_off);
        let mut o = [_mm512_setzero_ps(); C];
        for (j, &p) in scores.iter().enumerate() {
            let (pv, val) = (_mm512_set1_ps(p), vbase.add(j * kv.kv_dim));
            for (c, oc) in o.iter_mut().enumerate() {
                *oc = _mm512_fmadd_ps(pv, _mm512_loadu_ps(val.add(16 * c)), *oc);
            }
        }
        let iv = _mm512_set1_ps(inv);
        for (c, oc) in o.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), _mm512_mul_ps(*oc, iv));
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn attend_avx512(
        q: &[f32],
        kv: KvSlice<'_>,
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
                    _mm512_loadu_ps(key.add(16 * c)),
                    acc,
                );
            }
            *s = _mm512_reduce_add_ps(acc) * scale;
        }
        out.fill(0.0);
        if scores.is_empty() {
            return;
        }
        let inv = 1.0 / softmax_weights(scores);
        for (&p, j) in scores.iter().zip(kv.start..kv.end) {
            let val = kv.v.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let pv = _mm512_set1_ps(p);
            for c in 0..chunks {
                let o = out.as_mut_ptr().add(16 * c);
                _mm512_storeu_ps(
                    o,
                    _mm512_fmadd_ps(pv, _mm512_loadu_ps(val.add(16 * c)), _mm512_loadu_ps(o)),
                );
            }
        }
        let iv = _mm512_set1_ps(inv);
        for c in 0..chunks {
            let o = out.as_mut_ptr().add(16 * c);
            _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), iv));
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn attend_avx2(
        q: &[f32],
        kv: KvSlice<'_>,
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
                    _mm256_loadu_ps(key.add(8 * c)),
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
        let inv = 1.0 / softmax_weights(scores);
        for (&p, j) in scores.iter().zip(kv.start..kv.end) {
            let val = kv.v.as_ptr().add(j * kv.kv_dim + kv.head_off);
            let pv = _mm256_set1_ps(p);
            for c in 0..chunks {
                let o = out.as_mut_ptr().add(8 * c);
                _mm256_storeu_ps(
                    o,
                    _mm256_fmadd_ps(pv, _mm256_loadu_ps(val.add(8 * c)), _mm256_loadu_ps(o)),
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

    fn reference(q: &[f32], kv: KvSlice<'_>, scale: f32) -> Vec<f64> {
        let hd = q.len();
        let s: Vec<f64> = (kv.start..kv.end)
            .map(|j| {
                (0..hd)
                    .map(|d| q[d] as f64 * kv.k[j * kv.kv_dim + kv.head_off + d] as f64)
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
                    .map(|(j, p)| p * kv.v[j * kv.kv_dim + kv.head_off + d] as f64)
                    .sum::<f64>()
                    / sum
            })
            .collect()
    }

    #[test]
    fn every_isa_matches_an_f64_reference() {
        let (hd, kv_dim, n) = (32, 96, 40);
        let k: Vec<f32> = (0..n * kv_dim)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let v: Vec<f32> = (0..n * kv_dim)
            .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
        let kv = KvSlice {
            k: &k,
            v: &v,
            kv_dim,
            head_off: 32,
            start: 3,
            end: 37,
        };
        let want = reference(&q, kv, 0.2);
        let mut scores = Vec::new();
        for isa in [Isa::detect(), Isa::Avx2, Isa::Portable(8)] {
            if !isa.is_supported() {
                continue;
            }
            let mut out = vec![0f32; hd];
            attend(isa, &q, kv, 0.2, &mut scores, &mut out);
            for (g, w) in out.iter().zip(&want) {
                assert!((*g as f64 - w).abs() < 1e-5, "{isa}: {g} vs {w}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn register_kernels_give_the_bits_of_the_generic_avx512_kernel() {
        if Isa::detect() != Isa::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        for hd in [64usize, 128] {
            let kv_dim = 2 * hd;
            let n = 41;
            let k: Vec<f32> = (0..n * kv_dim)
                .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                .collect();
            let v: Vec<f32> = (0..n * kv_dim)
                .map(|i| ((i * 53 % 97) as f32 / 48.0) - 1.0)
                .collect();
            let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
            for (start, end) in [(0, 0), (2, 3), (1, 5), (0, 8), (3, 40)] {
                let kv = KvSlice {
                    k: &k,
                    v: &v,
                    kv_dim,
                    head_off: hd,
                    start,
                    end,
                };
                let mut want = vec![f32::NAN; hd];
                let mut got = vec![f32::NAN; hd];
                let mut sc = vec![0f32; end - start];
                // SAFETY: AVX-512F was detected; the slices are in bounds.
                unsafe {
                    x86::attend_avx512(&q, kv, 0.125, &mut sc, &mut want);
                    if hd == 64 {
                        x86::attend_avx512_regs::<4>(&q, kv, 0.125, &mut sc, &mut got);
                    } else {
                        x86::attend_avx512_regs::<8>(&q, kv, 0.125, &mut sc, &mut got);
                    }
                }
                let bits = |o: &[f32]| o.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "hd {hd}, keys {start}..{end}");
            }
        }
    }

    #[test]
    fn empty_slice_gives_zeros() {
        let mut out = [1f32; 8];
        let kv = KvSlice {
            k: &[0.0; 8],
            v: &[0.0; 8],
            kv_dim: 8,
            head_off: 0,
            start: 0,
            end: 0,
        };
        attend(Isa::detect(), &[1.0; 8], kv, 1.0, &mut Vec::new(), &mut out);
        assert_eq!(out, [0.0; 8]);
    }
}
