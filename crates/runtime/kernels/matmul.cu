// dflash-rs CUDA kernels: matrix products with weights in their stored format (on CUDA cores
// for every row; prompt rows may take the tensor-core kernels of matmul_tc.cu), and
// dequantization (embedding rows, and whole weights for the optional cuBLAS prefill path).
#include "common.cu"

// ---- out = x · Wᵀ ------------------------------------------------------------------------
//
// x: [M, K] f32 row-major, W: N rows of `row_bytes` bytes (K values as DT), out: [M, N].
//
// Work split. A warp owns R weight rows (R = 1, 2 or 4) and MT rows of x (MT = 1..16); a
// block is MM_WARPS warps. Lane l = 4*j + s takes quarter s (8 values) of group j of every
// run of 8 consecutive 32-value groups: groups j, j + 8, j + 16, ... of the row. So one warp
// step reads 8 whole groups of a row (160 contiguous bytes for Q4_1), the lanes' loads
// coalesce, and every lane is busy whenever K >= 256.
//
// Summation order (what makes a row's result independent of M): for output (m, n), lane l
// accumulates, for its groups in increasing order, the 8 products of its quarter in a fixed
// order (`MmPart::fma8`) with fma into one f32; then the 32 lane sums are added by the xor
// butterfly of `warp_sum`. That order depends on K and the format only: not on M, MT, R, the
// block or the grid. So decode (M = 1), verify blocks (M = 2..16, run as one tile or as two of
// 8) and prefill (M > 16, tiles of 16 rows of x) give bit-identical results for the same row.
//
// Loads. The weight bytes of P consecutive steps (P = 4 for MT <= 2, 2 for MT = 4, else 1)
// are loaded before their products, with the widest load the format's alignment allows (16
// bytes for f16/bf16 and f32, 8 for the Q4_K nibbles and packed Q8_0 codes, 4 for packed Q4_0
// and Q4_1 codes; see "packed layouts" below); with two or more rows of
// x, the x values of those steps are requested with them, so a warp waits on memory once per
// P steps. x is read through the read-only path (it is small and shared by every warp).
// (Requesting the first weights before the wait for the previous kernel, into registers or as
// L2 prefetches, and keeping two batches in flight were measured on the H200 and dropped: no
// gain for the default model's shapes, 2-10% slower for the Qwen3-4B shape.)
//
// Epilogues: store; add into `out` (out = out + s: the residual add, bit-identical to a
// separate `add`); SwiGLU (two weights per output: out = silu(x·gᵀ) * (x·uᵀ), bit-identical to
// a separate `silu_mul`); RoPE + KV write (the q, k and v products of an attention layer as
// segments 0, 1, 2: q and k rotated at each token's position and stored, k and v also written
// to the token's KV slot; bit-identical to storing them and running `rope_kv_f32`, ops.cu).
// The rope epilogue gives each warp the two rows of one rotary pair (R = 2: rows ia, ib of
// `rope_offsets` in head h), so the pair is rotated where its sums are; it needs the rotary
// dimensions to cover the head (2 * half == head_dim).
//
// Segments. One launch can run up to MM_SEGS products of the same x and format with
// different weights and outputs (q/k/v, gate/up): blocks are handed out segment after
// segment (`MmSeg::block0`), so the products share one launch and fill the GPU together.

// MM_WARPS (warps per block), MM_SEGS (products per launch) and the epilogues EPI_STORE,
// EPI_ADD, EPI_SWIGLU and EPI_ROPE are defined ahead of this file by the host, from its own
// constants (cuda/compile.rs, `shared_constants`), as are the launch constants of the other
// kernel files.

struct MmSeg {
    u64 w;         // weight rows (gate rows for SwiGLU)
    u64 w2;        // up rows for SwiGLU, else 0
    u64 out;       // [M, n] f32
    i64 row_bytes; // bytes per weight row
    int n;         // weight rows (outputs per row of x)
    int block0;    // first block (blockIdx.x) of this segment
};

struct MmParams {
    MmSeg seg[MM_SEGS];
    u64 x;      // [M, K] f32 (int8 kernels: the codes of x's int8 copy, mmq_* by rows: [M * DF_X_TERMS, K]; mmqt_* tiled)
    u64 xs;     // int8 kernels: the copy's float2 (d, ds) per block of x (q8_at in common.cu); else 0
    int nseg;
    int k;
    int m;
    int pad;
    // EPI_ROPE only (segments q, k, v):
    u64 meta;      // [M][4] u32 token metadata of the rows of x
    u64 inv_freq;  // [half]
    u64 kv_rows;   // RowDesc per KV row
    int layer;
    int head_dim;
    int half;
    int style;
    int kv_dim;
    int kv_half;   // the cache holds f16 (kv_put)
    // mmqs (SwiGLU that also writes the int8 copy of its output, q8_terms, by rows): codes
    // [M * DF_X_TERMS, n] and the (d, ds) pairs [M * DF_X_TERMS, n / 32]; else 0.
    u64 oc;
    u64 os;
    // Weights of the launches after this one, requested into L2 before the wait (common.cu).
    L2Ahead ahead;
};

// The segment of this block (blocks are handed out segment after segment), for every
// product kernel.
__device__ __forceinline__ int mm_segment(const MmParams& p) {
    int si = 0;
#pragma unroll
    for (int k = 1; k < MM_SEGS; k++) {
        if (k < p.nseg && (int)blockIdx.x >= p.seg[k].block0) si = k;
    }
    return si;
}

// The 8 values of quarter s of group g: weights in w[0..8], matching x at offsets
// 32g + xa .. +4 and 32g + xb .. +4.
template <int DT>
struct MmPart;

template <>
struct MmPart<DT_F32> {
    float4 a, b;
    static __device__ __forceinline__ int xa(int s) { return 8 * s; }
    static __device__ __forceinline__ int xb(int s) { return 8 * s + 4; }
    __device__ __forceinline__ void load(const u8* row, int g, int s, int) {
        const float4* p = (const float4*)(row + (size_t)g * 128 + 32 * s);
        a = __ldg(p);
        b = __ldg(p + 1);
    }
    __device__ __forceinline__ void decode(float* w) const {
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
    }
};

template <bool BF>
struct MmPartHalf {
    uint4 v;
    static __device__ __forceinline__ int xa(int s) { return 8 * s; }
    static __device__ __forceinline__ int xb(int s) { return 8 * s + 4; }
    __device__ __forceinline__ void load(const u8* row, int g, int s, int) {
        v = __ldg((const uint4*)(row + (size_t)g * 64 + 16 * s));
    }
    __device__ __forceinline__ void decode(float* w) const {
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u16 lo = (u16)(words[k] & 0xffffu);
            const u16 hi = (u16)(words[k] >> 16);
            w[2 * k] = BF ? bf16_to_f32(lo) : f16_to_f32(lo);
            w[2 * k + 1] = BF ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
};
template <>
struct MmPart<DT_F16> : MmPartHalf<false> {};
template <>
struct MmPart<DT_BF16> : MmPartHalf<true> {};

// Q4_0 (stored: 18 bytes, f16 d and 16 nibble bytes): quarter s holds code bytes 4s..4s+4,
// whose low nibbles are values 4s.. and high nibbles values 16 + 4s... The GPU keeps Q4_0,
// Q4_1 and Q8_0 in their packed layout, whose loaders (MmPart<DT + DT_PACKED>, below) fill
// these decoders.
// w = codes · scale, for the formats whose values are that (Q4_0, Q8_0).
template <class P>
__device__ __forceinline__ void decode_scaled(const P& part, float* w) {
    part.codes(w);
    const float df = part.scale();
#pragma unroll
    for (int k = 0; k < 8; k++) w[k] = __fmul_rn(w[k], df);
}

template <>
struct MmPart<DT_Q4_0> {
    u32 q;
    u16 d;
    static __device__ __forceinline__ int xa(int s) { return 4 * s; }
    static __device__ __forceinline__ int xb(int s) { return 16 + 4 * s; }
    // The 8 integer codes q - 8 (exact floats) and the scale: value = code * scale.
    __device__ __forceinline__ void codes(float* c) const {
        const u32 lo = DF_LO_NIBBLES(q), hi = DF_HI_NIBBLES(q);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            c[k] = byte_to_f32<8>(lo, k);
            c[4 + k] = byte_to_f32<8>(hi, k);
        }
    }
    __device__ __forceinline__ float scale() const { return f16_to_f32(d); }
    __device__ __forceinline__ void decode(float* w) const { decode_scaled(*this, w); }
};

// Q4_1 (stored: 20 bytes, f16 d, f16 m and 16 nibble bytes): as Q4_0, value fma(q, d, m).
template <>
struct MmPart<DT_Q4_1> {
    u32 q;
    u32 dm;
    static __device__ __forceinline__ int xa(int s) { return 4 * s; }
    static __device__ __forceinline__ int xb(int s) { return 16 + 4 * s; }
    // The 8 codes q (exact floats), the scale d and the minimum m: value = fma(q, d, m).
    __device__ __forceinline__ void codes(float* c) const {
        const u32 lo = DF_LO_NIBBLES(q), hi = DF_HI_NIBBLES(q);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            c[k] = byte_to_f32<0>(lo, k);
            c[4 + k] = byte_to_f32<0>(hi, k);
        }
    }
    __device__ __forceinline__ float scale() const { return f16_to_f32((u16)(dm & 0xffffu)); }
    __device__ __forceinline__ float minimum() const { return f16_to_f32((u16)(dm >> 16)); }
    __device__ __forceinline__ void decode(float* w) const {
        codes(w);
        const float d = scale(), m = minimum();
#pragma unroll
        for (int k = 0; k < 8; k++) w[k] = __fmaf_rn(w[k], d, m);
    }
};

// Q8_0 (stored: 34 bytes, f16 d and 32 signed bytes): quarter s = code bytes 8s..8s+8.
template <>
struct MmPart<DT_Q8_0> {
    u32 lo, hi;
    u16 d;
    static __device__ __forceinline__ int xa(int s) { return 8 * s; }
    static __device__ __forceinline__ int xb(int s) { return 8 * s + 4; }
    // The 8 signed codes (exact floats) and the scale: value = code * scale.
    __device__ __forceinline__ void codes(float* c) const {
        // A signed byte b xor 0x80 is the unsigned byte b + 128.
        const u32 ulo = lo ^ 0x80808080u, uhi = hi ^ 0x80808080u;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            c[k] = byte_to_f32<128>(ulo, k);
            c[4 + k] = byte_to_f32<128>(uhi, k);
        }
    }
    __device__ __forceinline__ float scale() const { return f16_to_f32(d); }
    __device__ __forceinline__ void decode(float* w) const { decode_scaled(*this, w); }
};

// Byte i (0..12) of three little-endian words, without an indexed (local-memory) array.
__device__ __forceinline__ u32 byte_of(u32 w0, u32 w1, u32 w2, int i) {
    const u32 w = i < 4 ? w0 : (i < 8 ? w1 : w2);
    return (w >> (8 * (i & 3))) & 0xffu;
}

// Q4_K (144-byte super-blocks of 8 groups; 16-byte aligned). Group sub = g % 8 takes the
// low (even sub) or high (odd sub) nibbles of bytes 32*(sub/2) .. of the 128 nibble bytes,
// scale and min from the 12 packed 6-bit codes. Quarter s: 8 nibble bytes at 8s (8-byte load).
template <>
struct MmPart<DT_Q4K> {
    uint2 q;
    u32 dd;
    u32 sc, mn;
    int shift;
    static __device__ __forceinline__ int xa(int s) { return 8 * s; }
    static __device__ __forceinline__ int xb(int s) { return 8 * s + 4; }
    __device__ __forceinline__ void load(const u8* row, int g, int s, int) {
        const u8* blk = row + (size_t)(g >> 3) * DT_Q4K_BYTES;
        const int sub = g & 7;
        dd = __ldg((const unsigned int*)blk);
        const unsigned int* sw = (const unsigned int*)(blk + 4);
        const u32 s0 = __ldg(sw), s1 = __ldg(sw + 1), s2 = __ldg(sw + 2);
        if (sub < 4) {
            sc = byte_of(s0, s1, s2, sub) & 63u;
            mn = byte_of(s0, s1, s2, sub + 4) & 63u;
        } else {
            sc = (byte_of(s0, s1, s2, sub + 4) & 0x0fu) | ((byte_of(s0, s1, s2, sub - 4) >> 6) << 4);
            mn = (byte_of(s0, s1, s2, sub + 4) >> 4) | ((byte_of(s0, s1, s2, sub) >> 6) << 4);
        }
        shift = (sub & 1) * 4;
        q = __ldg((const uint2*)(blk + 16 + (sub >> 1) * 32 + 8 * s));
    }
    __device__ __forceinline__ void decode(float* w) const {
        const float d = f16_to_f32((u16)(dd & 0xffffu));
        const float dmin = f16_to_f32((u16)(dd >> 16));
        const float scale = __fmul_rn(d, (float)sc);
        const float neg_min = -__fmul_rn(dmin, (float)mn);
        const u32 nx = DF_LO_NIBBLES(q.x >> shift), ny = DF_LO_NIBBLES(q.y >> shift);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            w[k] = __fmaf_rn(byte_to_f32<0>(nx, k), scale, neg_min);
            w[4 + k] = __fmaf_rn(byte_to_f32<0>(ny, k), scale, neg_min);
        }
    }
};

// Q6_K (210-byte super-blocks; 2-byte aligned): see decode_q6k in common.cu. Quarter s holds
// values l = 8s .. 8s+8 of the group: low nibbles from ql, high pairs from qh, scale s0 for
// l < 16 and s1 above.
template <>
struct MmPart<DT_Q6K> {
    u32 ql0, ql1, qh0, qh1;
    u16 d;
    signed char sc;
    int lshift, hshift;
    static __device__ __forceinline__ int xa(int s) { return 8 * s; }
    static __device__ __forceinline__ int xb(int s) { return 8 * s + 4; }
    __device__ __forceinline__ void load(const u8* row, int g, int s, int) {
        const u8* blk = row + (size_t)(g >> 3) * DT_Q6K_BYTES;
        const int sub = g & 7;
        const int half = sub >> 2;
        const int quarter = sub & 3;
        d = __ldg((const unsigned short*)(blk + 208));
        const int slot = 4 * half + quarter;
        const u16 sc2 = __ldg((const unsigned short*)(blk + 192 + 2 * slot));
        sc = (signed char)(s < 2 ? (sc2 & 0xff) : (sc2 >> 8));
        const unsigned short* ql = (const unsigned short*)(blk + 64 * half + 32 * (quarter & 1) + 8 * s);
        const unsigned short* qh = (const unsigned short*)(blk + 128 + 32 * half + 8 * s);
        ql0 = (u32)__ldg(ql) | ((u32)__ldg(ql + 1) << 16);
        ql1 = (u32)__ldg(ql + 2) | ((u32)__ldg(ql + 3) << 16);
        qh0 = (u32)__ldg(qh) | ((u32)__ldg(qh + 1) << 16);
        qh1 = (u32)__ldg(qh + 2) | ((u32)__ldg(qh + 3) << 16);
        lshift = (quarter >> 1) * 4;
        hshift = 2 * quarter;
    }
    __device__ __forceinline__ void decode(float* w) const {
        const float scale = __fmul_rn(f16_to_f32(d), (float)sc);
        // Codes (low | high << 4) of values 0..4 and 4..8, one per byte.
        const u32 c0 = DF_LO_NIBBLES(ql0 >> lshift) | (((qh0 >> hshift) & 0x03030303u) << 4);
        const u32 c1 = DF_LO_NIBBLES(ql1 >> lshift) | (((qh1 >> hshift) & 0x03030303u) << 4);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            w[k] = __fmul_rn(byte_to_f32<32>(c0, k), scale);
            w[4 + k] = __fmul_rn(byte_to_f32<32>(c1, k), scale);
        }
    }
};

// ---- packed layouts ----------------------------------------------------------------------
//
// Every weight in Q4_0, Q4_1 or Q8_0 (the formats with int8 kernels) is stored on the GPU
// repacked at upload (cuda/pack.rs): each row is its G groups' code bytes (16 per group for
// Q4_0/Q4_1, 32 for Q8_0, as in the stored blocks), then the groups' scales (f16 d; Q4_1: d and
// m), the row padded to 16 bytes. Code blocks are 16-byte aligned, so the int8 kernel
// (mmq_warp) reads a group's codes in one or two 16-byte loads, and a quarter of a group is one
// 4- or 8-byte load where the stored 18/34-byte blocks allow only 2-byte ones. Format numbers
// DT + DT_PACKED name these layouts; their quarter loaders below feed the f32-activation
// products, the tensor-core prefill kernels and the dequantizer with the same values as the
// stored layout (same decoders), so the products' bits do not depend on the layout.
template <>
struct MmPart<DT_Q4_0 + DT_PACKED> : MmPart<DT_Q4_0> {
    __device__ __forceinline__ void load(const u8* row, int g, int s, int groups) {
        q = __ldg((const unsigned int*)(row + (size_t)g * 16 + 4 * s));
        d = __ldg((const unsigned short*)(row + (size_t)groups * 16 + 2 * g));
    }
};
template <>
struct MmPart<DT_Q4_1 + DT_PACKED> : MmPart<DT_Q4_1> {
    __device__ __forceinline__ void load(const u8* row, int g, int s, int groups) {
        q = __ldg((const unsigned int*)(row + (size_t)g * 16 + 4 * s));
        dm = __ldg((const unsigned int*)(row + (size_t)groups * 16 + 4 * g));
    }
};
template <>
struct MmPart<DT_Q8_0 + DT_PACKED> : MmPart<DT_Q8_0> {
    __device__ __forceinline__ void load(const u8* row, int g, int s, int groups) {
        const uint2 v = __ldg((const uint2*)(row + (size_t)g * 32 + 8 * s));
        lo = v.x;
        hi = v.y;
        d = __ldg((const unsigned short*)(row + (size_t)groups * 32 + 2 * g));
    }
};

// acc += the 8 products of a quarter, in the fixed order (values xa..xa+4, then xb..xb+4).
__device__ __forceinline__ float fma8(const float* w, float4 a, float4 b, float acc) {
    acc = __fmaf_rn(w[0], a.x, acc);
    acc = __fmaf_rn(w[1], a.y, acc);
    acc = __fmaf_rn(w[2], a.z, acc);
    acc = __fmaf_rn(w[3], a.w, acc);
    acc = __fmaf_rn(w[4], b.x, acc);
    acc = __fmaf_rn(w[5], b.y, acc);
    acc = __fmaf_rn(w[6], b.z, acc);
    acc = __fmaf_rn(w[7], b.w, acc);
    return acc;
}

// Every row's x values at group g that quarter (xa, xb) multiplies (rows past ml re-read row 0).
template <int MT>
__device__ __forceinline__ void mm_load_x(const float* __restrict__ x, int K, int m0, int ml, int g, int xa, int xb,
                                          float4* xa4, float4* xb4) {
#pragma unroll
    for (int m = 0; m < MT; m++) {
        const float* xr = x + (size_t)(m0 + (m < ml ? m : 0)) * K + (size_t)g * GROUP;
        xa4[m] = __ldg((const float4*)(xr + xa));
        xb4[m] = __ldg((const float4*)(xr + xb));
    }
}

// silu(g) * u exactly as silu_mul_f32 (ops.cu) computes it.
__device__ __forceinline__ float swiglu(float g, float u) {
    const float e = (float)exp(-(double)g);
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), u);
}

// The store, add and SwiGLU epilogues of one output o from its sum s (SwiGLU: s of the gate
// row, u of the up row), for every product kernel.
template <int EPI>
__device__ __forceinline__ void mm_epilogue(float* o, float s, float u) {
    if (EPI == EPI_STORE) {
        *o = s;
    } else if (EPI == EPI_ADD) {
        *o = __fadd_rn(*o, s);
    } else {
        *o = swiglu(s, u);
    }
}

// Prompt (prefill) rows on tensor cores: mmtc_body, reusing MmPart, swiglu and mm_epilogue above.
#include "matmul_tc.cu"

// What lane m of a rope-epilogue warp needs for token m0 + m, found before the wait (the
// metadata, the KV row table and the frequencies are written by the host before the step):
// the pair's cos and sin at the token's position, and the token's KV slot for the segment
// (keys for k, values for v, none for q).
struct RopeLane {
    float c, s;
    u64 slot;  // kv_put's address of the slot's value 0 (0: q, no slot)
};

__device__ __forceinline__ RopeLane rope_lane(const MmParams& p, int seg, int pair, int token) {
    RopeLane rl = {1.0f, 0.0f, 0};
    const u32* meta = (const u32*)p.meta + 4 * token;
    const u32 at = meta[META_POS];
    if (seg < 2) rope_cs(pair, (float)at, (const float*)p.inv_freq, &rl.c, &rl.s);
    if (seg > 0) {
        const RowDesc rd = ((const RowDesc*)p.kv_rows)[meta[META_ROW]];
        rl.slot = kv_addr(rd.base, ((size_t)(2 * p.layer + (seg - 1)) * rd.cap + at) * p.kv_dim, p.kv_half);
    }
    return rl;
}

// The weight rows of outputs nr (W = 2: gate and up); rows past the end repeat the last (their
// results are not stored).
template <int R, int W>
__device__ __forceinline__ void mm_weight_rows(const MmSeg& sg, const int (&nr)[R], const u8* (&rows)[R][W]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int n = min(nr[r], sg.n - 1);
        rows[r][0] = (const u8*)sg.w + (size_t)n * sg.row_bytes;
        if (W == 2) rows[r][W - 1] = (const u8*)sg.w2 + (size_t)n * sg.row_bytes;
    }
}

// Every accumulator of a warp to zero.
template <int R, int W, int MT>
__device__ __forceinline__ void mm_zero(float (&acc)[R][W][MT]) {
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int v = 0; v < W; v++)
#pragma unroll
            for (int m = 0; m < MT; m++) acc[r][v][m] = 0.0f;
}

// The sum of row m's output from its T accumulators (T int8 rows a row of x: acc[T m + t]), each
// added over the lanes by the xor butterfly (warp_sum), then first + second.
template <int T, int N>
__device__ __forceinline__ float term_sum(const float (&acc)[N], int m) {
    float s = warp_sum(acc[T * m]);
    if (T == 2) s = __fadd_rn(s, warp_sum(acc[T * m + 1]));
    return s;
}

// The end of a warp's product: the lane sums of each output added by the xor butterfly
// (warp_sum; T = 2: per term, then first + second), then the epilogue, each output's in one
// lane, for the CUDA-core kernels of both activation types.
template <int MT, int R, int W, int EPI, int T = 1>
__device__ __forceinline__ void mm_finish(float (&acc)[R][W][MT * T], const MmSeg& sg, const int (&nr)[R],
                                          const MmParams& p, int m0, int seg, int ml, const RopeLane& rl) {
    const int lane = threadIdx.x & 31;
    float* out = (float*)sg.out;
    if (EPI == EPI_ROPE) {
        // Lane m takes token m's pair: the sums of every token are in every lane after the
        // butterflies; lane m keeps its own.
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const float sa = term_sum<T>(acc[0][0], m);
            const float sb = term_sum<T>(acc[R - 1][0], m);
            if (lane == m) {
                a = sa;
                b = sb;
            }
        }
        if (lane < ml) {
            float ra = a, rb = b;
            if (seg < 2) rope_apply(a, b, rl.c, rl.s, p.style, &ra, &rb);
            float* o = out + (size_t)(m0 + lane) * sg.n;
            o[nr[0]] = ra;
            o[nr[R - 1]] = rb;
            if (rl.slot) {
                kv_put(rl.slot, nr[0], ra, p.kv_half);
                kv_put(rl.slot, nr[R - 1], rb, p.kv_half);
            }
        }
        return;
    }
    // Every lane holds every sum after the butterflies (the same bits: a + b == b + a), so
    // the warp's outputs o = m * R + r are spread over its lanes, lane o % 32 taking output o:
    // the add epilogue's reads of out and SwiGLU's exponentials run side by side, not one
    // after another in lane 0. (A reduction that halves the values each lane holds at every
    // butterfly step, 31 shuffles for 32 outputs instead of 160, has the same bits but was
    // slower on the H200: its steps depend on each other, the 32 butterflies do not.) The
    // weight rows of a warp are nr[0] + r here.
    constexpr int NO = R * MT;
    constexpr int PL = (NO + 31) / 32;
    float mine[PL][W];
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int o = m * R + r;
#pragma unroll
            for (int v = 0; v < W; v++) {
                const float sum = term_sum<T>(acc[r][v], m);
                if (lane == o % 32) mine[o / 32][v] = sum;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < PL; i++) {
        const int o = 32 * i + lane;
        const int m = o / R;
        const int n = nr[0] + (o - m * R);
        if (o < NO && n < sg.n && m < ml) {
            mm_epilogue<EPI>(out + (size_t)(m0 + m) * sg.n + n, mine[i][0], mine[i][W - 1]);
        }
    }
}


// One warp: output rows nr[0..R] of segment `seg` (each from W weight rows, W = 2 for
// SwiGLU) for MT rows of x from m0; `pair` is the rotary pair of the rope epilogue.
template <int DT, int MT, int R, int EPI>
__device__ __forceinline__ void mm_warp(const MmSeg& sg, const int (&nr)[R], const MmParams& p, int m0, int seg,
                                        int pair) {
    constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;
    const float* __restrict__ x = (const float*)p.x;
    const int K = p.k;
    const int lane = threadIdx.x & 31;
    const int j = lane >> 2;
    const int s = lane & 3;
    const int groups = K / GROUP;
    const int ml = min(MT, p.m - m0);

    const u8* rows[R][W];
    mm_weight_rows<R, W>(sg, nr, rows);

    // P steps' weight bytes are loaded before any of their products (P more loads in flight
    // per lane); the products then run in step order, so the sum is the same for every P.
    // The rope epilogue's per-token lookups run before the wait for the previous kernel.
    constexpr int P = MT <= 2 ? 4 : (MT <= 4 ? 2 : 1);
    constexpr bool XH = MT >= 2;
    RopeLane rl = {1.0f, 0.0f, 0};
    if (EPI == EPI_ROPE && lane < ml) rl = rope_lane(p, seg, pair, m0 + lane);
    df_kernel_begin();
    float acc[R][W][MT];
    mm_zero(acc);
    const int xa = MmPart<DT>::xa(s);
    const int xb = MmPart<DT>::xb(s);
    for (int g0 = j; g0 < groups; g0 += 8 * P) {
        MmPart<DT> part[P][R][W];
        constexpr int XP = XH ? P : 1;
        float4 xa4[XP][MT], xb4[XP][MT];
#pragma unroll
        for (int q = 0; q < P; q++) {
            const int g = g0 + 8 * q;
            if (g < groups) {
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int v = 0; v < W; v++) part[q][r][v].load(rows[r][v], g, s, groups);
                if (XH) mm_load_x<MT>(x, K, m0, ml, g, xa, xb, xa4[q % XP], xb4[q % XP]);
            }
        }
#pragma unroll
        for (int q = 0; q < P; q++) {
            const int g = g0 + 8 * q;
            if (g < groups) {
                float w[R][W][8];
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int v = 0; v < W; v++) part[q][r][v].decode(w[r][v]);
                if (!XH) mm_load_x<MT>(x, K, m0, ml, g, xa, xb, xa4[0], xb4[0]);
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    if (m < ml) {
#pragma unroll
                        for (int r = 0; r < R; r++)
#pragma unroll
                            for (int v = 0; v < W; v++)
                                acc[r][v][m] = fma8(w[r][v], xa4[q % XP][m], xb4[q % XP][m], acc[r][v][m]);
                    }
                }
            }
        }
    }

    mm_finish<MT, R, W, EPI>(acc, sg, nr, p, m0, seg, ml, rl);
}

#if DF_MM_INT8
// ---- int8 activations (dp4a) -------------------------------------------------------------
//
// The target projections in Q4_0, Q4_1 and Q8_0 that take int8 activations (Int8Policy,
// cuda/device.rs) are stored packed (see above) and multiply x quantized to int8 per row and
// 32-value block (quant_q8_f32 in ops.cu: codes, and per block the scale d and ds = d * Σ
// codes; the CPU's definition). Lane l of a warp takes groups l, l + 32, ... of its rows: per
// group one or two 16-byte loads of weight codes, two of x codes per row of x, and an exact
// integer dot D (8 dp4a for a whole group). Per output, the lane accumulates
// acc = fma(dw * dx, D, acc) for its groups in increasing order (Q4_1: then fma(m, ds, acc)),
// then the xor butterfly: the order depends on K and the format only, so every M, MT and R
// gives the same bits, and so do decode, verify and CUDA-core prefill rows. From 5 rows of
// x the host takes the integer tensor-core kernels of matmul_qtc.cu instead, which keep this
// order exactly.
//
// Two-term activations (DF_X_TERMS = 2, the module the host builds for
// `DFLASH_CUDA_INT8=x2`): each row of x is two int8 rows (q8_terms: the codes of x, then of
// its residual; interleaved, so rows m0 .. m0 + MT are int8 rows 2 m0 .. 2 m0 + 2 MT). A warp
// accumulates each int8 row as above, sums each over the lanes and adds the two sums
// (term_sum): the CPU's `Terms::Two` (first + second), and again one order for every M.
template <int DT>
struct MmQ;

// A packed Q4 code word: byte j holds value j (low nibble) and j + 16 (high). The two nibble
// halves as bytes, and for Q4_0 (OFFSET8) as the signed weights q - 8: per byte q + 0x78 is
// 0x78..0x87 (no carry into the next byte, so one 32-bit add does all four), and flipping its
// top bit gives the two's complement byte of q - 8 (0xf8..0x07). Two instructions a word where
// __vsub4 took three (ptxas emulates it with an or, an add and an xor).
template <bool OFFSET8>
__device__ __forceinline__ void q4_split(u32 w, u32* lo, u32* hi) {
    *lo = DF_LO_NIBBLES(w);
    *hi = DF_HI_NIBBLES(w);
    if (OFFSET8) {
        *lo = (*lo + 0x78787878u) ^ 0x80808080u;
        *hi = (*hi + 0x78787878u) ^ 0x80808080u;
    }
}

// The exact integer dot of a packed Q4 group (16 code bytes) with its 32 x codes: 8 dp4a.
template <bool OFFSET8>
__device__ __forceinline__ int q4_dot(const uint4* c, const int4& xl, const int4& xh) {
    const u32 w[4] = {c[0].x, c[0].y, c[0].z, c[0].w};
    const int xa[4] = {xl.x, xl.y, xl.z, xl.w};
    const int xb[4] = {xh.x, xh.y, xh.z, xh.w};
    int d = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        u32 lo, hi;
        q4_split<OFFSET8>(w[k], &lo, &hi);
        d = __dp4a((int)lo, xa[k], d);
        d = __dp4a((int)hi, xb[k], d);
    }
    return d;
}

// Q4_0: weights q - 8.
template <>
struct MmQ<DT_Q4_0> {
    static constexpr int CB = 16;  // code bytes per group
    static constexpr int SB = 2;   // scale bytes per group
    static __device__ __forceinline__ int dot(const uint4* c, const int4& xl, const int4& xh) {
        return q4_dot<true>(c, xl, xh);
    }
};

// Q4_1: unsigned weights q (the minimum enters through ds).
template <>
struct MmQ<DT_Q4_1> {
    static constexpr int CB = 16;
    static constexpr int SB = 4;
    static __device__ __forceinline__ int dot(const uint4* c, const int4& xl, const int4& xh) {
        return q4_dot<false>(c, xl, xh);
    }
};

// Q8_0: 32 signed code bytes in value order.
template <>
struct MmQ<DT_Q8_0> {
    static constexpr int CB = 32;
    static constexpr int SB = 2;
    static __device__ __forceinline__ int dot(const uint4* c, const int4& xl, const int4& xh) {
        int d = __dp4a((int)c[0].x, xl.x, 0);
        d = __dp4a((int)c[0].y, xl.y, d);
        d = __dp4a((int)c[0].z, xl.z, d);
        d = __dp4a((int)c[0].w, xl.w, d);
        d = __dp4a((int)c[1].x, xh.x, d);
        d = __dp4a((int)c[1].y, xh.y, d);
        d = __dp4a((int)c[1].z, xh.z, d);
        return __dp4a((int)c[1].w, xh.w, d);
    }
};

// mm_warp for int8 x and packed weights (see above).
template <int DT, int MT, int R, int EPI>
__device__ __forceinline__ void mmq_warp(const MmSeg& sg, const int (&nr)[R], const MmParams& p, int m0, int seg,
                                         int pair) {
    constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;
    constexpr int CB = MmQ<DT>::CB;
    constexpr int SB = MmQ<DT>::SB;
    constexpr int NC = CB / 16;  // 16-byte code loads per group
    constexpr int T = DF_X_TERMS;
    constexpr int MQ = MT * T;  // int8 rows of the tile
    const signed char* __restrict__ xq = (const signed char*)p.x;
    const float2* __restrict__ xs = (const float2*)p.xs;
    const int K = p.k;
    const int lane = threadIdx.x & 31;
    const int groups = K / GROUP;
    const int ml = min(MT, p.m - m0);
    const int mq = T * ml;             // int8 rows present
    const size_t q0 = (size_t)T * m0;  // the first of them
    const u8* rows[R][W];
    mm_weight_rows<R, W>(sg, nr, rows);

    // Groups per lane whose weights are in flight together; with two or more int8 rows the
    // x codes of a group are loaded with its weights, else after. (P = 4 and 8 at one row of x
    // measured level and slower on the H200: docs/benchmarks/2026-12-04-h200-norm-prologue.md.)
    constexpr int P = MQ <= 2 ? 2 : 1;
    constexpr bool XH = MQ >= 2 && MQ <= 4;
    RopeLane rl = {1.0f, 0.0f, 0};
    if (EPI == EPI_ROPE && lane < ml) rl = rope_lane(p, seg, pair, m0 + lane);
    df_kernel_begin();
    float acc[R][W][MQ];
    mm_zero(acc);
    for (int g0 = lane; g0 < groups; g0 += 32 * P) {
        uint4 c[P][R][W][NC];
        u32 sw[P][R][W];
        constexpr int XP = XH ? MQ : 1;
        int4 xl[P][XP], xh[P][XP];
        float2 sx[P][XP];
#pragma unroll
        for (int q = 0; q < P; q++) {
            const int g = g0 + 32 * q;
            if (g < groups) {
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        const u8* row = rows[r][v];
#pragma unroll
                        for (int i = 0; i < NC; i++) c[q][r][v][i] = __ldg((const uint4*)(row + (size_t)g * CB) + i);
                        const u8* sp = row + (size_t)groups * CB + (size_t)g * SB;
                        sw[q][r][v] = SB == 4 ? __ldg((const unsigned int*)sp) : (u32)__ldg((const unsigned short*)sp);
                    }
                if (XH) {
#pragma unroll
                    for (int m = 0; m < XP; m++) {
                        const size_t xr = q0 + (m < mq ? m : 0);
                        const int4* x4 = (const int4*)(xq + xr * K + (size_t)g * GROUP);
                        xl[q][m] = __ldg(x4);
                        xh[q][m] = __ldg(x4 + 1);
                        sx[q][m] = __ldg(xs + xr * groups + g);
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < P; q++) {
            const int g = g0 + 32 * q;
            if (g < groups) {
#pragma unroll
                for (int m = 0; m < MQ; m++) {
                    if (m < mq) {
                        int4 a, b;
                        float2 sc;
                        if (XH) {
                            a = xl[q][m % XP];
                            b = xh[q][m % XP];
                            sc = sx[q][m % XP];
                        } else {
                            const size_t xr = q0 + m;
                            const int4* x4 = (const int4*)(xq + xr * K + (size_t)g * GROUP);
                            a = __ldg(x4);
                            b = __ldg(x4 + 1);
                            sc = __ldg(xs + xr * groups + g);
                        }
#pragma unroll
                        for (int r = 0; r < R; r++)
#pragma unroll
                            for (int v = 0; v < W; v++) {
                                const int d = MmQ<DT>::dot(c[q][r][v], a, b);
                                const float dw = f16_to_f32((u16)(sw[q][r][v] & 0xffffu));
                                float t = __fmaf_rn(__fmul_rn(dw, sc.x), (float)d, acc[r][v][m]);
                                if (DT == DT_Q4_1) t = __fmaf_rn(f16_to_f32((u16)(sw[q][r][v] >> 16)), sc.y, t);
                                acc[r][v][m] = t;
                            }
                    }
                }
            }
        }
    }
    mm_finish<MT, R, W, EPI, T>(acc, sg, nr, p, m0, seg, ml, rl);
}

// SwiGLU products of int8 x that also write the int8 copy of their output for the down
// projection after them (cuda/int8_x.rs), saving its quantizer launch. A block is SQ_WARPS
// warps of SQ_R gate/up row pairs (SQ_WARPS * SQ_R = GROUP), so it owns one whole 32-value
// block of every row of x: mmq_warp writes the outputs, and after the block's barrier (which
// makes them visible to the block) warp m quantizes row m0 + m's block with the quantizer's
// own code (q8_terms): the copy has the quantizer's bits, and the outputs mmq_warp's, which do
// not depend on R. The host takes these for the dp4a tiles (MT <= 4) of products whose width
// is a whole number of blocks (no warp leaves early, so every warp reaches the barrier).
template <int DT, int MT>
__device__ __forceinline__ void mmqs_body(const MmParams& p) {
    const MmSeg& sg = p.seg[0];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int n0 = (int)blockIdx.x * GROUP;
    const int m0 = (int)blockIdx.y * MT;
    int nr[SQ_R];
#pragma unroll
    for (int r = 0; r < SQ_R; r++) nr[r] = n0 + warp * SQ_R + r;
    mmq_warp<DT, MT, SQ_R, EPI_SWIGLU>(sg, nr, p, m0, 0, 0);
    __syncthreads();
    if (warp < min(MT, p.m - m0)) {
        const size_t i = (size_t)(m0 + warp) * sg.n + n0 + lane;
        const float y = ((const float*)sg.out)[i];
        q8_terms(y, lane, (signed char*)p.oc, (float2*)p.os, m0 + warp, n0 + lane, sg.n, DF_X_TERMS);
    }
}

// 2..16 rows of int8 x on integer tensor cores, same bits: mmqt_body.
#include "matmul_qtc.cu"

// The output head (f32 x) of packed weights on TF32 tensor cores, x split in two: mmx2_body.
#include "matmul_x2.cu"
#endif

// One warp per unit (R weight rows, or a rotary pair) of the segment its block belongs to;
// Q: int8 x (mmq_warp; DT the stored format's number), else f32 x (mm_warp; DT the layout's:
// for formats with int8 kernels their packed layout, DT + DT_PACKED).
template <int DT, int MT, int R, int EPI, bool Q>
__device__ __forceinline__ void mm_body(const MmParams& p) {
    const int si = mm_segment(p);
    const MmSeg& sg = p.seg[si];
    const int warp = threadIdx.x >> 5;
    const int unit = ((int)blockIdx.x - sg.block0) * MM_WARPS + warp;  // R rows, or a pair
    int nr[R];
    int pair = 0;
    if (EPI == EPI_ROPE) {
        // Pair `pair` of head h: rows h * head_dim + ia and + ib.
        const int h = unit / p.half;
        pair = unit - h * p.half;
        int ia, ib;
        rope_offsets(pair, p.half, p.style, &ia, &ib);
        nr[0] = h * p.head_dim + ia;
        nr[R - 1] = h * p.head_dim + ib;
    } else {
#pragma unroll
        for (int r = 0; r < R; r++) nr[r] = unit * R + r;
    }
    if (unit * R >= sg.n) {  // a whole warp leaves together (no shuffle is left waiting)
        df_kernel_begin();
        return;
    }
#if DF_MM_INT8
    if constexpr (Q) {
        mmq_warp<DT, MT, R, EPI>(sg, nr, p, (int)blockIdx.y * MT, si, pair);
        return;
    }
#endif
    if constexpr (!Q) mm_warp<DT, MT, R, EPI>(sg, nr, p, (int)blockIdx.y * MT, si, pair);
}

// Kernel names: mm_<format>_<MT>_<R>_<epilogue>. R for a tile is chosen by the host
// (MM_TILES in cuda/device.rs): wider R shares each x load among more weight rows.
#define MM_KERNEL(SUFFIX, DT, MT, R, EPI, ENAME)                                               \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                \
        mm_##SUFFIX##_##MT##_##R##_##ENAME(const MmParams p) {                                 \
        df_l2_ahead(p.ahead);                                                                  \
        mm_body<DT, MT, R, EPI, false>(p); /* waits for the previous kernel itself (mm_warp) */ \
    }

// Kernel names: mmq_<format>_<MT>_<R>_<epilogue> (int8 x; formats with DF_MM_INT8).
#define MMQ_KERNEL(SUFFIX, DT, MT, R, EPI, ENAME)                                              \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                                \
        mmq_##SUFFIX##_##MT##_##R##_##ENAME(const MmParams p) {                                \
        df_l2_ahead(p.ahead);                                                                  \
        mm_body<DT, MT, R, EPI, true>(p); /* waits for the previous kernel itself (mmq_warp) */ \
    }

#define MM_EPIS_OF(KERNEL, SUFFIX, DT, MT, R, RS)     \
    KERNEL(SUFFIX, DT, MT, R, EPI_STORE, store)       \
    KERNEL(SUFFIX, DT, MT, R, EPI_ADD, add)           \
    KERNEL(SUFFIX, DT, MT, RS, EPI_SWIGLU, swiglu)    \
    KERNEL(SUFFIX, DT, MT, 2, EPI_ROPE, rope)
#define MM_EPIS(SUFFIX, DT, MT, R, RS) MM_EPIS_OF(MM_KERNEL, SUFFIX, DT, MT, R, RS)
#define MMQ_EPIS(SUFFIX, DT, MT, R, RS) MM_EPIS_OF(MMQ_KERNEL, SUFFIX, DT, MT, R, RS)

// (MT, R for store/add, R for SwiGLU; the rope epilogue always has R = 2, one rotary pair):
// keep each warp at most 64 accumulators.
#define MM_TILES_OF(EPIS, SUFFIX, DT) \
    EPIS(SUFFIX, DT, 1, 1, 1)          \
    EPIS(SUFFIX, DT, 2, 1, 1)          \
    EPIS(SUFFIX, DT, 4, 2, 1)          \
    EPIS(SUFFIX, DT, 8, 4, 2)          \
    EPIS(SUFFIX, DT, 16, 4, 2)
#define MM_KERNELS(SUFFIX, DT) MM_TILES_OF(MM_EPIS, SUFFIX, DT)
#define MMQ_KERNELS(SUFFIX, DT) MM_TILES_OF(MMQ_EPIS, SUFFIX, DT)

// Kernel names: mmqs_<format>_<MT> (int8 SwiGLU writing the int8 copy of its output; the
// dp4a tiles, MT <= 4).
#define MMQS_KERNEL(SUFFIX, DT, MT)                                                          \
    extern "C" __global__ void __launch_bounds__(SQ_WARPS * 32) mmqs_##SUFFIX##_##MT(const MmParams p) { \
        df_l2_ahead(p.ahead);                                                                \
        mmqs_body<DT, MT>(p); /* waits for the previous kernel itself (mmq_warp) */          \
    }
#define MMQS_KERNELS(SUFFIX, DT) \
    MMQS_KERNEL(SUFFIX, DT, 1)   \
    MMQS_KERNEL(SUFFIX, DT, 2)   \
    MMQS_KERNEL(SUFFIX, DT, 4)

// Kernel names: mmqt_<format>_<epilogue>_<T> (int8 x on integer tensor cores, matmul_qtc.cu;
// T column tiles of 8 per block: QT_NT, QT_NT_MID and QT_NT_NARROW). The SwiGLU kernels (the ring of
// matmul_qtc.cu) are bounded to two blocks an SM (128 registers; unbounded, ptxas gave the
// wide one 165, one block an SM); a bound on the others would change their registers too
// (a minimum of one block let ptxas take the narrow ones from 77 to 97: two blocks, not three).
#define MMQT_KERNEL(SUFFIX, DT, EPI, ENAME, T, BOUNDS)                                       \
    extern "C" __global__ void BOUNDS mmqt_##SUFFIX##_##ENAME##_##T(const MmParams p) {     \
        df_l2_ahead(p.ahead);                                                                \
        mmqt_kernel_body<DT, EPI, T>(p); /* waits for the previous kernel itself */          \
    }
#define MMQT_EPIS(SUFFIX, DT, T)                                                          \
    MMQT_KERNEL(SUFFIX, DT, EPI_STORE, store, T, __launch_bounds__(QT_WARPS * 32))        \
    MMQT_KERNEL(SUFFIX, DT, EPI_ADD, add, T, __launch_bounds__(QT_WARPS * 32))            \
    MMQT_KERNEL(SUFFIX, DT, EPI_SWIGLU, swiglu, T, __launch_bounds__(QT_WARPS * 32, 2))   \
    MMQT_KERNEL(SUFFIX, DT, EPI_ROPE, rope, T, __launch_bounds__(QT_WARPS * 32))
#define MMQT_EPIS_OF(SUFFIX, DT, T) MMQT_EPIS(SUFFIX, DT, T)
#define MMQT_KERNELS(SUFFIX, DT)              \
    MMQT_EPIS_OF(SUFFIX, DT, QT_NT)           \
    MMQT_EPIS_OF(SUFFIX, DT, QT_NT_MID)       \
    MMQT_EPIS_OF(SUFFIX, DT, QT_NT_NARROW)

// Kernel names: mmtc_<format>_<epilogue> (prompt rows on tensor cores, matmul_tc.cu).
#define MMTC_KERNEL(SUFFIX, DT, EPI, ENAME)                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                           \
        mmtc_##SUFFIX##_##ENAME(const MmParams p) {                                    \
        df_l2_ahead(p.ahead);                                                          \
        df_kernel_begin();                                                             \
        mmtc_body<DT, EPI>(p);                                                         \
    }

#define MMTC_KERNELS(SUFFIX, DT)                 \
    MMTC_KERNEL(SUFFIX, DT, EPI_STORE, store)    \
    MMTC_KERNEL(SUFFIX, DT, EPI_ADD, add)        \
    MMTC_KERNEL(SUFFIX, DT, EPI_SWIGLU, swiglu)

// Kernel names: mmx2_<format>_<epilogue>_<MT> (f32 x, packed formats, matmul_x2.cu; MT column
// tiles of 8 rows of x).
#define MMX2_KERNEL(SUFFIX, DT, EPI, ENAME, MT)                                  \
    extern "C" __global__ void __launch_bounds__(X2_WARPS * 32)                  \
        mmx2_##SUFFIX##_##ENAME##_##MT(const MmParams p) {                       \
        df_l2_ahead(p.ahead);                                                    \
        mmx2_body<DT, EPI, MT>(p); /* waits for the previous kernel itself */    \
    }
#define MMX2_KERNELS(SUFFIX, DT)                   \
    MMX2_KERNEL(SUFFIX, DT, EPI_STORE, store, 1)   \
    MMX2_KERNEL(SUFFIX, DT, EPI_ADD, add, 1)       \
    MMX2_KERNEL(SUFFIX, DT, EPI_STORE, store, 2)   \
    MMX2_KERNEL(SUFFIX, DT, EPI_ADD, add, 2)

// ---- dequantization --------------------------------------------------------------------
//
// out[t] = row ids[t] of the table (or row row0 + t when ids is null), as f32; cols must be a
// whole number of groups. Block per output row, threads over groups. Bit-identical to
// quant::dequantize_row (same decoder).
// Group g of a row as 32 f32 values: stored layouts through decode_group (common.cu), the
// packed layouts (DT >= DT_PACKED) through their quarter loaders and the same decoders.
template <int DT>
__device__ __forceinline__ void decode_group_any(const u8* row, int g, int groups, float* wv) {
    if constexpr (DT >= DT_PACKED) {
#pragma unroll
        for (int s = 0; s < 4; s++) {
            MmPart<DT> part;
            part.load(row, g, s, groups);
            float w[8];
            part.decode(w);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                wv[MmPart<DT>::xa(s) + k] = w[k];
                wv[MmPart<DT>::xb(s) + k] = w[4 + k];
            }
        }
    } else {
        decode_group<DT>(row, g, wv);
    }
}

template <int DT>
__device__ __forceinline__ void dequant_body(const u8* __restrict__ table, i64 row_bytes, int cols,
                                             const u32* __restrict__ ids, int row0, int T,
                                             float* __restrict__ out) {
    const int t = blockIdx.x;
    if (t >= T) return;
    const size_t src = ids ? (size_t)ids[t] : (size_t)row0 + (size_t)t;
    const u8* row = table + src * (size_t)row_bytes;
    float* o = out + (size_t)t * cols;
    for (int g = threadIdx.x; g < cols / GROUP; g += blockDim.x) {
        float wv[GROUP];
        decode_group_any<DT>(row, g, cols / GROUP, wv);
        float4* o4 = (float4*)(o + (size_t)g * GROUP);
        if ((((size_t)o) & 15) == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) o4[i] = make_float4(wv[4 * i], wv[4 * i + 1], wv[4 * i + 2], wv[4 * i + 3]);
        } else {
#pragma unroll
            for (int j = 0; j < GROUP; j++) o[(size_t)g * GROUP + j] = wv[j];
        }
    }
}

#define DQ_KERNEL(SUFFIX, DT)                                                                   \
    extern "C" __global__ void dequant_##SUFFIX(const u8* table, i64 row_bytes, int cols,       \
                                                const u32* ids, int row0, int T, float* out) { \
        df_kernel_begin();                                                                      \
        dequant_body<DT>(table, row_bytes, cols, ids, row0, T, out);                            \
    }

// Instantiations. The Rust side compiles this file once per format, with DF_MM_DTYPE and
// DF_MM_SUFFIX set to that format's number and name (from the format table, dtype.rs).
// Formats with int8 kernels (DF_MM_INT8) are stored on the GPU in their packed layout, every
// weight (cuda/pack.rs): their f32-activation products, tensor-core prefill and dequantizer
// read that layout (same decoders, so the same values as the stored one), and they also get the
// int8 products (mmq_<format>_..., mmqs_<format>_... for SwiGLU with the int8 copy of its output,
// and mmqt_<format>_... on integer tensor cores) and the
// f32-activation products on TF32 tensor cores (mmx2_<format>_...).
#if DF_MM_INT8
#define DF_INT8_KERNELS(SUFFIX, DT) \
    MMQ_KERNELS(SUFFIX, DT)         \
    MMQS_KERNELS(SUFFIX, DT)        \
    MMQT_KERNELS(SUFFIX, DT)        \
    MMX2_KERNELS(SUFFIX, DT + DT_PACKED)
#define DF_LAYOUT(DT) (DT + DT_PACKED)
#else
#define DF_INT8_KERNELS(SUFFIX, DT)
#define DF_LAYOUT(DT) DT
#endif
#define DF_FORMAT(SUFFIX, DT)             \
    MM_KERNELS(SUFFIX, DF_LAYOUT(DT))     \
    MMTC_KERNELS(SUFFIX, DF_LAYOUT(DT))   \
    DQ_KERNEL(SUFFIX, DF_LAYOUT(DT))      \
    DF_INT8_KERNELS(SUFFIX, DT)
#define DF_FORMAT_OF(SUFFIX, DT) DF_FORMAT(SUFFIX, DT)
DF_FORMAT_OF(DF_MM_SUFFIX, DF_MM_DTYPE)
