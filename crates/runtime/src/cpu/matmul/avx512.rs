//! AVX-512F matmul kernels (16 lanes), bit-identical to `portable::matmul::<16>`.
//!
//! Same structure as the AVX2 kernels: a 32-value group decodes into two 16-lane vectors,
//! one accumulator per (x row, weight row), groups walked in order.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

use crate::dtype::DType;
use crate::quant::{q4k_group_scale_min, q6k_group_scale};

/// Decodes group `g` of a row into two vectors holding values 0..16 and 16..32.
trait Decode {
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2];
}

#[inline(always)]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[inline(always)]
unsafe fn load16(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

#[inline(always)]
unsafe fn i8_to_f32(q: __m128i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))
}

#[inline(always)]
unsafe fn low_nibbles(q: __m128i) -> __m128i {
    _mm_and_si128(q, _mm_set1_epi8(0x0F))
}

#[inline(always)]
unsafe fn high_nibbles(q: __m128i) -> __m128i {
    _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F))
}

/// The 16 values a nibble can decode to, `fma(i, d, m)` for `i` in 0..16; a nibble row then
/// decodes with one permute per 16 values (the permute reads only the low 4 index bits).
#[inline(always)]
unsafe fn nibble_table(d: f32, m: f32) -> __m512 {
    let iota = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m))
}

/// Values 0..16 (low nibbles) and 16..32 (high nibbles) of 16 packed bytes, via `table`.
#[inline(always)]
unsafe fn nibbles_via(table: __m512, q: *const u8) -> [__m512; 2] {
    let lo = _mm512_cvtepu8_epi32(load16(q));
    let hi = _mm512_srli_epi32(lo, 4);
    [
        _mm512_permutexvar_ps(lo, table),
        _mm512_permutexvar_ps(hi, table),
    ]
}

/// d and m of a block header (two consecutive f16 values).
#[inline(always)]
unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

struct Q4_0;
impl Decode for Q4_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let b = row.add(g * 18);
        let d = f16_scalar(b);
        // (q - 8) · d for q in 0..16, exactly as the scalar decoder rounds it.
        let iota = _mm512_setr_ps(
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        );
        nibbles_via(_mm512_mul_ps(iota, _mm512_set1_ps(d)), b.add(2))
    }
}

struct Q4_1;
impl Decode for Q4_1 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let b = row.add(g * 20);
        let (d, m) = f16_pair(b);
        nibbles_via(nibble_table(d, m), b.add(4))
    }
}

struct Q8_0;
impl Decode for Q8_0 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let b = row.add(g * 34);
        let d = _mm512_set1_ps(f16_scalar(b));
        [
            _mm512_mul_ps(i8_to_f32(load16(b.add(2))), d),
            _mm512_mul_ps(i8_to_f32(load16(b.add(18))), d),
        ]
    }
}

struct F32;
impl Decode for F32 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let p = row.add(g * 128) as *const f32;
        [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
    }
}

struct F16;
impl Decode for F16 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let p = row.add(g * 64);
        [
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _mm512_cvtph_ps(_mm256_loadu_si256(p.add(32) as *const __m256i)),
        ]
    }
}

struct BF16;
impl Decode for BF16 {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let p = row.add(g * 64);
        let cvt = |o: usize| {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.add(o) as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32(h, 16))
        };
        [cvt(0), cvt(32)]
    }
}

struct Q4K;
impl Decode for Q4K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let blk = std::slice::from_raw_parts(row.add((g / 8) * 144), 144);
        let (scale, neg_min) = q4k_group_scale_min(blk, g % 8);
        let sub = g % 8;
        let qs = row.add((g / 8) * 144 + 16 + (sub / 2) * 32);
        let table = nibble_table(scale, neg_min);
        let codes = |o: usize| {
            let q = _mm512_cvtepu8_epi32(load16(qs.add(o)));
            let q = if sub.is_multiple_of(2) {
                q
            } else {
                _mm512_srli_epi32(q, 4)
            };
            _mm512_permutexvar_ps(q, table)
        };
        [codes(0), codes(16)]
    }
}

struct Q6K;
impl Decode for Q6K {
    #[inline(always)]
    unsafe fn decode(row: *const u8, g: usize) -> [__m512; 2] {
        let blk = std::slice::from_raw_parts(row.add((g / 8) * 210), 210);
        let (s0, s1) = q6k_group_scale(blk, g % 8);
        let sub = g % 8;
        let half = sub / 4;
        let quarter = sub % 4;
        let ql = row.add((g / 8) * 210 + 64 * half + if quarter % 2 == 1 { 32 } else { 0 });
        let qh = row.add((g / 8) * 210 + 128 + 32 * half);
        let codes = |o: usize| {
            let l = load16(ql.add(o));
            let l = if quarter >= 2 {
                high_nibbles(l)
            } else {
                low_nibbles(l)
            };
            let h = _mm_srl_epi16(load16(qh.add(o)), _mm_cvtsi32_si128(2 * quarter as i32));
            let h = _mm_and_si128(h, _mm_set1_epi8(3));
            _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(h, 4)), _mm_set1_epi8(32))
        };
        [
            _mm512_mul_ps(i8_to_f32(codes(0)), _mm512_set1_ps(s0)),
            _mm512_mul_ps(i8_to_f32(codes(16)), _mm512_set1_ps(s1)),
        ]
    }
}

/// Pairwise lane reduction matching `portable::reduce_lanes::<16>`.
#[inline(always)]
unsafe fn reduce(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    let v = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile<D: Decode, const MR: usize, const NR: usize>(
    x: *const f32,
    x_stride: usize,
    w: *const u8,
    row_bytes: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
    ahead: &[u8],
) {
    // The bytes of a later tile are prefetched a few lines per group, spread over this tile
    // (a burst of prefetches at the start of a tile stalls on the full miss buffers).
    let per_group = ahead.len().div_ceil(64 * k_groups.max(1));
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    for g in 0..k_groups {
        for l in 0..per_group {
            let off = 64 * (g * per_group + l);
            if off < ahead.len() {
                _mm_prefetch::<_MM_HINT_T0>(ahead.as_ptr().add(off) as *const i8);
            }
        }
        // The group's weights stay in registers while each x row's pair is loaded once:
        // MR·NR accumulators, 2·NR weight vectors and 2 x vectors fit the 32 registers.
        let mut wv = [[_mm512_setzero_ps(); 2]; NR];
        for (n, wn) in wv.iter_mut().enumerate() {
            *wn = D::decode(w.add(n * row_bytes), g);
        }
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let p = x.add(i * x_stride + g * 32);
            let xv = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
            for (a, wn) in acc_i.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(wn[0], xv[0], *a);
                *a = _mm512_fmadd_ps(wn[1], xv[1], *a);
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (n, a) in acc_i.iter().enumerate() {
            *out.add(i * out_stride + n) = reduce(*a);
        }
    }
}

/// Weights streamed once for up to [`STREAM_MAX_M`] x rows: every decoded group feeds all
/// rows' accumulators straight from registers (`NR` weight rows per tile: 4 for up to four x
/// rows, 2 for five to eight, so accumulators, x and weight vectors fit the 32 registers).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn run_streaming<D: Decode>(
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    if m <= 4 {
        stream_rows::<D, 4>(x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride)
    } else {
        stream_rows::<D, 2>(x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride)
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn stream_rows<D: Decode, const NR: usize>(
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    /// How many tiles ahead the weights are prefetched.
    const PREFETCH_TILES: usize = 2;
    // Eight x rows per pass with 2-row tiles, four with 4-row tiles.
    let max_mr = 16 / NR;
    let mut j = 0;
    while j < n {
        let full = n - j >= NR;
        let wj = w.add(j * row_bytes);
        let (a, b) = (
            (j + PREFETCH_TILES * NR).min(n),
            (j + (PREFETCH_TILES + 1) * NR).min(n),
        );
        let ahead = std::slice::from_raw_parts(w.add(a * row_bytes), (b - a) * row_bytes);
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(max_mr);
            let xi = x.add(i * x_stride);
            let oi = out.add(i * out_stride + j);
            macro_rules! go {
                ($($mr:literal),*) => {
                    match (mr, full) {
                        $(
                            ($mr, true) => tile::<D, $mr, NR>(
                                xi, x_stride, wj, row_bytes, k_groups, oi, out_stride, ahead,
                            ),
                            ($mr, false) => tile::<D, $mr, 1>(
                                xi, x_stride, wj, row_bytes, k_groups, oi, out_stride, ahead,
                            ),
                        )*
                        _ => unreachable!("x row counts are covered"),
                    }
                };
            }
            go!(1, 2, 3, 4, 5, 6, 7, 8);
            i += mr;
        }
        j += if full { NR } else { 1 };
    }
}

thread_local! {
    /// Decoded weight rows of the current tile (reused, grows to the largest K seen).
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The x rows, copied to 64-byte-aligned rows.
    static XROWS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One tile of `MR` x rows against `NR` decoded weight rows (`panel`, row stride `k`).
/// Same per-output order as the streaming kernel: 16-lane chunks of k in order.
#[inline(always)]
unsafe fn panel_tile<const MR: usize, const NR: usize>(
    x: *const f32,
    x_stride: usize,
    panel: *const f32,
    k: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); NR]; MR];
    for c in 0..k / 16 {
        let mut wv = [_mm512_setzero_ps(); NR];
        for (r, w) in wv.iter_mut().enumerate() {
            *w = _mm512_loadu_ps(panel.add(r * k + 16 * c));
        }
        for (i, acc_i) in acc.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.add(i * x_stride + 16 * c));
            for (a, w) in acc_i.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(*w, xv, *a);
            }
        }
    }
    for (i, acc_i) in acc.iter().enumerate() {
        for (r, a) in acc_i.iter().enumerate() {
            *out.add(i * out_stride + r) = reduce(*a);
        }
    }
}

/// Several x rows: each weight tile is decoded once into a panel, then every x row runs
/// against it (the decode cost is shared by all rows).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn run_panel<D: Decode>(
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    // 12 accumulators + 3 weight vectors + 1 x vector: fits the 16 registers the allocator
    // prefers (wider tiles spill an accumulator and run slower).
    const NR: usize = 3;
    const MR: usize = 4;
    let k = k_groups * 32;
    // The panel is taken out of the closure: code inside a closure would not get this
    // function's target features.
    let panel = PANEL.with(|cell| {
        let mut buf = cell.borrow_mut();
        // 16 spare floats so the panel can start on a 64-byte boundary (no split loads).
        if buf.len() < NR * k + 16 {
            buf.resize(NR * k + 16, 0.0);
        }
        let p = buf.as_mut_ptr();
        p.add(p.align_offset(64))
    });
    // Aligned copies of the x rows: unaligned 64-byte loads split across cache lines.
    let (x, x_stride) = XROWS.with(|cell| {
        let mut buf = cell.borrow_mut();
        if buf.len() < m * k + 16 {
            buf.resize(m * k + 16, 0.0);
        }
        let p = buf.as_mut_ptr();
        let p = p.add(p.align_offset(64));
        for i in 0..m {
            std::ptr::copy_nonoverlapping(x.add(i * x_stride), p.add(i * k), k);
        }
        (p as *const f32, k)
    });
    let mut j = 0;
    while j < n {
        let nr = (n - j).min(NR);
        // The tile after next is prefetched a few lines per decoded group (see `tile`).
        let (a, b) = ((j + 2 * NR).min(n), (j + 3 * NR).min(n));
        let ahead = w.add(a * row_bytes);
        let ahead_len = (b - a) * row_bytes;
        let per_group = ahead_len.div_ceil(64 * (nr * k_groups).max(1));
        let mut line = 0;
        for r in 0..nr {
            let row = w.add((j + r) * row_bytes);
            for g in 0..k_groups {
                for _ in 0..per_group {
                    if 64 * line < ahead_len {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(64 * line) as *const i8);
                    }
                    line += 1;
                }
                let v = D::decode(row, g);
                _mm512_storeu_ps(panel.add(r * k + 32 * g), v[0]);
                _mm512_storeu_ps(panel.add(r * k + 32 * g + 16), v[1]);
            }
        }
        let mut i = 0;
        while i < m {
            let mr = (m - i).min(MR);
            let (xi, oi) = (x.add(i * x_stride), out.add(i * out_stride + j));
            macro_rules! go {
                ($($a:literal $b:literal),*) => {
                    match (mr, nr) {
                        $(($a, $b) => panel_tile::<$a, $b>(xi, x_stride, panel, k, oi, out_stride),)*
                        _ => unreachable!("tile shapes are covered"),
                    }
                };
            }
            go!(4 3, 3 3, 2 3, 1 3, 4 2, 3 2, 2 2, 1 2, 4 1, 3 1, 2 1, 1 1);
            i += mr;
        }
        j += nr;
    }
}

/// Most x rows that stream the weights; more decode each weight tile once into a panel.
const STREAM_MAX_M: usize = 8;

/// Streams weights for up to [`STREAM_MAX_M`] x rows; decodes once into panels for more.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn run<D: Decode>(
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    if m <= STREAM_MAX_M {
        run_streaming::<D>(x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride)
    } else {
        run_panel::<D>(x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride)
    }
}

/// See `portable::matmul`; same contract, AVX-512F instructions.
///
/// # Safety
/// As `portable::matmul`, and the CPU must support AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul(
    dtype: DType,
    x: *const f32,
    x_stride: usize,
    m: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    k_groups: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let a = (x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride);
    match dtype {
        DType::F32 => run::<F32>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::F16 => run::<F16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::BF16 => run::<BF16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_0 => run::<Q4_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4_1 => run::<Q4_1>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q8_0 => run::<Q8_0>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q4K => run::<Q4K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
        DType::Q6K => run::<Q6K>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8),
    }
}
