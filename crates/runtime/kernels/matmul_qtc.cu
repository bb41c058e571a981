// dflash-rs CUDA kernels: int8-activation products of 2..16 rows (verify, batched decode) on
// integer tensor cores, with the bits of the dp4a kernels (mmq_warp).
//
// Pasted into matmul.cu after mmq_warp (inside DF_MM_INT8), whose packed weight layout, int8
// x (quant_q8_f32) and epilogues it shares; the kernels (`mmqt_<format>_<epilogue>`) are
// instantiated there.
//
// Why the bits are the same. mmq_warp computes, per output and 32-value group g, an exact
// integer D_g = Σ w·x (8 dp4a; Q4_0 with q - 8), turns it into floats as
//   acc_l = fma(dw·dx, D_g, acc_l)   (Q4_1: then acc_l = fma(m, ds, acc_l))
// on lane l = g mod 32 in increasing g, then adds the 32 lane sums by the xor butterfly
// (warp_sum). Here `mma.sync.m16n8k32.s32.s8.s8.s32` computes the same D_g for 16 rows of x
// by 8 weight rows at once: integer sums are exact in any order, so D_g is equal. Each warp
// then plays QT_CLS of the 32 lanes ("lane classes"): for class l it walks groups l, l + 32,
// ... in increasing order with the same two float operations, and the 32 class sums meet in
// shared memory, where one thread per output adds them in the butterfly's tree. The result
// depends on K and the format only, as mmq_warp's, so a verify row equals its decode row.
//
// Tiles. A block (QT_WARPS warps) computes QT_BM = 16 rows of x (blockIdx.y) by QT_BN = 8
// outputs; warp w owns lane classes QT_CLS·w .. +QT_CLS, i.e. QT_CLS consecutive groups of
// every 32 (their weight codes are 64 contiguous bytes of a Q4 row). Outputs are weight rows
// (store, add), gate/up row pairs (swiglu: two MMAs per group) or, for the rope epilogue, 4
// rotary pairs (columns 2i and 2i + 1 are rows ia and ib of pair i).
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32", .s8), g = lane >> 2, t = lane & 3:
//   A (16 x 32, x rows by k):     a0 = (g, 4t..4t+3)   a1 = (g + 8, 4t..)
//                                 a2 = (g, 16+4t..)    a3 = (g + 8, 16+4t..)
//   B (32 x 8, k by weight row):  b0 = (4t..4t+3, g)   b1 = (16+4t.., g)
//   C (16 x 8, s32):              c0 = (g, 2t)  c1 = (g, 2t + 1)  c2 = (g + 8, 2t)  c3 = (g + 8, 2t + 1)
// x codes are in value order, so a0..a3 are single 4-byte loads; a packed Q4 group's code
// byte j holds values j (low nibble) and j + 16 (high), so b0 and b1 are the two nibble
// halves of one 4-byte load (Q8_0: two loads).
//
// Needs sm_80 (integer m16n8k32); below that the kernels are empty and the host never
// launches them (`Device::int8_mma_min_m`).

#define QT_WARPS 8
#define QT_BM 16
#define QT_BN 8
#define QT_CLS (32 / QT_WARPS)

#if __CUDA_ARCH__ >= 800

// d = A · B for one 16 x 8 x 32 tile of int8 (fragments as in the header).
__device__ __forceinline__ void mma_s8(int* d, const u32* a, u32 b0, u32 b1) {
    d[0] = d[1] = d[2] = d[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The B fragment of group g of a packed weight row: codes k = 4t..4t+3 and 16+4t..16+4t+3,
// as the signed weights mmq_warp's dot multiplies (Q4_0: q - 8).
template <int DT>
__device__ __forceinline__ void qt_b(const u8* row, int g, int t, u32* b) {
    if (DT == DT_Q8_0) {
        const u8* c = row + (size_t)g * 32;
        b[0] = __ldg((const unsigned int*)(c + 4 * t));
        b[1] = __ldg((const unsigned int*)(c + 16 + 4 * t));
    } else {
        const u32 w = __ldg((const unsigned int*)(row + (size_t)g * 16 + 4 * t));
        b[0] = DF_LO_NIBBLES(w);
        b[1] = DF_HI_NIBBLES(w);
        if (DT == DT_Q4_0) {
            b[0] = __vsub4(b[0], 0x08080808u);
            b[1] = __vsub4(b[1], 0x08080808u);
        }
    }
}

// The 32 lane sums of one output added as warp_sum's butterfly adds them (lane 0's result):
// s[i] + s[i + 16], then + 8, + 4, + 2, + 1.
__device__ __forceinline__ float qt_tree(const float* s, int stride) {
    float v[16];
#pragma unroll
    for (int i = 0; i < 16; i++) v[i] = __fadd_rn(s[i * stride], s[(i + 16) * stride]);
#pragma unroll
    for (int h = 8; h > 0; h >>= 1)
#pragma unroll
        for (int i = 0; i < h; i++) v[i] = __fadd_rn(v[i], v[i + h]);
    return v[0];
}

template <int DT, int EPI>
__device__ __forceinline__ void mmqt_body(const MmParams& p) {
    constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;
    constexpr int CB = MmQ<DT>::CB;
    constexpr int SB = MmQ<DT>::SB;
    // Class sums: red[class][v][m][column].
    __shared__ float red[32][W][QT_BM][QT_BN];

    int si = 0;
#pragma unroll
    for (int k = 1; k < MM_SEGS; k++) {
        if (k < p.nseg && (int)blockIdx.x >= p.seg[k].block0) si = k;
    }
    const MmSeg& sg = p.seg[si];
    const int c0 = ((int)blockIdx.x - sg.block0) * QT_BN;  // the block's first column
    const int m0 = (int)blockIdx.y * QT_BM;
    const int ml = min(QT_BM, p.m - m0);
    const int K = p.k;
    const int groups = K / GROUP;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;

    // Weight row of column c of the block (rope: pair c / 2, row ia or ib), past the end
    // clamped to the last row (its results are not stored).
    auto col_row = [&](int c) {
        int n = c0 + c;
        if (EPI == EPI_ROPE) {
            const int unit = c0 / 2 + c / 2;
            const int h = unit / p.half;
            int ia, ib;
            rope_offsets(unit - h * p.half, p.half, p.style, &ia, &ib);
            n = h * p.head_dim + ((c & 1) ? ib : ia);
        }
        return min(n, sg.n - 1);
    };
    // B rows (column g) and the scale rows of this thread's outputs (columns 2t, 2t + 1).
    const u8* brow[W];
    const u8* srow[2][W];
    {
        const size_t nb = (size_t)col_row(g) * sg.row_bytes;
        const size_t n0 = (size_t)col_row(2 * t) * sg.row_bytes;
        const size_t n1 = (size_t)col_row(2 * t + 1) * sg.row_bytes;
        const u8* const ws[2] = {(const u8*)sg.w, (const u8*)sg.w2};
#pragma unroll
        for (int v = 0; v < W; v++) {
            brow[v] = ws[v] + nb;
            srow[0][v] = ws[v] + n0 + (size_t)groups * CB;
            srow[1][v] = ws[v] + n1 + (size_t)groups * CB;
        }
    }
    // x rows of this thread's A fragments and outputs (g, g + 8); rows past M re-read row m0.
    const signed char* __restrict__ xq = (const signed char*)p.x;
    const float2* __restrict__ xs = (const float2*)p.xs;
    const size_t xr[2] = {(size_t)(m0 + (g < ml ? g : 0)), (size_t)(m0 + (g + 8 < ml ? g + 8 : 0))};

    float acc[QT_CLS][W][4];
#pragma unroll
    for (int j = 0; j < QT_CLS; j++)
#pragma unroll
        for (int v = 0; v < W; v++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][v][e] = 0.0f;

    df_kernel_begin();
    for (int gb = QT_CLS * warp; gb < groups; gb += 32) {
        // Every load of the QT_CLS groups first, then their MMAs and float steps in order.
        u32 a[QT_CLS][4], b[QT_CLS][W][2], sw[QT_CLS][2][W];
        float2 sx[QT_CLS][2];
#pragma unroll
        for (int j = 0; j < QT_CLS; j++) {
            const int gi = gb + j;
            if (gi < groups) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const signed char* xg = xq + xr[h] * K + (size_t)gi * GROUP;
                    a[j][h] = __ldg((const unsigned int*)(xg + 4 * t));
                    a[j][2 + h] = __ldg((const unsigned int*)(xg + 16 + 4 * t));
                    sx[j][h] = __ldg(xs + xr[h] * groups + gi);
                }
#pragma unroll
                for (int v = 0; v < W; v++) {
                    qt_b<DT>(brow[v], gi, t, b[j][v]);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const u8* sp = srow[h][v] + (size_t)gi * SB;
                        sw[j][h][v] = SB == 4 ? __ldg((const unsigned int*)sp) : (u32)__ldg((const unsigned short*)sp);
                    }
                }
            }
        }
#pragma unroll
        for (int j = 0; j < QT_CLS; j++) {
            if (gb + j < groups) {
#pragma unroll
                for (int v = 0; v < W; v++) {
                    int d[4];
                    mma_s8(d, a[j], b[j][v][0], b[j][v][1]);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float2 sc = sx[j][e >> 1];
                        const u32 s = sw[j][e & 1][v];
                        const float dw = f16_to_f32((u16)(s & 0xffffu));
                        float r = __fmaf_rn(__fmul_rn(dw, sc.x), (float)d[e], acc[j][v][e]);
                        if (DT == DT_Q4_1) r = __fmaf_rn(f16_to_f32((u16)(s >> 16)), sc.y, r);
                        acc[j][v][e] = r;
                    }
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < QT_CLS; j++)
#pragma unroll
        for (int v = 0; v < W; v++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[QT_CLS * warp + j][v][g + 8 * (e >> 1)][2 * t + (e & 1)] = acc[j][v][e];
    __syncthreads();

    float* out = (float*)sg.out;
    constexpr int CS = W * QT_BM * QT_BN;  // floats between classes in red
    if (EPI == EPI_ROPE) {
        // Thread (m, i): pair i of token m0 + m.
        const int m = tid >> 2;
        const int i = tid & 3;
        const int unit = c0 / 2 + i;
        if (m < ml && 2 * unit < sg.n) {
            const int h = unit / p.half;
            const int pair = unit - h * p.half;
            int ia, ib;
            rope_offsets(pair, p.half, p.style, &ia, &ib);
            const float a = qt_tree(&red[0][0][m][2 * i], CS);
            const float bb = qt_tree(&red[0][0][m][2 * i + 1], CS);
            const RopeLane rl = rope_lane(p, si, pair, m0 + m);
            float ra = a, rb = bb;
            if (si < 2) rope_apply(a, bb, rl.c, rl.s, p.style, &ra, &rb);
            float* o = out + (size_t)(m0 + m) * sg.n;
            const int na = h * p.head_dim + ia;
            const int nb = h * p.head_dim + ib;
            o[na] = ra;
            o[nb] = rb;
            if (rl.slot) {
                rl.slot[na] = ra;
                rl.slot[nb] = rb;
            }
        }
        return;
    }
    if (tid < QT_BM * QT_BN) {
        const int m = tid / QT_BN;
        const int c = tid % QT_BN;
        const int n = c0 + c;
        if (m < ml && n < sg.n) {
            const float s0 = qt_tree(&red[0][0][m][c], CS);
            float* o = out + (size_t)(m0 + m) * sg.n + n;
            if (EPI == EPI_STORE) {
                *o = s0;
            } else if (EPI == EPI_ADD) {
                *o = __fadd_rn(*o, s0);
            } else {
                *o = swiglu(s0, qt_tree(&red[0][W - 1][m][c], CS));
            }
        }
    }
}

#else

template <int DT, int EPI>
__device__ __forceinline__ void mmqt_body(const MmParams& p) {}

#endif
