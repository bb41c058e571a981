// dflash-rs CUDA kernels: out = x · Wᵀ for prompt (prefill) rows on tensor cores.
//
// Pasted into matmul.cu after the weight loaders (`MmPart`), whose loads and decoders it
// reuses; the kernels themselves (`mmtc_<format>_<epilogue>`) are instantiated there.
//
// Which rows. Only rows the model marks as prompt tokens come here (`Backend::step_matmul_*`
// with `RowSpan::prompt`); decode and verify rows keep the CUDA-core kernel of matmul.cu. A
// prompt row's result depends on that row of x, W and K only (not on M, on its place in the
// tile or on the other rows), so a prompt gives the same bits whole or cut into pieces that
// ride in other rows' steps.
//
// Precision: TF32 (`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`). Weights are decoded
// to f32 by the exact decoders of matmul.cu, then both operands are rounded to TF32 with
// `cvt.rna.tf32.f32` (10 explicit mantissa bits, round to nearest, ties away; the f32
// exponent range), and the products are accumulated in f32. Why TF32 rather than bf16/f16:
// TF32 keeps f32's range, so activations of any size (massive activations, a down
// projection's input) neither overflow nor flush to zero and no per-row scaling pass is
// needed (f16 would need one); it is 8x finer than bf16 (unit roundoff 2^-11 against 2^-8),
// and stored f16 and bf16 weights are exact in it. The cost, half the bf16 MMA rate, does not
// matter here: these products are bound by loading and decoding the weights, not by the MMA.
// Error: |tc - exact| <= (2^-10 + K·2^-22) · Σ_k |x_k w_k| (two roundings of 2^-11 per
// product, f32 accumulation); tests/cuda_ops.rs checks this bound.
//
// Tiles. A block (4 warps) computes TC_BM = 64 rows of x by TC_BN = 32 weight rows; warp w
// owns rows 32·(w / 2) .. +32 and weight rows 16·(w % 2) .. +16 as 2 x 2 MMA tiles of 16 x 8.
// K is walked in tiles of TC_BK = 64 values (two 32-value groups; the last tile of a K that
// is an odd number of groups holds one): every tile's x and weights are staged in shared
// memory as TF32, then the warp runs the tile's k-steps of 8 in order.
//
// Summation order (what makes a row independent of M): output (m, n) is one f32 accumulator
// that mma adds k-steps 0..8, 8..16, ... of K into, in increasing order; each mma adds its 8
// products to it the same way for every position in the tile. The order depends on K only.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32 layouts). With
// g = lane >> 2 and t = lane & 3:
//   A (16 x 8, row-major; x rows by k):  a0 = (g, t)   a1 = (g + 8, t)
//                                        a2 = (g, t + 4)   a3 = (g + 8, t + 4)
//   B (8 x 8, k by n; weight row n = column n): b0 = (k = t, n = g)   b1 = (k = t + 4, n = g)
//   C/D (16 x 8, f32):                   c0 = (g, 2t)   c1 = (g, 2t + 1)
//                                        c2 = (g + 8, 2t)   c3 = (g + 8, 2t + 1)
// Shared memory holds x as [row][k] and W as [weight row][k], both with a row stride of
// TC_LD = 68 words: lanes (g, t) read word 68·g + t + const, i.e. bank (4g + t) mod 32, all
// 32 distinct, so fragment loads are free of bank conflicts; rows stay 16-byte aligned
// (272 bytes) for the 16-byte stores.
//
// Loads. Per tile a thread loads 8 float4 of x (16 consecutive threads read 256 contiguous
// bytes of one row) and 2 weight quarters per weight (`MmPart::load`: quarter s of one
// 32-value group of one row). The next tile's loads are issued before the current tile's
// MMAs, so their latency hides behind them. Rows of x past M re-read row M - 1 and weight
// rows past N re-read row N - 1; neither is stored.
//
// Needs sm_80 or later (TF32 MMA); below that the kernels are empty and the host never
// launches them (`Device::tensor_cores`).

// TC_BM (64), TC_BN (32) and TC_THREADS (128) are defined by the host (cuda/compile.rs,
// `shared_constants`).
#define TC_BK 64
#define TC_LD (TC_BK + 4)
// float4 of x and weight quarters per thread and tile
#define TC_XV (TC_BM * TC_BK / 4 / TC_THREADS)
#define TC_WP (TC_BN * (TC_BK / GROUP) * 4 / TC_THREADS)

#if __CUDA_ARCH__ >= 800

// f32 -> TF32 (bits of an f32 whose 13 low mantissa bits are zero), round to nearest.
__device__ __forceinline__ u32 tf32_of(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
    return r;
}

// d += A · B for one 16 x 8 x 8 tile (fragments as in the header).
__device__ __forceinline__ void mma_tf32(float* d, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One tile's global data, held in registers between its load and its store to shared memory.
template <int DT, int W>
struct TcStage {
    float4 x[TC_XV];
    MmPart<DT> w[TC_WP][W];
};

// Element i (0..TC_XV) of a thread's x share: row and float4 column of the tile.
__device__ __forceinline__ int tc_x_row(int tid, int i) { return (tid + TC_THREADS * i) >> 4; }
__device__ __forceinline__ int tc_x_c4(int tid, int i) { return (tid + TC_THREADS * i) & 15; }
// Weight quarter i (0..TC_WP) of a thread: row of the tile, group of the tile (0, 1), quarter.
__device__ __forceinline__ int tc_w_row(int tid, int i) { return (tid + TC_THREADS * i) >> 3; }
__device__ __forceinline__ int tc_w_grp(int tid, int i) { return ((tid + TC_THREADS * i) >> 2) & 1; }
__device__ __forceinline__ int tc_w_qtr(int tid, int i) { return (tid + TC_THREADS * i) & 3; }

// Issues the loads of the K tile starting at k0.
template <int DT, int W>
__device__ __forceinline__ void tc_load(TcStage<DT, W>& st, const float* __restrict__ x, int K, int M, int m0,
                                        const u8* const (&wrow)[TC_WP][W], int k0, int tid) {
#pragma unroll
    for (int i = 0; i < TC_XV; i++) {
        const int col = k0 + 4 * tc_x_c4(tid, i);
        const int row = min(m0 + tc_x_row(tid, i), M - 1);
        st.x[i] = col < K ? __ldg((const float4*)(x + (size_t)row * K + col)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int groups = K / GROUP;
#pragma unroll
    for (int i = 0; i < TC_WP; i++) {
        const int g = k0 / GROUP + tc_w_grp(tid, i);
        if (g < groups) {
#pragma unroll
            for (int v = 0; v < W; v++) st.w[i][v].load(wrow[i][v], g, tc_w_qtr(tid, i), groups);
        }
    }
}

// Decodes a loaded tile (k0 as given to tc_load) and stores it in shared memory as TF32.
template <int DT, int W>
__device__ __forceinline__ void tc_store(const TcStage<DT, W>& st, u32* xs, u32 (*ws)[TC_BN * TC_LD], int K, int k0,
                                         int tid) {
#pragma unroll
    for (int i = 0; i < TC_XV; i++) {
        const float4 v = st.x[i];
        *(uint4*)(xs + tc_x_row(tid, i) * TC_LD + 4 * tc_x_c4(tid, i)) =
            make_uint4(tf32_of(v.x), tf32_of(v.y), tf32_of(v.z), tf32_of(v.w));
    }
    const int groups = K / GROUP;
#pragma unroll
    for (int i = 0; i < TC_WP; i++) {
        const int gi = tc_w_grp(tid, i);
        if (k0 / GROUP + gi < groups) {
            const int s = tc_w_qtr(tid, i);
            const int base = tc_w_row(tid, i) * TC_LD + GROUP * gi;
#pragma unroll
            for (int v = 0; v < W; v++) {
                float w[8];
                st.w[i][v].decode(w);
                *(uint4*)(ws[v] + base + MmPart<DT>::xa(s)) =
                    make_uint4(tf32_of(w[0]), tf32_of(w[1]), tf32_of(w[2]), tf32_of(w[3]));
                *(uint4*)(ws[v] + base + MmPart<DT>::xb(s)) =
                    make_uint4(tf32_of(w[4]), tf32_of(w[5]), tf32_of(w[6]), tf32_of(w[7]));
            }
        }
    }
}

template <int DT, int EPI>
__device__ __forceinline__ void mmtc_body(const MmParams& p) {
    constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;
    __shared__ __align__(16) u32 xs[TC_BM * TC_LD];
    __shared__ __align__(16) u32 ws[W][TC_BN * TC_LD];

    const int si = mm_segment(p);
    const MmSeg& sg = p.seg[si];
    const int n0 = ((int)blockIdx.x - sg.block0) * TC_BN;
    if (n0 >= sg.n) return;  // the whole block leaves, before any barrier
    const int m0 = (int)blockIdx.y * TC_BM;
    const int K = p.k;
    const int M = p.m;
    const float* x = (const float*)p.x;

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int wm = (warp >> 1) * 32;  // the warp's first row of the tile
    const int wn = (warp & 1) * 16;   // and first weight row

    const u8* wrow[TC_WP][W];
#pragma unroll
    for (int i = 0; i < TC_WP; i++) {
        const int n = min(n0 + tc_w_row(tid, i), sg.n - 1);
        wrow[i][0] = (const u8*)sg.w + (size_t)n * sg.row_bytes;
        if (W == 2) wrow[i][W - 1] = (const u8*)sg.w2 + (size_t)n * sg.row_bytes;
    }

    // acc[v][i][j]: weight v, MMA row tile i (rows wm + 16i ..), column tile j (wn + 8j ..)
    float acc[W][2][2][4];
#pragma unroll
    for (int v = 0; v < W; v++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[v][i][j][e] = 0.0f;

    TcStage<DT, W> st;
    tc_load<DT, W>(st, x, K, M, m0, wrow, 0, tid);
    for (int k0 = 0; k0 < K; k0 += TC_BK) {
        tc_store<DT, W>(st, xs, ws, K, k0, tid);
        __syncthreads();
        if (k0 + TC_BK < K) tc_load<DT, W>(st, x, K, M, m0, wrow, k0 + TC_BK, tid);
        const int kn = min(TC_BK, K - k0);  // 32 or 64, the same for every thread
#pragma unroll
        for (int kk = 0; kk < TC_BK; kk += 8) {
            if (kk < kn) {
                u32 a[2][4];
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    const u32* r = xs + (wm + 16 * i + g) * TC_LD + kk + t;
                    a[i][0] = r[0];
                    a[i][1] = r[8 * TC_LD];
                    a[i][2] = r[4];
                    a[i][3] = r[8 * TC_LD + 4];
                }
#pragma unroll
                for (int v = 0; v < W; v++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const u32* r = ws[v] + (wn + 8 * j + g) * TC_LD + kk + t;
                        const u32 b0 = r[0];
                        const u32 b1 = r[4];
#pragma unroll
                        for (int i = 0; i < 2; i++) mma_tf32(acc[v][i][j], a[i], b0, b1);
                    }
            }
        }
        __syncthreads();  // every warp is done with the tile before the next one is stored
    }

    float* out = (float*)sg.out;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + wm + 16 * i + g + (e >> 1) * 8;
                const int n = n0 + wn + 8 * j + 2 * t + (e & 1);
                if (m < M && n < sg.n) {
                    mm_epilogue<EPI>(out + (size_t)m * sg.n + n, acc[0][i][j][e], acc[W - 1][i][j][e]);
                }
            }
}

#else

template <int DT, int EPI>
__device__ __forceinline__ void mmtc_body(const MmParams& p) {}

#endif
