// dflash-rs CUDA kernels: f32-activation products of packed Q4_0, Q4_1 and Q8_0 weights (the
// output head; drafter weights in those formats) on TF32 tensor cores, x split in two terms.
//
// Pasted into matmul.cu after matmul_tc.cu, whose tf32_of and mma_tf32 it uses, with the
// packed quarter loaders of matmul.cu (`MmPart<DT + DT_PACKED>`); the kernels
// (`mmx2_<format>_<epilogue>`) are instantiated there.
//
// Which rows. Every row of such a product that is not a prompt row on the tensor-core
// prefill path (decode, verify, draft blocks, batched rows, any M): one kernel and one
// summation order for all of them, so a verify block's logits equal decode logits bit for bit.
//
// Numbers. A weight is code · d (Q4_0: code q - 8; Q8_0: the signed byte; Q4_1: q · d + m)
// with the code a small integer, exact in TF32. x is split into hi = tf32(x) and
// lo = tf32(x - hi) (x - hi is exact in f32), so hi + lo is within 2^-22 |x| of x. For each
// 32-value group and output (m, n), P = Σ code·hi + Σ code·lo over the group's four k-steps
// of 8 (per k-step the hi product, then the lo one, added by the MMA into one f32 fragment
// that starts at zero; products of TF32 values are exact), then acc = fma(d, P, acc); for
// Q4_1 also acc = fma(m, S, acc), S = Σ x over the group by the same MMAs with all-one
// weights. Groups run in increasing order. The result is within about
// (2^-22 + K·2^-23) · Σ_k |x_k w_k| of the exact product, as an f32 dot product on CUDA cores
// would be (tests/cuda_ops.rs checks it against the CPU); the order depends on K alone, not
// on M, the block or the tile.
//
// Tiles (PTX ISA, "mma.m16n8k8", .tf32): A = 16 weight rows by 8 k (the codes), B = 8 k by
// 8 rows of x, D = 16 weight rows by 8 rows of x. A warp owns X2_NT tiles of 16 weight rows;
// a block is X2_WARPS warps and X2_BM = 16 rows of x (blockIdx.y), one column tile of 8 for up
// to 8 rows and two from 9 (a row's bits do not depend on the column it takes: an MMA's
// output element depends on its row of A and column of B only). Lane (g = lane >> 2,
// t = lane & 3) loads quarter t of each group of weight rows g and g + 8 of every tile (one
// 4-byte code load for Q4, 8 bytes for Q8_0, and the scale) and x of row g of each column
// tile at the quarter's offsets xa(t) .. +4 and xb(t) .. +4; k-step s (0..3) of the group
// takes a0, a1 = codes xa(t) + s of rows g, g + 8, a2, a3 = codes xb(t) + s, and
// b0 = x at xa(t) + s, b1 = x at xb(t) + s (the k positions t and t + 4 of the fragment
// layout). The weight loads of X2_P groups are issued before their MMAs. Rows of x past M
// are zeros and weight rows past N repeat row N - 1; neither is stored.
//
// Needs sm_80 or later (TF32 MMA); below that the kernels are empty and the host never
// launches them (`Device::float_mma`).

// X2_WARPS, X2_NT and X2_BM are defined by the host (cuda/compile.rs, `shared_constants`).
#define X2_P 4  // groups whose weight loads are in flight together

#if __CUDA_ARCH__ >= 800

// hi = tf32(v), lo = tf32(v - hi).
__device__ __forceinline__ void tf32_split(float v, u32* hi, u32* lo) {
    *hi = tf32_of(v);
    *lo = tf32_of(__fsub_rn(v, __uint_as_float(*hi)));
}

template <int DT, int EPI>
__device__ __forceinline__ void mmx2_body(const MmParams& p) {
    constexpr bool MIN = DT == DT_Q4_1 + DT_PACKED;  // the minimum's term (Σ x per group)
    int si = 0;
#pragma unroll
    for (int k = 1; k < MM_SEGS; k++) {
        if (k < p.nseg && (int)blockIdx.x >= p.seg[k].block0) si = k;
    }
    const MmSeg& sg = p.seg[si];
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = (((int)blockIdx.x - sg.block0) * X2_WARPS + (threadIdx.x >> 5)) * 16 * X2_NT;
    if (n0 >= sg.n) {  // a whole warp leaves together
        df_kernel_begin();
        return;
    }
    const int m0 = (int)blockIdx.y * X2_BM;
    const int ml = min(X2_BM, p.m - m0);
    const int mts = ml > 8 ? 2 : 1;  // column tiles of 8 rows of x
    const int K = p.k;
    const int groups = K / GROUP;
    const float* __restrict__ x = (const float*)p.x;

    // rows[i][h]: weight row g + 8h of tile i
    const u8* rows[X2_NT][2];
#pragma unroll
    for (int i = 0; i < X2_NT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int n = min(n0 + 16 * i + 8 * h + g, sg.n - 1);
            rows[i][h] = (const u8*)sg.w + (size_t)n * sg.row_bytes;
        }
    const int xa = MmPart<DT>::xa(t);
    const int xb = MmPart<DT>::xb(t);
    df_kernel_begin();

    // acc[i][c][e]: tile i, column tile c, fragment element e (rows g, g, g + 8, g + 8 of the
    // tile; x rows 8c + 2t, 8c + 2t + 1, 8c + 2t, 8c + 2t + 1)
    float acc[X2_NT][2][4];
#pragma unroll
    for (int i = 0; i < X2_NT; i++)
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][c][e] = 0.0f;
    const u32 one = __float_as_uint(1.0f);
    const u32 ones[4] = {one, one, one, one};

    for (int g0 = 0; g0 < groups; g0 += X2_P) {
        MmPart<DT> part[X2_P][X2_NT][2];
#pragma unroll
        for (int q = 0; q < X2_P; q++) {
            if (g0 + q < groups) {
#pragma unroll
                for (int i = 0; i < X2_NT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) part[q][i][h].load(rows[i][h], g0 + q, t, groups);
            }
        }
#pragma unroll
        for (int q = 0; q < X2_P; q++) {
            const int gi = g0 + q;
            if (gi < groups) {
                // x of row g of each column tile at the quarter's offsets, split.
                u32 xh[2][8], xl[2][8];
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    if (c < mts) {
                        float4 va = make_float4(0.f, 0.f, 0.f, 0.f), vb = va;
                        if (8 * c + g < ml) {
                            const float* xr = x + (size_t)(m0 + 8 * c + g) * K + (size_t)gi * GROUP;
                            va = __ldg((const float4*)(xr + xa));
                            vb = __ldg((const float4*)(xr + xb));
                        }
                        const float v[8] = {va.x, va.y, va.z, va.w, vb.x, vb.y, vb.z, vb.w};
#pragma unroll
                        for (int k = 0; k < 8; k++) tf32_split(v[k], &xh[c][k], &xl[c][k]);
                    }
                }
                float part_sum[X2_NT][2][4];
                float xsum[2][4];
#pragma unroll
                for (int c = 0; c < 2; c++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        xsum[c][e] = 0.0f;
#pragma unroll
                        for (int i = 0; i < X2_NT; i++) part_sum[i][c][e] = 0.0f;
                    }
                float code[X2_NT][2][8];
#pragma unroll
                for (int i = 0; i < X2_NT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) part[q][i][h].codes(code[i][h]);
#pragma unroll
                for (int s = 0; s < 4; s++) {
#pragma unroll
                    for (int c = 0; c < 2; c++) {
                        if (c < mts) {
#pragma unroll
                            for (int i = 0; i < X2_NT; i++) {
                                const u32 a[4] = {__float_as_uint(code[i][0][s]), __float_as_uint(code[i][1][s]),
                                                  __float_as_uint(code[i][0][4 + s]),
                                                  __float_as_uint(code[i][1][4 + s])};
                                mma_tf32(part_sum[i][c], a, xh[c][s], xh[c][4 + s]);
                                mma_tf32(part_sum[i][c], a, xl[c][s], xl[c][4 + s]);
                            }
                            if (MIN) {
                                mma_tf32(xsum[c], ones, xh[c][s], xh[c][4 + s]);
                                mma_tf32(xsum[c], ones, xl[c][s], xl[c][4 + s]);
                            }
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < X2_NT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float d = part[q][i][h].scale();
#pragma unroll
                        for (int c = 0; c < 2; c++)
#pragma unroll
                            for (int e = 2 * h; e < 2 * h + 2; e++) {
                                float a = __fmaf_rn(d, part_sum[i][c][e], acc[i][c][e]);
                                if constexpr (MIN) a = __fmaf_rn(part[q][i][h].minimum(), xsum[c][e], a);
                                acc[i][c][e] = a;
                            }
                    }
            }
        }
    }

    float* out = (float*)sg.out;
#pragma unroll
    for (int i = 0; i < X2_NT; i++)
#pragma unroll
        for (int c = 0; c < 2; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = 8 * c + 2 * t + (e & 1);
                const int n = n0 + 16 * i + g + 8 * (e >> 1);
                if (m < ml && n < sg.n) {
                    mm_epilogue<EPI>(out + (size_t)(m0 + m) * sg.n + n, acc[i][c][e], acc[i][c][e]);
                }
            }
}

#else

template <int DT, int EPI>
__device__ __forceinline__ void mmx2_body(const MmParams& p) {
    df_kernel_begin();
}

#endif
