// dflash-rs CUDA kernels: softmax attention of each token's query heads over its own row's
// KV slice kv_start..kv_end (grouped-query: q head h reads kv head h / (n_heads/n_kv_heads)).
#include "common.cu"

// Block per (token, q head), ATT_WARPS warps. The visible keys are cut into tiles of 32 at
// fixed offsets from kv_start; warp w takes tiles w, w + ATT_WARPS, ... and keeps an online
// softmax state (running max m, running sum l, unnormalised output acc). For a tile:
//   1. lane j scores key (tile start + j): dot(q, k) walked in order with fma, times scale;
//   2. the tile max and the sum of exp(score - new max) use the fixed warp trees;
//   3. acc (lanes over head dimensions) is rescaled, then the 32 keys' values are added in
//      key order with fma.
// At the end the warps' states are merged in warp order. Every step depends only on the
// token's q, its KV slice and the constants here, never on the other tokens of the batch, so
// a token gets the same output alone (decode) or in a block (verify). Long contexts need no
// scratch: the state is O(head_dim) per warp.
#define ATT_WARPS 4
#define ATT_MAX_HD 256
#define ATT_PER_LANE (ATT_MAX_HD / 32)

extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32)
    attention_f32(const float* __restrict__ q, const u32* __restrict__ meta, const RowDesc* __restrict__ rows,
                  int layer, int T, int n_heads, int n_kv_heads, int head_dim, int kv_dim, float scale,
                  float* __restrict__ out) {
    __shared__ float qs[ATT_MAX_HD];
    __shared__ float st_m[ATT_WARPS];
    __shared__ float st_l[ATT_WARPS];
    __shared__ float st_acc[ATT_WARPS][ATT_MAX_HD];

    const int t = blockIdx.x;
    const int h = blockIdx.y;
    if (t >= T || h >= n_heads) return;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int q_cols = n_heads * head_dim;
    const int kvh = h / (n_heads / n_kv_heads);

    const u32 row = meta[4 * t + 0];
    const int start = (int)meta[4 * t + 2];
    const int end = (int)meta[4 * t + 3];
    const RowDesc rd = rows[row];
    const float* kb = (const float*)rd.base + (size_t)(2 * layer) * rd.cap * kv_dim + (size_t)kvh * head_dim;
    const float* vb = (const float*)rd.base + (size_t)(2 * layer + 1) * rd.cap * kv_dim + (size_t)kvh * head_dim;

    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = q[(size_t)t * q_cols + (size_t)h * head_dim + d];
    __syncthreads();

    // Keys are 16-byte aligned when every offset is a multiple of four floats (row storage
    // comes from cuMemAlloc).
    const bool vec4 = ((head_dim | kv_dim) & 3) == 0;

    float m = -DF_INF;
    float l = 0.0f;
    float acc[ATT_PER_LANE];
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; i++) acc[i] = 0.0f;

    for (int t0 = start + warp * 32; t0 < end; t0 += ATT_WARPS * 32) {
        const int j = t0 + lane;
        const bool valid = j < end;
        float sc = -DF_INF;
        if (valid) {
            const float* kr = kb + (size_t)j * kv_dim;
            float dot = 0.0f;
            if (vec4) {
                // Same order as the scalar loop, four values per load.
                const float4* k4 = (const float4*)kr;
                for (int d4 = 0; d4 < head_dim / 4; d4++) {
                    const float4 kk = k4[d4];
                    dot = __fmaf_rn(qs[4 * d4], kk.x, dot);
                    dot = __fmaf_rn(qs[4 * d4 + 1], kk.y, dot);
                    dot = __fmaf_rn(qs[4 * d4 + 2], kk.z, dot);
                    dot = __fmaf_rn(qs[4 * d4 + 3], kk.w, dot);
                }
            } else {
                for (int d = 0; d < head_dim; d++) dot = __fmaf_rn(qs[d], kr[d], dot);
            }
            sc = __fmul_rn(dot, scale);
        }
        const float mn = fmaxf(m, warp_max(sc));
        const float corr = expf(__fsub_rn(m, mn));
        const float p = valid ? expf(__fsub_rn(sc, mn)) : 0.0f;
        l = __fadd_rn(__fmul_rn(l, corr), warp_sum(p));
        m = mn;
#pragma unroll
        for (int i = 0; i < ATT_PER_LANE; i++) acc[i] = __fmul_rn(acc[i], corr);
        const int nk = min(32, end - t0);
        for (int kk = 0; kk < nk; kk++) {
            const float pk = __shfl_sync(DF_FULL_MASK, p, kk);
            const float* vr = vb + (size_t)(t0 + kk) * kv_dim;
#pragma unroll
            for (int i = 0; i < ATT_PER_LANE; i++) {
                const int d = lane + 32 * i;
                if (d < head_dim) acc[i] = __fmaf_rn(pk, vr[d], acc[i]);
            }
        }
    }

    if (lane == 0) {
        st_m[warp] = m;
        st_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < head_dim) st_acc[warp][d] = acc[i];
    }
    __syncthreads();

    // Merge the warps' states in warp order; warps that saw no key (l == 0) are skipped.
    float gm = -DF_INF;
    for (int w = 0; w < ATT_WARPS; w++) {
        if (st_l[w] > 0.0f) gm = fmaxf(gm, st_m[w]);
    }
    float gl = 0.0f;
    float f[ATT_WARPS];
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = st_l[w] > 0.0f ? expf(__fsub_rn(st_m[w], gm)) : 0.0f;
        gl = __fadd_rn(gl, __fmul_rn(st_l[w], f[w]));
    }
    const float inv = gl > 0.0f ? __fdiv_rn(1.0f, gl) : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) {
            if (f[w] != 0.0f) o = __fmaf_rn(st_acc[w][d], f[w], o);
        }
        out[(size_t)t * q_cols + (size_t)h * head_dim + d] = __fmul_rn(o, inv);
    }
}
