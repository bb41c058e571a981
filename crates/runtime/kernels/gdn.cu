// dflash-rs CUDA kernels of the Gated DeltaNet layers (Qwen 3.5): causal conv with per-row
// windows, the gated delta rule token by token, gates, gated RMS norm, sigmoid gate, and the
// row copies the recurrent state needs (history recording, rollback, forks).
//
// Every row (span of tokens) and head is computed on its own, walking its tokens in order,
// so a row's result does not depend on the batch: a verify block equals the same tokens
// decoded one at a time, bit for bit. Formulas: crates/runtime/src/cpu/ops/gdn.rs (the CPU
// reference these kernels are tested against).
#include "common.cu"

// One row's share of a GDN op (backend::RowSpan plus the row's state addresses), as 9 u64.
struct GdnSpan {
    const float* conv_prev;   // conv window before the step ((K-1) x C, oldest first)
    float* conv_cur;          // conv window after it
    const float* state_prev;  // recurrent state before the step (v_heads x k_dim x v_dim)
    float* state_cur;         // after it
    const float* x;           // input rows: pre-conv qkv (conv), post-conv qkv (delta)
    const float* g;           // log decays (count x v_heads)
    const float* beta;        // write strengths (count x v_heads)
    float* out;               // output rows, or null (replay: state only)
    i64 count;                // tokens
};

// exp and sigmoid in double rounded to f32, as the other kernels (closest to the CPU's libm).
__device__ __forceinline__ float df_exp(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float df_silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, df_exp(-x))); }
__device__ __forceinline__ float df_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, df_exp(-x))); }

// ---- causal conv -------------------------------------------------------------------------
//
// grid (ceil(C / blockDim), spans); a thread owns one channel of one span and walks its
// tokens, keeping the last K inputs. out[t] = silu(sum_i w[c][i] * x[t - K + 1 + i]), the taps
// summed in order i = 0..K-1. The new window is the last K - 1 inputs. With no output
// (a rollback) only the window moves and `w` is not read.
#define GDN_MAX_K 8
extern "C" __global__ void gdn_conv_f32(const GdnSpan* spans, const float* w, int C, int K) {
    df_kernel_begin();
    const GdnSpan s = spans[blockIdx.y];
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int hist = K - 1;
    float win[GDN_MAX_K];
    for (int j = 0; j < hist; j++) win[j] = s.conv_prev[(i64)j * C + c];
    float wc[GDN_MAX_K];
    if (s.out) {
        for (int i = 0; i < K; i++) wc[i] = w[(i64)c * K + i];
    }
    for (i64 t = 0; t < s.count; t++) {
        const float xt = s.x[t * C + c];
        if (s.out) {
            float acc = 0.0f;
            for (int i = 0; i < hist; i++) acc = __fadd_rn(acc, __fmul_rn(wc[i], win[i]));
            acc = __fadd_rn(acc, __fmul_rn(wc[hist], xt));
            s.out[t * C + c] = df_silu(acc);
        }
        for (int j = 0; j + 1 < hist; j++) win[j] = win[j + 1];
        if (hist > 0) win[hist - 1] = xt;
    }
    for (int j = 0; j < hist; j++) s.conv_cur[(i64)j * C + c] = win[j];
}

// ---- gated delta rule, token by token -------------------------------------------------------
//
// grid (spans, v_heads), block dv threads: thread j owns column j of the head's state (k_dim
// values in registers). Per token: q and k of the head's q/k head are loaded to shared memory
// and L2-normalised by warp 0 (lane l sums i = l, l+32, ... in order, then a fixed xor
// butterfly), q scaled by k_dim^-1/2; then S[:,j] *= exp(g); kv = S[:,j]·k; d = (v_j - kv)β;
// S[:,j] += k d; o_j = S[:,j]·q (sums over i in order).
template <int DK>
__device__ void gdn_delta(const GdnSpan* spans, int k_heads, int v_heads, int dv, int tiled) {
    const GdnSpan s = spans[blockIdx.x];
    const int h = blockIdx.y;
    const int j = threadIdx.x;
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const int key_dim = k_heads * DK;
    const int C = 2 * key_dim + v_heads * dv;
    const i64 sl = (i64)DK * dv;
    __shared__ float qs[DK];
    __shared__ float ks[DK];
    __shared__ float norms[2];
    float st[DK];
    const float* sp = s.state_prev + h * sl;
    for (int i = 0; i < DK; i++) st[i] = sp[(i64)i * dv + j];
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn((float)DK));
    for (i64 t = 0; t < s.count; t++) {
        const float* row = s.x + t * C;
        __syncthreads();
        for (int i = j; i < DK; i += blockDim.x) {
            qs[i] = row[kh * DK + i];
            ks[i] = row[key_dim + kh * DK + i];
        }
        __syncthreads();
        if (j < 32) {
            float aq = 0.0f, ak = 0.0f;
            for (int i = j; i < DK; i += 32) {
                aq = __fadd_rn(aq, __fmul_rn(qs[i], qs[i]));
                ak = __fadd_rn(ak, __fmul_rn(ks[i], ks[i]));
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                aq = __fadd_rn(aq, __shfl_xor_sync(DF_FULL_MASK, aq, off));
                ak = __fadd_rn(ak, __shfl_xor_sync(DF_FULL_MASK, ak, off));
            }
            if (j == 0) {
                norms[0] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(aq, 1e-6f)));
                norms[1] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ak, 1e-6f)));
            }
        }
        __syncthreads();
        for (int i = j; i < DK; i += blockDim.x) {
            qs[i] = __fmul_rn(__fmul_rn(qs[i], norms[0]), scale);
            ks[i] = __fmul_rn(ks[i], norms[1]);
        }
        __syncthreads();
        if (j >= dv) continue;
        const float alpha = df_exp(s.g[t * v_heads + h]);
        const float beta = s.beta[t * v_heads + h];
        const float v = row[2 * key_dim + h * dv + j];
        float kv = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; i++) {
            st[i] = __fmul_rn(st[i], alpha);
            kv = __fadd_rn(kv, __fmul_rn(st[i], ks[i]));
        }
        const float d = __fmul_rn(__fsub_rn(v, kv), beta);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; i++) {
            st[i] = __fadd_rn(st[i], __fmul_rn(ks[i], d));
            o = __fadd_rn(o, __fmul_rn(st[i], qs[i]));
        }
        if (s.out) s.out[t * (i64)(v_heads * dv) + h * dv + j] = o;
    }
    if (j < dv) {
        float* sc = s.state_cur + h * sl;
        for (int i = 0; i < DK; i++) sc[(i64)i * dv + j] = st[i];
    }
}

#define GDN_DELTA(DK)                                                                            \
    extern "C" __global__ void gdn_delta_##DK(const GdnSpan* spans, int k_heads, int v_heads,    \
                                              int dv, int tiled) {                               \
        df_kernel_begin();                                                                       \
        gdn_delta<DK>(spans, k_heads, v_heads, dv, tiled);                                       \
    }
GDN_DELTA(16)
GDN_DELTA(32)
GDN_DELTA(64)
GDN_DELTA(128)
GDN_DELTA(256)

// ---- gates, gated norm, sigmoid gate ---------------------------------------------------------

// a <- a_neg * softplus(a + dt_bias) (softplus linear above 20, as torch); b <- sigmoid(b).
extern "C" __global__ void gdn_gates_f32(float* a, float* b, const float* a_neg, const float* dt_bias,
                                         i64 n, int hv) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int h = (int)(i % hv);
        const float x = __fadd_rn(a[i], dt_bias[h]);
        const float sp = x > 20.0f ? x : (float)log1p(exp((double)x));
        a[i] = __fmul_rn(a_neg[h], sp);
        b[i] = df_sigmoid(b[i]);
    }
}

// x <- rms_norm(x) * w * silu(z) over groups of dim values: one warp per group, lane l sums
// i = l, l+32, ... in order, then a fixed xor butterfly.
extern "C" __global__ void gdn_rms_norm_gated_f32(float* x, const float* z, const float* w, i64 groups,
                                                  int dim, float eps) {
    df_kernel_begin();
    const int lane = threadIdx.x & 31;
    const i64 grp = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
    const bool live = grp < groups;
    float* xs = x + (live ? grp : 0) * (i64)dim;
    const float* zs = z + (live ? grp : 0) * (i64)dim;
    float acc = 0.0f;
    if (live) {
        for (int i = lane; i < dim; i += 32) acc = __fadd_rn(acc, __fmul_rn(xs[i], xs[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(DF_FULL_MASK, acc, off));
    if (!live) return;
    const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(acc, (float)dim), eps)));
    for (int i = lane; i < dim; i += 32) {
        xs[i] = __fmul_rn(__fmul_rn(w[i], __fmul_rn(xs[i], inv)), df_silu(zs[i]));
    }
}

// x[i] *= sigmoid(gate[i])
extern "C" __global__ void gdn_sigmoid_mul_f32(float* x, const float* gate, i64 n) {
    df_kernel_begin();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        x[i] = __fmul_rn(x[i], df_sigmoid(gate[i]));
    }
}

// ---- row copies ------------------------------------------------------------------------------
//
// copies[k] = (src, dst, n floats); grid (blocks, copies). Records the step's inputs into the
// rows' histories, restores checkpoints and copies rows for forks.
extern "C" __global__ void gdn_copy_f32(const i64* copies) {
    df_kernel_begin();
    const float* src = (const float*)copies[3 * blockIdx.y];
    float* dst = (float*)copies[3 * blockIdx.y + 1];
    const i64 n = copies[3 * blockIdx.y + 2];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}
