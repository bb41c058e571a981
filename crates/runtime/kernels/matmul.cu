// dflash-rs CUDA kernels: matrix products with weights in their stored format, and
// dequantization (embedding rows, and whole weights for the optional cuBLAS prefill path).
#include "common.cu"

// ---- out = x · Wᵀ ------------------------------------------------------------------------
//
// x: [M, K] f32 row-major, W: N rows of `row_bytes` bytes (K values as DT), out: [M, N].
//
// Summation order (what makes a row's result independent of M): the output (m, n) is owned
// by one warp. Lane l walks the groups g = l, l + 32, l + 64, ... of row n in increasing
// order; for each group it decodes the 32 weights and accumulates
//     acc = fma(w[j], x[m][32g + j], acc)    for j = 0..31,
// then the 32 lane sums are added by the xor butterfly of `warp_sum`. That order depends on
// K and the format only: not on M, on MT (rows of x per block), on R (weight rows per warp)
// nor on which block runs it. So decode (M = 1), verify blocks (M = 2..16) and prefill
// (M > 16, run as blocks of 16 rows of x) give bit-identical results for the same row of x.
//
// Block: 8 warps; each warp owns R consecutive weight rows, so a block covers 8*R rows of W
// and MT rows of x (blockIdx.y selects rows MT*blockIdx.y ..). x is staged through shared
// memory 32 groups (1024 values) at a time, each group padded to 33 floats so that the 32
// lanes (one group each) read distinct banks.
//
// Dynamic shared memory: MT * 32 * 33 * 4 bytes.

#define MM_WARPS 8
#define MM_CHUNK 32            // groups of x staged per step (one per lane)
#define MM_PAD 33              // floats per staged group
#define MM_XROW (MM_CHUNK * MM_PAD)

template <int DT, int MT, int R>
__device__ __forceinline__ void matmul_body(const u8* __restrict__ w, i64 row_bytes, int N, int K,
                                            const float* __restrict__ x, int M,
                                            float* __restrict__ out) {
    extern __shared__ float xs[];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * MM_WARPS + warp) * R;
    const int m0 = blockIdx.y * MT;
    const int ml = min(MT, M - m0);
    const int groups = K / GROUP;

    float acc[R][MT];
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int m = 0; m < MT; m++) acc[r][m] = 0.0f;
    }

    for (int c0 = 0; c0 < groups; c0 += MM_CHUNK) {
        const int gc = min(MM_CHUNK, groups - c0);
        const int vals = gc * GROUP;
        __syncthreads();
        for (int i = threadIdx.x; i < ml * vals; i += blockDim.x) {
            const int m = i / vals;
            const int v = i - m * vals;
            xs[m * MM_XROW + (v >> 5) * MM_PAD + (v & 31)] =
                x[(size_t)(m0 + m) * K + (size_t)c0 * GROUP + v];
        }
        __syncthreads();
        if (lane < gc) {
            const int g = c0 + lane;
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int n = n0 + r;
                if (n < N) {
                    float wv[GROUP];
                    decode_group<DT>(w + (size_t)n * row_bytes, g, wv);
#pragma unroll
                    for (int m = 0; m < MT; m++) {
                        if (m < ml) {
                            const float* xr = xs + m * MM_XROW + lane * MM_PAD;
                            float a = acc[r][m];
#pragma unroll
                            for (int j = 0; j < GROUP; j++) a = __fmaf_rn(wv[j], xr[j], a);
                            acc[r][m] = a;
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < R; r++) {
        const int n = n0 + r;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const float s = warp_sum(acc[r][m]);
            if (lane == 0 && n < N && m < ml) out[(size_t)(m0 + m) * N + n] = s;
        }
    }
}

// One kernel per (format, MT); R (weight rows per warp) is fixed by MT so that a warp keeps
// at most 16 accumulators: MT=1 -> R=4, MT=2 -> R=2, MT>=4 -> R=1.
#define MM_KERNEL(NAME, DT, MT, R)                                                        \
    extern "C" __global__ void __launch_bounds__(MM_WARPS * 32)                           \
        NAME(const u8* w, i64 row_bytes, int N, int K, const float* x, int M, float* out) { \
        matmul_body<DT, MT, R>(w, row_bytes, N, K, x, M, out);                            \
    }

#define MM_KERNELS(SUFFIX, DT)                 \
    MM_KERNEL(mm_##SUFFIX##_1, DT, 1, 4)       \
    MM_KERNEL(mm_##SUFFIX##_2, DT, 2, 2)       \
    MM_KERNEL(mm_##SUFFIX##_4, DT, 4, 1)       \
    MM_KERNEL(mm_##SUFFIX##_8, DT, 8, 1)       \
    MM_KERNEL(mm_##SUFFIX##_16, DT, 16, 1)

// ---- dequantization --------------------------------------------------------------------
//
// out[t] = row ids[t] of the table (or row row0 + t when ids is null), as f32; cols must be a
// whole number of groups. Block per output row, threads over groups. Bit-identical to
// quant::dequantize_row (same decoder).
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
        decode_group<DT>(row, g, wv);
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
        dequant_body<DT>(table, row_bytes, cols, ids, row0, T, out);                            \
    }

// Instantiations. The Rust side compiles this file once per format, with DF_MM_DTYPE set to
// that format's number, so that the formats compile in parallel and a model only waits for
// the ones it uses; without DF_MM_DTYPE every format is instantiated.
#define DF_FORMAT(SUFFIX, DT) \
    MM_KERNELS(SUFFIX, DT)    \
    DQ_KERNEL(SUFFIX, DT)

#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_F32
DF_FORMAT(f32, DT_F32)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_F16
DF_FORMAT(f16, DT_F16)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_BF16
DF_FORMAT(bf16, DT_BF16)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_Q4_0
DF_FORMAT(q4_0, DT_Q4_0)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_Q4_1
DF_FORMAT(q4_1, DT_Q4_1)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_Q8_0
DF_FORMAT(q8_0, DT_Q8_0)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_Q4K
DF_FORMAT(q4k, DT_Q4K)
#endif
#if !defined(DF_MM_DTYPE) || DF_MM_DTYPE == DT_Q6K
DF_FORMAT(q6k, DT_Q6K)
#endif
