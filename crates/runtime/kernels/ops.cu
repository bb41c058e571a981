// dflash-rs CUDA kernels: element-wise ops, RMS norm, RoPE, row gathers, KV cache (argmax is
// in sample.cu).
//
// Each token is computed on its own, with a fixed order, so a token's result never depends on
// the batch around it. Where the CPU reference (crates/runtime/src/cpu/ops) has a defined
// summation order, it is reproduced exactly (RMS norm: bit-identical to the CPU backend).
#include "common.cu"

// ---- element-wise ------------------------------------------------------------------------

// x[i] += y[i]
extern "C" __global__ void add_f32(float* x, const float* y, i64 n) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        x[i] = __fadd_rn(x[i], y[i]);
    }
}

// x[r][c] += bias[c]
extern "C" __global__ void add_bias_f32(float* x, const float* bias, i64 n, int cols) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        x[i] = __fadd_rn(x[i], bias[i % cols]);
    }
}

// gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i], in that order of operations (CPU:
// elementwise::silu_mul). exp is evaluated in double and rounded to f32, which is the
// correctly rounded expf in all but rare double-rounding cases, as close as we can get to the
// CPU's libm expf.
extern "C" __global__ void silu_mul_f32(float* gate, const float* up, i64 n) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float g = gate[i];
        const float e = (float)exp(-(double)g);
        gate[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, e)), up[i]);
    }
}

// x[i] *= s
extern "C" __global__ void scale_f32(float* x, float s, i64 n) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        x[i] = __fmul_rn(x[i], s);
    }
}

// Grouped dynamic causal convolution (Backend::grouped_conv; CPU: cpu/ops/conv.rs), one token
// per blockIdx.y. Tap o of token t reads token t - o only when it is the same row's position
// pos - o; taps in order, the base product then the dynamic product, each rounded.
extern "C" __global__ void grouped_conv_f32(const float* x, const float* base, const float* dyn,
                                            const u32* meta, int T, int cols, int taps, int group,
                                            int dyn_cols, int col, float* out) {
    df_kernel_begin();
    const int t = blockIdx.y;
    if (t >= T) return;
    const u32 row = meta[4 * t + META_ROW];
    const u32 pos = meta[4 * t + META_POS];
    const int groups = cols / group;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int o = 0; o < taps && o <= t; ++o) {
            const int s = t - o;
            if (meta[4 * s + META_ROW] != row || meta[4 * s + META_POS] + (u32)o != pos) continue;
            const float v = x[(size_t)s * cols + c];
            acc = __fadd_rn(acc, __fmul_rn(base[(size_t)o * cols + c], v));
            acc = __fadd_rn(acc, __fmul_rn(dyn[(size_t)t * dyn_cols + col + o * groups + c / group], v));
        }
        out[(size_t)t * cols + c] = acc;
    }
}

// out[i] = x[rows[i]] (rows of `cols` values)
extern "C" __global__ void gather_rows_f32(const float* x, const u32* rows, int n, int cols, float* out) {
    df_kernel_begin();
    const int i = blockIdx.y;
    if (i >= n) return;
    const float* src = x + (size_t)rows[i] * cols;
    float* dst = out + (size_t)i * cols;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) dst[c] = src[c];
}

// dst[t][col + c] = src[t][c] for c < c_src (dst rows of c_dst values)
extern "C" __global__ void copy_columns_f32(const float* src, int rows, int c_src, float* dst, int c_dst, int col) {
    df_kernel_begin();
    const int t = blockIdx.y;
    if (t >= rows) return;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < c_src; c += gridDim.x * blockDim.x) {
        dst[(size_t)t * c_dst + col + c] = src[(size_t)t * c_src + c];
    }
}

// Plain float rows of any length (f32, f16, bf16: dt = 0, 1, 2), element by element.
extern "C" __global__ void dequant_float_any(const u8* table, i64 row_bytes, int cols, int dt,
                                             const u32* ids, int row0, int T, float* out) {
    df_kernel_begin();
    const int t = blockIdx.x;
    if (t >= T) return;
    const size_t src = ids ? (size_t)ids[t] : (size_t)row0 + (size_t)t;
    const u8* row = table + src * (size_t)row_bytes;
    float* o = out + (size_t)t * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v;
        if (dt == DT_F32) {
            const u8* p = row + 4 * (size_t)i;
            v = __int_as_float((int)((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24)));
        } else {
            const u8* p = row + 2 * (size_t)i;
            u16 h = (u16)((u32)p[0] | ((u32)p[1] << 8));
            v = dt == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
        o[i] = v;
    }
}

// ---- int8 activations ----------------------------------------------------------------------
//
// x [blocks * 32] f32, rows of n values, to int8 codes per 32-value block in the copy's form
// `form` for the int8 matmul kernels (mmq_* in matmul.cu): q8_terms (common.cu) per block,
// one warp per block.
extern "C" __global__ void quant_q8_f32(const float* x, i64 blocks, signed char* codes, float2* scales, int n,
                                        int form) {
    df_kernel_begin();
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 b = blockIdx.x * (i64)(blockDim.x >> 5) + (threadIdx.x >> 5); b < blocks; b += warps) {
        const int bpr = n / GROUP;  // blocks per row (an int8 copy is a few rows: b fits an int)
        const int row = (int)b / bpr;
        q8_terms(x[b * GROUP + lane], lane, codes, scales, row, ((int)b - row * bpr) * GROUP + lane, n, form);
    }
}

// ---- RMS norm ----------------------------------------------------------------------------
//
// Every `dim`-value group of x is normalised: out = w' * (v * inv), inv = 1 / sqrt(ss/dim + eps),
// w' = 1 + w when zero-centred. The sum of squares ss follows cpu::ops::dot exactly: sixteen
// partial sums, partial l adding x[i]*x[i] (rounded product, then rounded sum) for
// i = l, l + 16, ... in increasing order, then combined by halving (l + l+8, then + l+4, ...).
// A block owns a group. Groups of up to NORM_STAGE values take one round trip to memory: every
// thread loads its share of x and w at once (x is also staged in shared memory), lanes 0..15 of
// the first warp make the sixteen partials from the staged copy, the shuffle-down tree is that
// halving, and every thread scales the values it holds. Longer groups stream x twice. Either
// way the result is bit-identical to the CPU backend's. In place when x == out (the group is
// read completely before any of it is written).
//
// rms_norm_q8_f32 also quantizes each row it normalises for int8 products (q8_terms, the
// quantizer's bits, in the copy's form `form`), so the product that follows needs no quantizer
// launch. Rows of at most NORM_STAGE values, a multiple
// of 32 (the host checks). Two widths: rms_norm_q8_few_f32 (NORM_Q_FEW_THREADS) for the few
// rows of a decode or verify step, whose warps then quantize at most four blocks each (at 128
// threads one row is a chain of up to 32 blocks per warp); rms_norm_q8_f32 (NORM_Q_THREADS)
// for prompt rows, which then fit one wave. The values and the sum of squares do not depend on
// the thread count (the partials are made from the staged copy), so all norms give the same
// bits.
// NORM_THREADS (128), NORM_STAGE (4096), NORM_Q_THREADS (256) and NORM_Q_FEW_THREADS (1024)
// are defined by the host (cuda/compile.rs, `shared_constants`).
#define NORM_PER (NORM_STAGE / NORM_THREADS)

// 1 / sqrt(ss / dim + eps) from the sixteen partials held by lanes 0..15 (lane 0 returns it).
__device__ __forceinline__ float norm_inv(float acc, int dim, float eps) {
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
        acc = __fadd_rn(acc, __shfl_down_sync(DF_FULL_MASK, acc, off, 16));
    }
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, (float)dim), eps)));
}

__device__ __forceinline__ float norm_weight(float w, int zero_centred) {
    return zero_centred ? __fadd_rn(1.0f, w) : w;
}

// A row of dim <= NORM_STAGE values (see above) normalised by T threads and quantized. Its
// first half repeats rms_norm_f32's staged path on purpose: a build whose plain norm called
// a shared template decoded the default model's shapes 4% slower on the H200
// (docs/benchmarks/2026-12-02-h200-int8-handoff.md, call 3), so the plain kernel keeps its own
// code. The two must stay the same arithmetic: cuda_ops checks the plain norm against the
// CPU's bit for bit, cuda_fused the quantizing norm's f32 output too.
template <int T>
__device__ __forceinline__ void rms_norm_staged_q8(const float* xs, float* os, const float* w, int dim, float eps,
                                                int zero_centred, signed char* qc, float2* qs, int row,
                                                int form) {
    constexpr int PER = NORM_STAGE / T;
    __shared__ float s_inv;
    __shared__ float s_x[NORM_STAGE];
    float xv[PER], wv[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int i = threadIdx.x + T * u;
        xv[u] = i < dim ? xs[i] : 0.0f;
        wv[u] = i < dim ? w[i] : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int i = threadIdx.x + T * u;
        if (i < dim) s_x[i] = xv[u];
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float acc = 0.0f;
        if (lane < 16) {
#pragma unroll 8
            for (int i = lane; i < dim; i += 16) acc = __fadd_rn(acc, __fmul_rn(s_x[i], s_x[i]));
        }
        const float inv = norm_inv(acc, dim, eps);
        if (lane == 0) s_inv = inv;
    }
    __syncthreads();
    const float inv = s_inv;
#pragma unroll
    for (int u = 0; u < PER; u++) {
        const int i = threadIdx.x + T * u;
        // dim % 32 == 0: whole warps take or skip this branch (warp w holds block
        // w + (T / 32) u, value j in lane j).
        if (i < dim) {
            const float y = __fmul_rn(norm_weight(wv[u], zero_centred), __fmul_rn(xv[u], inv));
            os[i] = y;
            q8_terms(y, threadIdx.x & 31, qc, qs, row, i, dim, form);
        }
    }
}

extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    rms_norm_f32(const float* x, float* out, const float* w, i64 groups, int dim, float eps, int zero_centred) {
    df_kernel_begin();
    __shared__ float s_inv;
    __shared__ float s_x[NORM_STAGE];
    const i64 grp = blockIdx.x;
    if (grp >= groups) return;
    const float* xs = x + grp * (i64)dim;
    float* os = out + grp * (i64)dim;
    if (dim <= NORM_STAGE) {
        float xv[NORM_PER], wv[NORM_PER];
#pragma unroll
        for (int u = 0; u < NORM_PER; u++) {
            const int i = threadIdx.x + NORM_THREADS * u;
            xv[u] = i < dim ? xs[i] : 0.0f;
            wv[u] = i < dim ? w[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_PER; u++) {
            const int i = threadIdx.x + NORM_THREADS * u;
            if (i < dim) s_x[i] = xv[u];
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            float acc = 0.0f;
            if (lane < 16) {
#pragma unroll 8
                for (int i = lane; i < dim; i += 16) acc = __fadd_rn(acc, __fmul_rn(s_x[i], s_x[i]));
            }
            const float inv = norm_inv(acc, dim, eps);
            if (lane == 0) s_inv = inv;
        }
        __syncthreads();
        const float inv = s_inv;
#pragma unroll
        for (int u = 0; u < NORM_PER; u++) {
            const int i = threadIdx.x + NORM_THREADS * u;
            if (i < dim) os[i] = __fmul_rn(norm_weight(wv[u], zero_centred), __fmul_rn(xv[u], inv));
        }
        return;
    }
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float acc = 0.0f;
        if (lane < 16) {
            for (int i0 = lane; i0 < dim; i0 += 16 * 8) {
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int i = i0 + 16 * u;
                    v[u] = i < dim ? xs[i] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    if (i0 + 16 * u < dim) acc = __fadd_rn(acc, __fmul_rn(v[u], v[u]));
                }
            }
        }
        const float inv = norm_inv(acc, dim, eps);
        if (lane == 0) s_inv = inv;
    }
    __syncthreads();
    const float inv = s_inv;
    for (int i0 = threadIdx.x; i0 < dim; i0 += NORM_THREADS * 4) {
        float xv[4], wv[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + NORM_THREADS * u;
            xv[u] = i < dim ? xs[i] : 0.0f;
            wv[u] = i < dim ? w[i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = i0 + NORM_THREADS * u;
            if (i < dim) os[i] = __fmul_rn(norm_weight(wv[u], zero_centred), __fmul_rn(xv[u], inv));
        }
    }
}

#define NORM_Q8_KERNEL(NAME, T)                                                                               \
    extern "C" __global__ void __launch_bounds__(T) NAME(const float* x, float* out, const float* w, i64 groups, \
                                                         int dim, float eps, int zero_centred, signed char* qc,  \
                                                         float2* qs, int form) {                                 \
        df_kernel_begin();                                                                                       \
        const i64 row = blockIdx.x;                                                                              \
        if (row >= groups) return;                                                                               \
        rms_norm_staged_q8<T>(x + row * dim, out + row * dim, w, dim, eps, zero_centred, qc, qs, (int)row, form); \
    }
NORM_Q8_KERNEL(rms_norm_q8_f32, NORM_Q_THREADS)
NORM_Q8_KERNEL(rms_norm_q8_few_f32, NORM_Q_FEW_THREADS)

// ---- RoPE (the arithmetic is in common.cu) ----------------------------------------------

// Rotates pair i of the head at `head`, writing the results to `dst` (may equal head).
__device__ __forceinline__ void rope_pair(const float* head, float* dst, int i, int half, int style, float pos,
                                          const float* inv_freq) {
    int ia, ib;
    rope_offsets(i, half, style, &ia, &ib);
    float ra, rb;
    rope_rotate(head[ia], head[ib], i, style, pos, inv_freq, &ra, &rb);
    dst[ia] = ra;
    dst[ib] = rb;
}

extern "C" __global__ void rope_f32(float* x, const u32* meta, const float* inv_freq, int T, int cols,
                                    int head_dim, int half, int style) {
    df_kernel_begin();
    const int t = blockIdx.y;
    if (t >= T) return;
    const float pos = (float)meta[4 * t + META_POS];
    const int heads = cols / head_dim;
    float* xt = x + (size_t)t * cols;
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < heads * half; idx += gridDim.x * blockDim.x) {
        const int h = idx / half;
        float* head = xt + (size_t)h * head_dim;
        rope_pair(head, head, idx - h * half, half, style, pos, inv_freq);
    }
}

// RoPE of q and k, and the KV write of k and v, for token blockIdx.x: the fusion of two
// `rope_f32` and one `kv_write_f32` launches, with the same arithmetic (the matmul's rope
// epilogue, matmul.cu, computes the same values inside the q/k/v products). k is rotated in place
// (as the separate ops leave it), then k and v are copied into the cache.
struct RopeKvParams {
    u64 q;         // [T, q_cols]
    u64 k;         // [T, kv_dim]
    u64 v;         // [T, kv_dim]
    u64 meta;      // [T][4] u32
    u64 inv_freq;  // [half]
    u64 rows;      // RowDesc per KV row
    u64 q_norm;    // [head_dim] (qk_norm_rope_kv_f32 only)
    u64 k_norm;    // [head_dim] (qk_norm_rope_kv_f32 only)
    int t;
    int q_cols;
    int kv_dim;
    int head_dim;
    int half;
    int style;
    int layer;
    float eps;     // of the q/k norms
    int kv_half;   // the cache holds f16 (kv_put)
    int pad;
};

extern "C" __global__ void rope_kv_f32(const RopeKvParams p) {
    df_kernel_begin();
    const int t = blockIdx.x;
    if (t >= p.t) return;
    // Two round trips: the metadata (with q, k, v and the frequencies, which do not depend on
    // it), then the row's KV storage. Rotated k pairs go straight to the cache as well; the
    // dimensions past the rotary ones and v are copied.
    const u32* meta = (const u32*)p.meta + 4 * t;
    const u32 row = meta[META_ROW];
    const u32 at = meta[META_POS];
    const RowDesc rd = ((const RowDesc*)p.rows)[row];
    const float pos = (float)at;
    const float* inv_freq = (const float*)p.inv_freq;
    float* qt = (float*)p.q + (size_t)t * p.q_cols;
    float* kt = (float*)p.k + (size_t)t * p.kv_dim;
    const float* vt = (const float*)p.v + (size_t)t * p.kv_dim;
    const u64 kd = kv_addr(rd.base, ((size_t)(2 * p.layer) * rd.cap + at) * p.kv_dim, p.kv_half);
    const u64 vd = kv_addr(rd.base, ((size_t)(2 * p.layer + 1) * rd.cap + at) * p.kv_dim, p.kv_half);
    const int qpairs = (p.q_cols / p.head_dim) * p.half;
    const int kpairs = (p.kv_dim / p.head_dim) * p.half;
    for (int idx = threadIdx.x; idx < qpairs + kpairs; idx += blockDim.x) {
        const bool isq = idx < qpairs;
        const int j = isq ? idx : idx - qpairs;
        const int h = j / p.half;
        const int i = j - h * p.half;
        int ia, ib;
        rope_offsets(i, p.half, p.style, &ia, &ib);
        float* head = (isq ? qt : kt) + (size_t)h * p.head_dim;
        float ra, rb;
        rope_rotate(head[ia], head[ib], i, p.style, pos, inv_freq, &ra, &rb);
        head[ia] = ra;
        head[ib] = rb;
        if (!isq) {
            kv_put(kd, (size_t)h * p.head_dim + ia, ra, p.kv_half);
            kv_put(kd, (size_t)h * p.head_dim + ib, rb, p.kv_half);
        }
    }
    for (int c = threadIdx.x; c < p.kv_dim; c += blockDim.x) {
        if (c % p.head_dim >= 2 * p.half) kv_put(kd, c, kt[c], p.kv_half);
        kv_put(vd, c, vt[c], p.kv_half);
    }
}

// The per-head RMS norms of q and k (Qwen3 style), then RoPE and the KV write as rope_kv_f32:
// the fusion of two rms_norm_f32 launches (groups of head_dim values) and one rope_kv_f32,
// bit for bit. A warp per head (blockIdx.y * QKN_WARPS + warp: the q heads, then the k heads;
// a k head's warp also copies the v head of the same index). The sum of squares follows
// rms_norm_f32: partial l (lane l < 16) adds the squares of values l, l + 16, l + 32, ... in
// order (lane l holds l + 32u, lane l + 16 holds l + 16 + 32u), then norm_inv's halving tree;
// each value is scaled as w * (x * inv). The normalised head is staged in shared memory, where
// the pairs are rotated with rope_kv_f32's arithmetic.
// QKN_WARPS (4) and QKN_MAX_DIM (256) are defined by the host (cuda/compile.rs).
#define QKN_PER (QKN_MAX_DIM / 32)

__device__ __forceinline__ void qk_norm_rope_kv_body(const RopeKvParams& p) {
    __shared__ float sh[QKN_WARPS][QKN_MAX_DIM];
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int hd = p.head_dim;
    const int qh = p.q_cols / hd;
    const int task = blockIdx.y * QKN_WARPS + warp;
    const bool live = t < p.t && task < qh + p.kv_dim / hd;
    const bool isq = task < qh;
    const int h = isq ? task : task - qh;
    // What only the host writes (the token's position and KV row, copied before the step, and
    // the norm's weights) is read before the wait, so the KV slot's address and the weights
    // are at hand when q and k arrive.
    u32 at = 0;
    RowDesc rd = {};
    float xv[QKN_PER], wv[QKN_PER];
    if (live) {
        const u32* meta = (const u32*)p.meta + 4 * t;
        at = meta[META_POS];
        rd = ((const RowDesc*)p.rows)[meta[META_ROW]];
        const float* w = (const float*)(isq ? p.q_norm : p.k_norm);
#pragma unroll
        for (int u = 0; u < QKN_PER; u++) {
            const int i = lane + 32 * u;
            wv[u] = i < hd ? w[i] : 0.0f;
        }
    }
    df_kernel_begin();
    if (!live) return;  // a whole warp leaves together

    float* head = (isq ? (float*)p.q + (size_t)t * p.q_cols : (float*)p.k + (size_t)t * p.kv_dim) + (size_t)h * hd;
    const u64 kd = isq ? 0 : kv_addr(rd.base, ((size_t)(2 * p.layer) * rd.cap + at) * p.kv_dim + (size_t)h * hd, p.kv_half);
#pragma unroll
    for (int u = 0; u < QKN_PER; u++) {
        const int i = lane + 32 * u;
        xv[u] = i < hd ? head[i] : 0.0f;
    }
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < QKN_PER; u++) {
        const float hi = __shfl_down_sync(DF_FULL_MASK, xv[u], 16);
        if (lane < 16 && 32 * u < hd) {
            acc = __fadd_rn(acc, __fmul_rn(xv[u], xv[u]));
            acc = __fadd_rn(acc, __fmul_rn(hi, hi));
        }
    }
    const float inv = __shfl_sync(DF_FULL_MASK, norm_inv(acc, hd, p.eps), 0);
#pragma unroll
    for (int u = 0; u < QKN_PER; u++) {
        const int i = lane + 32 * u;
        if (i < hd) sh[warp][i] = __fmul_rn(wv[u], __fmul_rn(xv[u], inv));
    }
    __syncwarp();

    const float pos = (float)at;
    const float* inv_freq = (const float*)p.inv_freq;
    for (int i = lane; i < p.half; i += 32) {
        int ia, ib;
        rope_offsets(i, p.half, p.style, &ia, &ib);
        float ra, rb;
        rope_rotate(sh[warp][ia], sh[warp][ib], i, p.style, pos, inv_freq, &ra, &rb);
        head[ia] = ra;
        head[ib] = rb;
        if (kd) {
            kv_put(kd, ia, ra, p.kv_half);
            kv_put(kd, ib, rb, p.kv_half);
        }
    }
    for (int i = 2 * p.half + lane; i < hd; i += 32) {  // past the rotary dimensions
        head[i] = sh[warp][i];
        if (kd) kv_put(kd, i, sh[warp][i], p.kv_half);
    }
    if (!isq) {
        const float* vt = (const float*)p.v + (size_t)t * p.kv_dim + (size_t)h * hd;
        const u64 vd = kv_addr(rd.base, ((size_t)(2 * p.layer + 1) * rd.cap + at) * p.kv_dim + (size_t)h * hd, p.kv_half);
        for (int i = lane; i < hd; i += 32) kv_put(vd, i, vt[i], p.kv_half);
    }
}

extern "C" __global__ void __launch_bounds__(QKN_WARPS * 32) qk_norm_rope_kv_f32(const RopeKvParams p) {
    qk_norm_rope_kv_body(p); /* waits itself, after the host's metadata */
}

// ---- KV cache ----------------------------------------------------------------------------

// Writes token t's k and v ([T, kv_dim]) at (meta.row, meta.pos) of layer `layer` (kv_put:
// f16 where half != 0). Bounds (pos < cap) are checked on the host before the launch.
extern "C" __global__ void kv_write_f32(const float* k, const float* v, const u32* meta, int T, int kv_dim,
                                        const RowDesc* rows, int layer, int half) {
    df_kernel_begin();
    const int t = blockIdx.y;
    if (t >= T) return;
    const RowDesc rd = rows[meta[4 * t + META_ROW]];
    const size_t pos = meta[4 * t + META_POS];
    const u64 kd = kv_addr(rd.base, ((size_t)(2 * layer) * rd.cap + pos) * kv_dim, half);
    const u64 vd = kv_addr(rd.base, ((size_t)(2 * layer + 1) * rd.cap + pos) * kv_dim, half);
    const float* ks = k + (size_t)t * kv_dim;
    const float* vs = v + (size_t)t * kv_dim;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < kv_dim; c += gridDim.x * blockDim.x) {
        kv_put(kd, c, ks[c], half);
        kv_put(vd, c, vs[c], half);
    }
}

// Copies positions 0..len of every layer's K and V from one row layout to another (rows may
// have different capacities): used when a row grows and by kv_copy_row. Counted in u16 words,
// so one kernel copies either cache type: strides are cap * kv_dim values, len_words = len *
// kv_dim values, each times the words of a value (2 for f32, 1 for f16). blockIdx.y = 2*layer +
// (0 for K, 1 for V).
extern "C" __global__ void kv_copy(const u16* src, i64 src_stride, u16* dst, i64 dst_stride, i64 len_words) {
    df_kernel_begin();
    const i64 part = blockIdx.y;
    const u16* sp = src + part * src_stride;
    u16* dp = dst + part * dst_stride;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < len_words; i += (i64)gridDim.x * blockDim.x) {
        dp[i] = sp[i];
    }
}
