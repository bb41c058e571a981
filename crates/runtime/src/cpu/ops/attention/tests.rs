//! Tests of the attention kernels, the chunk merge and the task splits they allow.

use super::*;

fn reference(q: &[f32], k: &[f32], v: &[f32], kv: KvSlice<'_>, scale: f32) -> Vec<f64> {
    let hd = q.len();
    let s: Vec<f64> = (kv.start..kv.end)
        .map(|j| {
            (0..hd)
                .map(|d| q[d] as f64 * k[j * kv.stride + kv.head_off + d] as f64)
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
                .map(|(j, p)| p * v[j * kv.stride + kv.head_off + d] as f64)
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
    fn new(n: usize, stride: usize) -> Self {
        let k: Vec<f32> = (0..n * stride)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0 + (i as f32 * 1e-4))
            .collect();
        let v: Vec<f32> = (0..n * stride)
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
        stride: usize,
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
            stride,
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

/// Every ISA's `attend` of a fixed query over `range` of the head at `head_off`, on the f32 and
/// the f16 cache, within `tol` of the f64 reference.
fn matches_the_f64_reference(c: &Cache, hd: usize, stride: usize, range: (usize, usize), tol: f64) {
    let (head_off, scale) = (stride - hd, 0.3);
    let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
    for half in [false, true] {
        let kv = c.slice(half, stride, head_off, range);
        let want = if half {
            reference(&q, &c.k_wide, &c.v_wide, kv, scale)
        } else {
            reference(&q, &c.k, &c.v, kv, scale)
        };
        for isa in isas() {
            let mut out = vec![0f32; hd];
            attend(isa, &q, kv, scale, &mut Scratch::default(), &mut out);
            for (g, w) in out.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() < tol,
                    "{isa} f16 {half} {range:?}: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn every_isa_matches_an_f64_reference() {
    matches_the_f64_reference(&Cache::new(40, 96), 32, 96, (3, 37), 1e-5);
}

/// An f16 cache widens exactly, so every kernel gives the bits it gives for an f32 cache
/// holding the widened values.
#[test]
fn an_f16_cache_gives_the_bits_of_its_widened_values() {
    for (hd, stride) in [(64usize, 192usize), (128, 256), (32, 96), (24, 48)] {
        let n = 37;
        let c = Cache::new(n, stride);
        let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.7).cos()).collect();
        for isa in isas() {
            for range in [(0, 0), (0, 1), (2, 7), (5, 37)] {
                let half = c.slice(true, stride, stride - hd, range);
                let wide = KvSlice {
                    k: KvData::F32(&c.k_wide),
                    v: KvData::F32(&c.v_wide),
                    ..half
                };
                let (mut got, mut want) = (vec![f32::NAN; hd], vec![f32::NAN; hd]);
                attend(isa, &q, half, 0.125, &mut Scratch::default(), &mut got);
                attend(isa, &q, wide, 0.125, &mut Scratch::default(), &mut want);
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

/// `n` query heads of `hd` values, query `i` value `d` being `cos((i · hd + d) · step)`.
fn query_values(n: usize, hd: usize, step: f32) -> Vec<Vec<f32>> {
    (0..n)
        .map(|i| {
            (0..hd)
                .map(|d| ((i * hd + d) as f32 * step).cos())
                .collect()
        })
        .collect()
}

/// Queries `qs` over positions `rs`, writing to `outs`.
fn queries<'a>(
    qs: &'a [Vec<f32>],
    outs: &'a mut [Vec<f32>],
    rs: &[(usize, usize)],
) -> Vec<Query<'a>> {
    qs.iter()
        .zip(outs.iter_mut())
        .zip(rs)
        .map(|((q, out), &(start, end))| Query { q, start, end, out })
        .collect()
}

/// The x86 widths this CPU runs: AVX-512 (16 lanes) and AVX2 (8 lanes) where present.
#[cfg(target_arch = "x86_64")]
fn x86_widths() -> Vec<Isa> {
    let w: Vec<Isa> = [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|i| i.is_supported())
        .collect();
    if w.is_empty() {
        eprintln!("skipped: this CPU has neither AVX-512F nor AVX2");
    }
    w
}

/// A score's lanes are summed by halves (16 lanes: i + (i + 8), i + (i + 4), i + (i + 2),
/// i + (i + 1); 8 lanes from the second step), alone or a vector of scores at a time, bit for
/// bit, on values whose sum depends on the order.
#[cfg(target_arch = "x86_64")]
#[test]
fn scores_sum_their_lanes_by_halves_alone_or_a_vector_at_once() {
    use std::arch::x86_64::*;
    let halves = |l: &[f32]| -> f32 {
        let mut v = l.to_vec();
        while v.len() > 1 {
            let h = v.len() / 2;
            v = (0..h).map(|i| v[i] + v[i + h]).collect();
        }
        v[0]
    };
    for isa in x86_widths() {
        let w = if isa == Isa::Avx512 { 16 } else { 8 };
        for seed in 0..20u32 {
            // Magnitudes from 1e-8 to 1e8 with both signs: most sums depend on the order.
            let lanes: Vec<Vec<f32>> = (0..w as u32)
                .map(|u| {
                    (0..w as u32)
                        .map(|i| {
                            let h = (seed * 7919 + u * 131 + i * 17).wrapping_mul(2654435761);
                            let mag = 10f32.powi((h % 17) as i32 - 8);
                            if h & 1 == 0 {
                                mag
                            } else {
                                -mag * 1.37
                            }
                        })
                        .collect()
                })
                .collect();
            let mut all = vec![0f32; w];
            let mut alone = vec![0f32; w];
            // SAFETY: the width's features are present (`x86_widths`); every pointer covers
            // `w` f32.
            unsafe {
                if isa == Isa::Avx512 {
                    let v: [__m512; 16] =
                        std::array::from_fn(|u| _mm512_loadu_ps(lanes[u].as_ptr()));
                    _mm512_storeu_ps(all.as_mut_ptr(), x86::hsum16x16(&v));
                    for (u, s) in alone.iter_mut().enumerate() {
                        *s = x86::hsum16(v[u]);
                    }
                } else {
                    let v: [__m256; 8] =
                        std::array::from_fn(|u| _mm256_loadu_ps(lanes[u].as_ptr()));
                    _mm256_storeu_ps(all.as_mut_ptr(), avx2::hsum8x8(&v));
                    for (u, s) in alone.iter_mut().enumerate() {
                        *s = avx2::hsum8(v[u]);
                    }
                }
            }
            for (u, l) in lanes.iter().enumerate() {
                let want = halves(l).to_bits();
                assert_eq!(alone[u].to_bits(), want, "{isa} seed {seed} key {u} alone");
                assert_eq!(all[u].to_bits(), want, "{isa} seed {seed} key {u} of {w}");
            }
        }
    }
}

/// The many-query register kernels (AVX-512 and AVX2), for one query or several, over one tile
/// of keys or several, give every query the bits of the generic kernel of their width on that
/// query alone.
#[cfg(target_arch = "x86_64")]
#[test]
fn many_query_register_kernels_give_each_query_the_bits_of_the_generic_kernel() {
    fn check<T: x86::Lanes>(isa: Isa, k: &[T], v: &[T], hd: usize, rs: &[(usize, usize)]) {
        let kv = Typed {
            k,
            v,
            stride: 2 * hd,
            head_off: hd,
            start: 0,
            end: k.len() / (2 * hd),
        };
        let qs: Vec<Vec<f32>> = (0..rs.len())
            .map(|i| (0..hd).map(|d| ((i * hd + d) as f32 * 0.3).sin()).collect())
            .collect();
        let queries: Vec<Part<'_>> = qs
            .iter()
            .zip(rs)
            .map(|(q, &(start, end))| Part { q, start, end })
            .collect();
        let mut sc = vec![0f32; rs.iter().map(|r| r.1 - r.0).sum()];
        let mut part = vec![f32::NAN; rs.len() * hd];
        let mut stats = vec![ChunkStats::default(); rs.len()];
        let (q, s, p, st) = (&queries, &mut sc, &mut part, &mut stats);
        // SAFETY: the width's features were detected; the slices are in bounds.
        unsafe {
            match (isa, hd) {
                (Isa::Avx512, 64) => x86::attend_many_regs::<T, 4>(kv, q, 0.125, s, p, st),
                (Isa::Avx512, _) => x86::attend_many_regs::<T, 8>(kv, q, 0.125, s, p, st),
                (_, 64) => avx2::attend_many_avx2::<T, 8>(kv, q, 0.125, s, p, st),
                _ => avx2::attend_many_avx2::<T, 16>(kv, q, 0.125, s, p, st),
            }
        }
        for (i, &(start, end)) in rs.iter().enumerate() {
            let got = &part[i * hd..(i + 1) * hd];
            if start == end {
                assert_eq!(got, vec![0.0; hd], "{isa} hd {hd}, query {i} sees no key");
                continue;
            }
            let mut want = vec![f32::NAN; hd];
            let mut sc = vec![0f32; end - start];
            let kv = Typed { start, end, ..kv };
            // SAFETY: as above.
            let st = unsafe {
                if isa == Isa::Avx512 {
                    x86::attend_avx512(&qs[i], kv, 0.125, &mut sc, &mut want)
                } else {
                    avx2::attend_avx2(&qs[i], kv, 0.125, &mut sc, &mut want)
                }
            };
            assert_eq!(bits(got), bits(&want), "{isa} hd {hd}, query {i} of {rs:?}");
            assert_eq!(
                (stats[i].max.to_bits(), stats[i].sum.to_bits()),
                (st.max.to_bits(), st.sum.to_bits()),
                "{isa} hd {hd}, query {i} of {rs:?}: softmax"
            );
        }
    }
    for isa in x86_widths() {
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
                        check(isa, &c.k, &c.v, hd, &rs);
                        check(isa, &c.k16, &c.v16, hd, &rs);
                    }
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
        let stride = 2 * hd;
        let c = Cache::new(150, stride);
        let qs = query_values(n, hd, 0.37);
        for isa in isas() {
            for half in [false, true] {
                for first in [(0, 0), (0, 1), (7, 70)] {
                    let rs = ranges(n, first, causal);
                    let all = c.slice(half, stride, hd, (0, 150));
                    let mut outs = vec![vec![f32::NAN; hd]; n];
                    let mut queries = queries(&qs, &mut outs, &rs);
                    attend_many(isa, all, &mut queries, 0.2, &mut Scratch::default());
                    drop(queries);
                    for (i, &r) in rs.iter().enumerate() {
                        let mut want = vec![f32::NAN; hd];
                        let kv = c.slice(half, stride, hd, r);
                        attend(isa, &qs[i], kv, 0.2, &mut Scratch::default(), &mut want);
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
        stride: 8,
        head_off: 0,
        start: 0,
        end: 0,
    };
    attend(
        Isa::detect(),
        &[1.0; 8],
        kv,
        1.0,
        &mut Scratch::default(),
        &mut out,
    );
    assert_eq!(out, [0.0; 8]);
}

#[test]
#[should_panic(expected = "one type")]
fn mixed_types_are_refused() {
    let kv = KvSlice {
        k: KvData::F16(&[f16::ZERO; 8]),
        v: KvData::F32(&[0.0; 8]),
        stride: 8,
        head_off: 0,
        start: 0,
        end: 1,
    };
    attend(
        Isa::detect(),
        &[1.0; 8],
        kv,
        1.0,
        &mut Scratch::default(),
        &mut [0.0; 8],
    );
}

#[test]
fn key_chunks_cut_a_range_at_absolute_positions() {
    let c = KEY_CHUNK;
    let chunks = |a, b| key_chunks(a, b).collect::<Vec<_>>();
    assert_eq!(chunks(0, 0), vec![]);
    assert_eq!(chunks(5, 5), vec![]);
    assert_eq!(chunks(0, 1), vec![(0, 1)]);
    assert_eq!(chunks(0, c), vec![(0, c)]);
    assert_eq!(chunks(c, 2 * c), vec![(c, 2 * c)]);
    assert_eq!(
        chunks(c - 6, 2 * c + 8),
        vec![(c - 6, c), (c, 2 * c), (2 * c, 2 * c + 8)]
    );
}

/// Queries over several key chunks: every ISA within rounding of an f64 reference.
#[test]
fn rows_of_several_key_chunks_match_an_f64_reference() {
    let (hd, stride, n) = (64, 128, 3 * KEY_CHUNK + 40);
    let c = Cache::new(n, stride);
    for range in [
        (0, n),
        (KEY_CHUNK - 3, 2 * KEY_CHUNK + 1),
        (7, KEY_CHUNK + 1),
    ] {
        matches_the_f64_reference(&c, hd, stride, range, 2e-5);
    }
}

/// Chunks computed apart (in any order, in separate calls, with the queries of a verify block
/// or alone) and merged in order give each query the bits `attend_many` gives it: the
/// backend's split by key chunk changes nothing.
#[test]
fn chunks_computed_apart_and_merged_in_order_give_attend_many_bits() {
    for hd in [64usize, 128, 32] {
        let stride = 2 * hd;
        let n = 2 * KEY_CHUNK + 90;
        let c = Cache::new(n, stride);
        let rs = ranges(12, (0, n - 12), true)
            .into_iter()
            .chain([(KEY_CHUNK - 1, KEY_CHUNK + 1), (3, 9)])
            .collect::<Vec<_>>();
        let qs = query_values(rs.len(), hd, 0.21);
        for isa in isas() {
            for half in [false, true] {
                let all = c.slice(half, stride, hd, (0, n));
                let mut want = vec![vec![f32::NAN; hd]; rs.len()];
                let mut queries = queries(&qs, &mut want, &rs);
                attend_many(isa, all, &mut queries, 0.2, &mut Scratch::default());
                drop(queries);

                let parts: Vec<Part<'_>> = qs
                    .iter()
                    .zip(&rs)
                    .map(|(q, &(start, end))| Part { q, start, end })
                    .collect();
                let chunks = n.div_ceil(KEY_CHUNK);
                let mut sums = vec![vec![f32::NAN; rs.len() * hd]; chunks];
                let mut stats = vec![vec![ChunkStats::default(); rs.len()]; chunks];
                let mut scratch = Scratch::default();
                for ch in (0..chunks).rev() {
                    let (c0, c1) = (ch * KEY_CHUNK, n.min((ch + 1) * KEY_CHUNK));
                    let window = KvSlice {
                        start: c0,
                        end: c1,
                        ..all
                    };
                    let cut: Vec<Part<'_>> = parts
                        .iter()
                        .map(|p| Part {
                            start: p.start.clamp(c0, c1),
                            end: p.end.clamp(c0, c1),
                            ..*p
                        })
                        .collect();
                    attend_chunk(
                        isa,
                        window,
                        &cut,
                        0.2,
                        &mut scratch,
                        &mut sums[ch],
                        &mut stats[ch],
                    );
                }
                for (i, &(start, end)) in rs.iter().enumerate() {
                    let mut out = vec![f32::NAN; hd];
                    let mut run = Running::default();
                    for ch in 0..chunks {
                        if start.max(ch * KEY_CHUNK) < end.min((ch + 1) * KEY_CHUNK) {
                            run.add(stats[ch][i], &sums[ch][i * hd..(i + 1) * hd], &mut out);
                        }
                    }
                    run.finish(&mut out);
                    assert_eq!(
                        bits(&out),
                        bits(&want[i]),
                        "{isa} hd {hd} f16 {half} query {i} {:?}",
                        rs[i]
                    );
                }
            }
        }
    }
}
