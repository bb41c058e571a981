// dflash-rs CUDA kernels of the Gated DeltaNet layers (Qwen 3.5): causal conv with per-row
// windows, the gated delta rule token by token and in chunks, gates, gated RMS norm, sigmoid
// gate, and the row copies the recurrent state needs (history recording, rollback, forks).
//
// Every row (span of tokens) and head is computed on its own, walking its tokens in order,
// so a row's result does not depend on the batch: a verify block equals the same tokens
// decoded one at a time, bit for bit. Prefill spans marked chunked run the chunked form of
// the gated delta rule instead (gdn_chunk_*). Formulas: crates/runtime/src/cpu/ops/gdn.rs
// (the CPU reference these kernels are tested against).
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
// GDN_MAX_K (8) is defined by the host (cuda/compile.rs, `shared_constants`).
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

// ---- gated delta rule, chunked form (prefill spans) -------------------------------------------
//
// The CPU's chunked form (cpu/ops/gdn.rs `delta_chunked`) with the same formula and the same
// order of every sum, so that the GPU and the CPU round alike (only exp may differ by an ulp:
// the CPU's expf against exp in double rounded to f32 here). Chunks of GDN_CHUNK tokens from
// the span's first token; per chunk of m tokens, with γ the cumulative log decay:
//   L[i][l] = (β_i (k_i·k_l)) e^{γ_i-γ_l} (l < i); T = (I + L)^-1 by substitution;
//   U = T diag(β) V, W = T diag(β e^γ) K; V_new = U - W S;
//   O_i = Σ_a (q_ia e^{γ_i}) S_a + Σ_{j<=i} ((q_i·k_j) e^{γ_i-γ_j}) V_new_j;
//   S <- e^{γ_last} S + Σ_j (k_j e^{γ_last-γ_j}) V_new_jᵀ.
// Dots over k_dim use the CPU's order (`dot`: 16 running sums, sum l taking i = l, l+16, ...,
// then the halving tree 8, 4, 2, 1): one thread per pair for the q·k and k·k products, a
// half-warp (one running sum per lane, the tree by xor shuffles) for the L2 norms; every
// other sum runs in index order in one thread.
//
// grid (spans, v_heads, ceil(dv / GDN_CT)), GDN_CTHREADS threads: a block owns GDN_CT columns
// of one head's state (in shared memory for the whole span) and recomputes the chunk's T, W
// and q·k products, which do not depend on the columns. Shared memory (floats):
// 2 C (DK + 1) (q, k; rows padded against bank conflicts) + C DK (W) + 2 C C + C CT (v, then
// V_new) + DK CT (state) + 4 C (gates): 154 KiB for DK = 128 (`chunk_smem_bytes` in
// cuda/gdn.rs).
// GDN_CHUNK (64), GDN_CT (32) and GDN_CTHREADS (256) are defined by the host
// (cuda/compile.rs, `shared_constants`).

// The launch parameters (`GdnChunkParams` in cuda/gdn.rs).
struct GdnChunkParams {
    const GdnSpan* spans;
    int k_heads;
    int v_heads;
    int dv;
    int tiled;
};

// a·b over DK values in the CPU's order, in one thread.
template <int DK>
__device__ __forceinline__ float df_dot_seq(const float* a, const float* b) {
    float acc[16];
#pragma unroll
    for (int l = 0; l < 16; l++) acc[l] = 0.0f;
#pragma unroll
    for (int c = 0; c < DK / 16; c++) {
#pragma unroll
        for (int l = 0; l < 16; l++) acc[l] = __fadd_rn(acc[l], __fmul_rn(a[16 * c + l], b[16 * c + l]));
    }
#pragma unroll
    for (int l = 0; l < 8; l++) acc[l] = __fadd_rn(acc[l], acc[l + 8]);
#pragma unroll
    for (int l = 0; l < 4; l++) acc[l] = __fadd_rn(acc[l], acc[l + 4]);
    acc[0] = __fadd_rn(acc[0], acc[2]);
    acc[1] = __fadd_rn(acc[1], acc[3]);
    return __fadd_rn(acc[0], acc[1]);
}

// a·b over DK values in the CPU's order, on the 16 lanes of a half-warp (lane16 = lane & 15);
// every lane returns the sum. All 32 lanes of the warp must call it together.
template <int DK>
__device__ __forceinline__ float df_dot16(const float* a, const float* b, int lane16) {
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < DK / 16; c++) acc = __fadd_rn(acc, __fmul_rn(a[16 * c + lane16], b[16 * c + lane16]));
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(DF_FULL_MASK, acc, off));
    return acc;
}

// The pair (i, j), 0 <= j < i, of index p = i (i - 1) / 2 + j (row-major strict lower triangle).
__device__ __forceinline__ void df_tri(int p, int* i, int* j) {
    int r = (int)((1.0f + sqrtf(1.0f + 8.0f * (float)p)) * 0.5f);
    while (r * (r - 1) / 2 > p) r--;
    while ((r + 1) * r / 2 <= p) r++;
    *i = r;
    *j = p - r * (r - 1) / 2;
}

template <int DK>
__device__ void gdn_chunk(const GdnChunkParams& p) {
    constexpr int C = GDN_CHUNK;
    constexpr int CT = GDN_CT;
    constexpr int RPT = C * CT / GDN_CTHREADS;  // (token, column) elements per thread
    constexpr int KS = DK + 1;                   // row stride of q and k
    extern __shared__ float sm[];
    float* qs = sm;               // C x KS: normalised, scaled q
    float* ks = qs + C * KS;      // C x KS: normalised k
    float* ws = ks + C * KS;      // C x DK: W
    float* m1 = ws + C * DK;      // C x C: L, then diag(β e^γ) factors, then q·k products
    float* m2 = m1 + C * C;       // C x C: the substitution's sums, then T diag(β)
    float* vs = m2 + C * C;       // C x CT: v, then V_new
    float* ss = vs + C * CT;      // DK x CT: the state's columns
    float* gam = ss + DK * CT;    // C: γ
    float* eg = gam + C;          // C: e^γ
    float* ed = eg + C;           // C: e^{γ_last - γ}
    float* bt = ed + C;           // C: β

    const GdnSpan s = p.spans[blockIdx.x];
    const int h = blockIdx.y;
    const int col0 = blockIdx.z * CT;
    const int tid = threadIdx.x;
    const int lane16 = tid & 15;
    const int hw = tid >> 4;
    const int cx = tid & 31;
    const int ry = tid >> 5;
    const int ncol = min(CT, p.dv - col0);
    const int kh = p.tiled ? h % p.k_heads : h / (p.v_heads / p.k_heads);
    const int key_dim = p.k_heads * DK;
    const int vd = p.v_heads * p.dv;
    const i64 xc = 2 * (i64)key_dim + vd;
    const i64 sl = (i64)DK * p.dv;
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn((float)DK));

    for (int e = tid; e < DK * CT; e += GDN_CTHREADS) {
        const int a = e / CT, x = e % CT;
        ss[e] = x < ncol ? s.state_prev[h * sl + (i64)a * p.dv + col0 + x] : 0.0f;
    }
    for (i64 c0 = 0; c0 < s.count; c0 += C) {
        const int m = (int)min((i64)C, s.count - c0);
        __syncthreads();
        // q and k of the chunk's tokens, one half-warp per token (C is a multiple of 16, so
        // both halves of a warp run the loop equally often).
        for (int i = hw; i < C; i += GDN_CTHREADS / 16) {
            const bool live = i < m;
            const float* row = s.x + (c0 + (live ? i : 0)) * xc;
            float* q = qs + i * KS;
            float* k = ks + i * KS;
            for (int a = lane16; a < DK; a += 16) {
                q[a] = live ? row[kh * DK + a] : 0.0f;
                k[a] = live ? row[key_dim + kh * DK + a] : 0.0f;
            }
            const float iq = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(df_dot16<DK>(q, q, lane16), 1e-6f)));
            const float ik = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(df_dot16<DK>(k, k, lane16), 1e-6f)));
            for (int a = lane16; a < DK; a += 16) {
                q[a] = __fmul_rn(__fmul_rn(q[a], iq), scale);
                k[a] = __fmul_rn(k[a], ik);
            }
        }
        // Gates: thread i sums g over the chunk in order (γ_i on the way, γ_last at the end).
        if (tid < m) {
            float acc = 0.0f, gi = 0.0f;
            for (int j = 0; j < m; j++) {
                acc = __fadd_rn(acc, s.g[(c0 + j) * p.v_heads + h]);
                if (j == tid) gi = acc;
            }
            gam[tid] = gi;
            eg[tid] = df_exp(gi);
            ed[tid] = df_exp(__fsub_rn(acc, gi));
            bt[tid] = s.beta[(c0 + tid) * p.v_heads + h];
        }
        for (int e = tid; e < C * CT; e += GDN_CTHREADS) {
            const int i = e / CT, x = e % CT;
            vs[e] = (i < m && x < ncol) ? s.x[(c0 + i) * xc + 2 * key_dim + h * p.dv + col0 + x] : 0.0f;
        }
        __syncthreads();
        // L (strict lower triangle) into m1 and m2, one thread per pair.
        const int nl = m * (m - 1) / 2;
        for (int pi = tid; pi < nl; pi += GDN_CTHREADS) {
            int i, l;
            df_tri(pi, &i, &l);
            const float d = df_dot_seq<DK>(ks + i * KS, ks + l * KS);
            const float v = __fmul_rn(__fmul_rn(bt[i], d), df_exp(__fsub_rn(gam[i], gam[l])));
            m1[i * C + l] = v;
            m2[i * C + l] = v;
        }
        __syncthreads();
        // Forward substitution, right-looking: at step l every sum of row i > l, column j < l
        // takes its term l, so each sum still adds its terms in increasing l from L[i][j]
        // (the CPU's order): sum += L[i][l] t[l][j] with t[l][j] = -sum[l][j], final by now.
        for (int l = 1; l + 1 < m; l++) {
            const int cnt = l * (m - 1 - l);
            for (int e = tid; e < cnt; e += GDN_CTHREADS) {
                const int i = l + 1 + e / l, j = e % l;
                m2[i * C + j] = __fadd_rn(m2[i * C + j], __fmul_rn(m1[i * C + l], -m2[l * C + j]));
            }
            __syncthreads();
        }
        // m2 <- T diag(β) (t = -sum below the diagonal, 1 on it); m1 <- that times e^γ_j.
        for (int e = tid; e < m * C; e += GDN_CTHREADS) {
            const int i = e / C, j = e % C;
            if (j > i) continue;
            const float t = j < i ? -m2[e] : 1.0f;
            const float cb = __fmul_rn(t, bt[j]);
            m2[e] = cb;
            m1[e] = __fmul_rn(cb, eg[j]);
        }
        __syncthreads();
        // W = T diag(β e^γ) K; U = T diag(β) V (this thread's elements, in registers).
        for (int e = tid; e < m * DK; e += GDN_CTHREADS) {
            const int i = e / DK, a = e % DK;
            float acc = 0.0f;
            for (int j = 0; j <= i; j++) acc = __fadd_rn(acc, __fmul_rn(m1[i * C + j], ks[j * KS + a]));
            ws[e] = acc;
        }
        float u[RPT];
#pragma unroll
        for (int r = 0; r < RPT; r++) {
            const int i = ry + r * (GDN_CTHREADS / CT);
            float acc = 0.0f;
            if (i < m) {
                for (int j = 0; j <= i; j++) acc = __fadd_rn(acc, __fmul_rn(m2[i * C + j], vs[j * CT + cx]));
            }
            u[r] = acc;
        }
        __syncthreads();
        // V_new = U - W S into vs (the thread's RPT sums side by side, each over a in order;
        // rows past m read W's stale rows and are not stored); the q·k products into m1.
        for (int a = 0; a < DK; a++) {
            const float sv = ss[a * CT + cx];
#pragma unroll
            for (int r = 0; r < RPT; r++) {
                const int i = ry + r * (GDN_CTHREADS / CT);
                u[r] = __fsub_rn(u[r], __fmul_rn(ws[i * DK + a], sv));
            }
        }
#pragma unroll
        for (int r = 0; r < RPT; r++) {
            const int i = ry + r * (GDN_CTHREADS / CT);
            if (i < m) vs[i * CT + cx] = u[r];
        }
        const int na = m * (m + 1) / 2;
        for (int pi = tid; pi < na; pi += GDN_CTHREADS) {
            int i, j;
            df_tri(pi, &i, &j);
            i -= 1;  // index over the lower triangle with its diagonal
            const float d = df_dot_seq<DK>(qs + i * KS, ks + j * KS);
            m1[i * C + j] = __fmul_rn(d, df_exp(__fsub_rn(gam[i], gam[j])));
        }
        __syncthreads();
        // Outputs of this block's columns: the state term (RPT sums side by side), then the
        // chunk's own term.
        float o[RPT];
#pragma unroll
        for (int r = 0; r < RPT; r++) o[r] = 0.0f;
        for (int a = 0; a < DK; a++) {
            const float sv = ss[a * CT + cx];
#pragma unroll
            for (int r = 0; r < RPT; r++) {
                const int i = ry + r * (GDN_CTHREADS / CT);
                o[r] = __fadd_rn(o[r], __fmul_rn(__fmul_rn(qs[i * KS + a], eg[i]), sv));
            }
        }
#pragma unroll
        for (int r = 0; r < RPT; r++) {
            const int i = ry + r * (GDN_CTHREADS / CT);
            if (i < m && cx < ncol) {
                float acc = o[r];
                for (int j = 0; j <= i; j++) acc = __fadd_rn(acc, __fmul_rn(m1[i * C + j], vs[j * CT + cx]));
                if (s.out) s.out[(c0 + i) * vd + h * p.dv + col0 + cx] = acc;
            }
        }
        __syncthreads();
        // The state at the chunk's end: element (a, cx) for a = ry, ry + 8, ... (DK / 8 sums
        // side by side, each over j in order).
        constexpr int SPT = DK * CT / GDN_CTHREADS;
        const float decay = eg[m - 1];
        float st[SPT];
#pragma unroll
        for (int r = 0; r < SPT; r++) st[r] = __fmul_rn(ss[(ry + r * (GDN_CTHREADS / CT)) * CT + cx], decay);
        for (int j = 0; j < m; j++) {
            const float vj = vs[j * CT + cx];
            const float dj = ed[j];
#pragma unroll
            for (int r = 0; r < SPT; r++) {
                const int a = ry + r * (GDN_CTHREADS / CT);
                st[r] = __fadd_rn(st[r], __fmul_rn(__fmul_rn(ks[j * KS + a], dj), vj));
            }
        }
#pragma unroll
        for (int r = 0; r < SPT; r++) ss[(ry + r * (GDN_CTHREADS / CT)) * CT + cx] = st[r];
    }
    __syncthreads();
    for (int e = tid; e < DK * CT; e += GDN_CTHREADS) {
        const int a = e / CT, x = e % CT;
        if (x < ncol) s.state_cur[h * sl + (i64)a * p.dv + col0 + x] = ss[e];
    }
}

#define GDN_CHUNK_DK(DK)                                                                         \
    extern "C" __global__ void __launch_bounds__(GDN_CTHREADS, 1)                               \
        gdn_chunk_##DK(const GdnChunkParams p) {                                                 \
        df_kernel_begin();                                                                       \
        gdn_chunk<DK>(p);                                                                        \
    }
GDN_CHUNK_DK(16)
GDN_CHUNK_DK(32)
GDN_CHUNK_DK(64)
GDN_CHUNK_DK(128)

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
