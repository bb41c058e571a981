// dflash-rs CUDA kernels: the output head (f32 activations) of packed Q4_0, Q4_1 and Q8_0
// weights on TF32 tensor cores, x split in two terms.
//
// Pasted into matmul.cu after matmul_qtc.cu (formats with packed layouts only): it uses
// tf32_of and mma_tf32 (matmul_tc.cu), cp_async16 and cp_async_commit/wait (matmul_qtc.cu), the
// packed decoders' `codes` and `scale` (MmPart) and mm_epilogue; the kernels
// (`mmx2_<format>_<epilogue>_<MT>`) are instantiated there.
//
// Which rows. Every row of a product by such a weight (uploaded as the vocabulary projection,
// `CudaWeight::float_mma`) that is not a prompt row on the tensor-core prefill path: decode,
// verify, draft blocks, batched rows, any M. One kernel and one summation order for all of
// them, so a verify block's logits equal decode logits bit for bit.
//
// Numbers. A weight is code · d (Q4_0: code q - 8; Q8_0: the signed byte; Q4_1: q · d + m)
// with the code a small integer, exact in TF32. x is split into hi = x rounded to TF32 and
// lo = x - hi (exact in f32; the MMA reads it truncated to TF32), so the MMA sees x within
// 2^-21 |x|. For each
// 32-value group and output (m, n), P = Σ code·hi + Σ code·lo: the group's four k-steps of 8
// added by the MMA into an f32 fragment that starts at zero, one fragment for the hi products
// and one for the lo ones (products of TF32 values are exact), the two then added; then
// acc = fma(d, P, acc); for Q4_1 also acc = fma(m, S, acc), S = Σ x over the group by the
// same MMAs with all-one weights. Groups run in increasing order. The result is within about
// (2^-21 + K·2^-23) · Σ_k |x_k w_k| of the exact product, as an f32 dot product on CUDA cores
// would be (tests/cuda_ops.rs checks it against the CPU); the order depends on K alone, not
// on M, the block or the tile.
//
// Tiles (PTX ISA, "mma.m16n8k8", .tf32): A = 16 weight rows by 8 k (the codes), B = 8 k by
// 8 rows of x, D = 16 weight rows by 8 rows of x. A warp owns X2_NT tiles of 16 weight rows;
// a block is X2_WARPS warps and X2_BM = 16 rows of x (blockIdx.y) as MT column tiles of 8
// (MT = 1 for up to 8 rows, 2 above; a row's bits do not depend on the column it takes: an
// MMA's output element depends on its row of A and column of B only). Lane (g = lane >> 2,
// t = lane & 3) takes quarter t of each group of weight rows g and g + 8 of every tile (code
// bytes 4t.. for Q4, 8t.. for Q8_0, and the scale) and x of row g of each column tile at the
// quarter's offsets xa(t) .. +4 and xb(t) .. +4; k-step s (0..3) of the group takes
// a0, a1 = codes xa(t) + s of rows g, g + 8, a2, a3 = codes xb(t) + s, and b0 = x at
// xa(t) + s, b1 = x at xb(t) + s (the k positions t and t + 4 of the fragment layout). Rows of
// x past M are zeros and weight rows past N repeat row N - 1; neither is stored.
//
// Loads. Each warp streams its rows' weights through its own ring of shared-memory stages
// with cp.async (no registers held for bytes in flight, no block barrier): a stage is 64 code
// bytes of each of the warp's 32 rows (X2Fmt::SG groups) and their scales; X2Fmt::S - 1
// stages are requested ahead, the first before the wait for the kernel before (weights are
// the host's). A stage's x values are requested before the warp waits for its weights.
// Staged code rows are 80 bytes apart, so the lanes' 4-byte reads of one group hit 32
// distinct banks. Groups past K are zero-filled and never multiplied.
//
// Needs sm_80 or later (TF32 MMA, cp.async); below that the kernels are empty and the host
// never launches them (`Device::float_mma`).

// X2_WARPS, X2_NT and X2_BM are defined by the host (cuda/compile.rs, `shared_constants`).

// Per-format staging: code bytes (CB) and scale bytes (SB) per group, groups per stage (SG),
// staged bytes per code row (CROW) and scale row (SROW), and stages in the ring (S).
template <int DT>
struct X2Fmt {
    static constexpr int CB = DT == DT_Q8_0 + DT_PACKED ? 32 : 16;
    static constexpr int SB = DT == DT_Q4_1 + DT_PACKED ? 4 : 2;
    static constexpr int SG = 64 / CB;
    static constexpr int CROW = 64 + 16;
    static constexpr int SROW = SG * SB;  // 8, 16 or 4 bytes: one cp.async per row
    static constexpr int ROWS = 16 * X2_NT;
    static constexpr int STAGE = ROWS * (CROW + SROW);
    static constexpr int BUDGET = 46 * 1024;  // static shared memory of a block's rings
    static constexpr int S = BUDGET / (X2_WARPS * STAGE) < 4 ? BUDGET / (X2_WARPS * STAGE) : 4;
};

#if __CUDA_ARCH__ >= 800

// hi = v rounded to TF32 (10 explicit mantissa bits; ties away from zero, by integer arithmetic
// on the bits: cvt.rna.tf32.f32 is a sequence of 4-5 instructions on sm_90), lo = v - hi
// (exact), whose low 13 bits the MMA ignores (it reads a TF32 operand's top 19 bits).
__device__ __forceinline__ void tf32_split(float v, u32* hi, u32* lo) {
    *hi = (__float_as_uint(v) + 0x1000u) & 0xffffe000u;
    *lo = __float_as_uint(__fsub_rn(v, __uint_as_float(*hi)));
}

// cp.async of `size` (4, 8 or 16) bytes through L1, of which the first `bytes` are read and the
// rest zero-filled.
template <int SIZE>
__device__ __forceinline__ void cp_async_ca(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(SIZE), "r"(bytes)
                 : "memory");
}

// Requests stage st (groups SG st ..) of the warp's rows into ring slot `slot`: lane l copies
// 16-byte code chunks l, l + 32, l + 64, l + 96 (row c / 4, chunk c % 4) and row l's scales.
template <int DT>
__device__ __forceinline__ void x2_stage(u32 ring, int slot, int st, int groups, const u8* const (&crow)[4],
                                         const u8* srow) {
    using F = X2Fmt<DT>;
    const int lane = threadIdx.x & 31;
    const int g0 = F::SG * st;
    const u32 base = ring + slot * F::STAGE;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int c = lane + 32 * j;
        const int part = c & 3;
        const bool ok = g0 + 16 * part / F::CB < groups;
        cp_async16(base + (c >> 2) * F::CROW + 16 * part, ok ? crow[j] + (size_t)g0 * F::CB + 16 * part : crow[j],
                   ok ? 16 : 0);
    }
    const int have = min(F::SG, groups - g0);
    cp_async_ca<F::SROW>(base + F::ROWS * F::CROW + lane * F::SROW, srow + (size_t)g0 * F::SB,
                         have > 0 ? have * F::SB : 0);
}

// Quarter t of group gi of staged row r as the packed decoder's fields.
template <int DT>
__device__ __forceinline__ void x2_part(MmPart<DT>& part, const u8* stage, int r, int gi, int t) {
    using F = X2Fmt<DT>;
    const u8* c = stage + r * F::CROW + gi * F::CB;
    const u8* s = stage + F::ROWS * F::CROW + r * F::SROW + gi * F::SB;
    if constexpr (DT == DT_Q8_0 + DT_PACKED) {
        const uint2 v = *(const uint2*)(c + 8 * t);
        part.lo = v.x;
        part.hi = v.y;
        part.d = *(const u16*)s;
    } else if constexpr (DT == DT_Q4_1 + DT_PACKED) {
        part.q = *(const u32*)(c + 4 * t);
        part.dm = *(const u32*)s;
    } else {
        part.q = *(const u32*)(c + 4 * t);
        part.d = *(const u16*)s;
    }
}

template <int DT, int EPI, int MT>
__device__ __forceinline__ void mmx2_body(const MmParams& p) {
    using F = X2Fmt<DT>;
    constexpr int S = F::S;
    constexpr int SG = F::SG;
    constexpr bool MIN = DT == DT_Q4_1 + DT_PACKED;  // the minimum's term (Σ x per group)
    static_assert(S >= 2, "the ring needs two stages");
    __shared__ __align__(16) u8 ring_mem[X2_WARPS][S * F::STAGE];

    const int si = mm_segment(p);
    const MmSeg& sg = p.seg[si];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = (((int)blockIdx.x - sg.block0) * X2_WARPS + warp) * F::ROWS;
    if (n0 >= sg.n) {  // a whole warp leaves together (no block barrier follows)
        df_kernel_begin();
        return;
    }
    const int m0 = (int)blockIdx.y * X2_BM;
    const int ml = min(X2_BM, p.m - m0);
    const int K = p.k;
    const int groups = K / GROUP;
    const int nst = (groups + SG - 1) / SG;
    const float* __restrict__ x = (const float*)p.x;
    const u8* w = (const u8*)sg.w;

    const u8* crow[4];
#pragma unroll
    for (int j = 0; j < 4; j++) crow[j] = w + (size_t)min(n0 + lane / 4 + 8 * j, sg.n - 1) * sg.row_bytes;
    const u8* srow = w + (size_t)min(n0 + lane, sg.n - 1) * sg.row_bytes + (size_t)groups * F::CB;
    const u32 ring = (u32)__cvta_generic_to_shared(ring_mem[warp]);
    const u8* ring_p = ring_mem[warp];

    // The weights are the host's: the first S - 1 stages are requested before the wait.
#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < nst) x2_stage<DT>(ring, s, s, groups, crow, srow);
        cp_async_commit();
    }
    const int xa = MmPart<DT>::xa(t);
    const int xb = MmPart<DT>::xb(t);
    df_kernel_begin();

    // acc[i][c][e]: tile i, column tile c, fragment element e (weight rows g, g, g + 8, g + 8
    // of the tile; x rows 8c + 2t, 8c + 2t + 1, 8c + 2t, 8c + 2t + 1)
    float acc[X2_NT][MT][4];
#pragma unroll
    for (int i = 0; i < X2_NT; i++)
#pragma unroll
        for (int c = 0; c < MT; c++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][c][e] = 0.0f;
    const u32 one = __float_as_uint(1.0f);
    const u32 ones[4] = {one, one, one, one};

#pragma unroll 1
    for (int st = 0; st < nst; st++) {
        if (st + S - 1 < nst) x2_stage<DT>(ring, (st + S - 1) % S, st + S - 1, groups, crow, srow);
        cp_async_commit();
        // x of row g of each column tile at the quarter's offsets, for the stage's groups.
        float4 xv[SG][MT][2];
#pragma unroll
        for (int gi = 0; gi < SG; gi++)
#pragma unroll
            for (int c = 0; c < MT; c++) {
                const int grp = SG * st + gi;
                xv[gi][c][0] = xv[gi][c][1] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (8 * c + g < ml && grp < groups) {
                    const float* xr = x + (size_t)(m0 + 8 * c + g) * K + (size_t)grp * GROUP;
                    xv[gi][c][0] = __ldg((const float4*)(xr + xa));
                    xv[gi][c][1] = __ldg((const float4*)(xr + xb));
                }
            }
        cp_async_wait<S - 1>();
        __syncwarp();
        const u8* stage = ring_p + (st % S) * F::STAGE;
#pragma unroll
        for (int gi = 0; gi < SG; gi++) {
            if (SG * st + gi < groups) {
                u32 xh[MT][8], xl[MT][8];
#pragma unroll
                for (int c = 0; c < MT; c++) {
                    const float v[8] = {xv[gi][c][0].x, xv[gi][c][0].y, xv[gi][c][0].z, xv[gi][c][0].w,
                                        xv[gi][c][1].x, xv[gi][c][1].y, xv[gi][c][1].z, xv[gi][c][1].w};
#pragma unroll
                    for (int k = 0; k < 8; k++) tf32_split(v[k], &xh[c][k], &xl[c][k]);
                }
                MmPart<DT> part[X2_NT][2];
                float code[X2_NT][2][8];
#pragma unroll
                for (int i = 0; i < X2_NT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        x2_part<DT>(part[i][h], stage, 16 * i + 8 * h + g, gi, t);
                        part[i][h].codes(code[i][h]);
                    }
                // [0]: the hi products, [1]: the lo ones (two chains of 4 MMAs, not one of 8)
                float sum[2][X2_NT][MT][4];
                float xsum[2][MT][4];
#pragma unroll
                for (int v = 0; v < 2; v++)
#pragma unroll
                    for (int c = 0; c < MT; c++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            xsum[v][c][e] = 0.0f;
#pragma unroll
                            for (int i = 0; i < X2_NT; i++) sum[v][i][c][e] = 0.0f;
                        }
#pragma unroll
                for (int s = 0; s < 4; s++) {
#pragma unroll
                    for (int c = 0; c < MT; c++) {
#pragma unroll
                        for (int i = 0; i < X2_NT; i++) {
                            const u32 a[4] = {__float_as_uint(code[i][0][s]), __float_as_uint(code[i][1][s]),
                                              __float_as_uint(code[i][0][4 + s]), __float_as_uint(code[i][1][4 + s])};
                            mma_tf32(sum[0][i][c], a, xh[c][s], xh[c][4 + s]);
                            mma_tf32(sum[1][i][c], a, xl[c][s], xl[c][4 + s]);
                        }
                        if (MIN) {
                            mma_tf32(xsum[0][c], ones, xh[c][s], xh[c][4 + s]);
                            mma_tf32(xsum[1][c], ones, xl[c][s], xl[c][4 + s]);
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < X2_NT; i++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float d = part[i][h].scale();
#pragma unroll
                        for (int c = 0; c < MT; c++)
#pragma unroll
                            for (int e = 2 * h; e < 2 * h + 2; e++) {
                                const float pe = __fadd_rn(sum[0][i][c][e], sum[1][i][c][e]);
                                float a = __fmaf_rn(d, pe, acc[i][c][e]);
                                if constexpr (MIN) {
                                    const float se = __fadd_rn(xsum[0][c][e], xsum[1][c][e]);
                                    a = __fmaf_rn(part[i][h].minimum(), se, a);
                                }
                                acc[i][c][e] = a;
                            }
                    }
            }
        }
        __syncwarp();  // every lane is done with the slot before it is requested again
    }

    float* out = (float*)sg.out;
#pragma unroll
    for (int i = 0; i < X2_NT; i++)
#pragma unroll
        for (int c = 0; c < MT; c++)
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

template <int DT, int EPI, int MT>
__device__ __forceinline__ void mmx2_body(const MmParams& p) {
    df_kernel_begin();
}

#endif
