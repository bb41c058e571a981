// dflash-rs CUDA kernels: int8-activation products of several rows (verify, batched decode) on
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
// then plays 4 of the 32 lanes ("lane classes"): for class l it walks groups l, l + 32,
// ... in increasing order with the same two float operations; the class sums are added in
// the butterfly's tree (below). The result depends on K and the format only, as mmq_warp's,
// so a verify row equals its decode row.
//
// Tiles. A block (QT_WARPS = 8 warps) computes QT_BM = 16 rows of x (blockIdx.y) by T column
// tiles of 8 outputs (SwiGLU: T / 2 tiles, at least one, each with two MMAs per group, gate
// and up), which share each A fragment. Two widths are built: T = QT_NT (4: x is read once
// per 32 outputs, not per 8) and T = 1 for products whose wide blocks would leave SMs idle (a
// 576-output product at 16 rows is 18 wide blocks; the host picks, `Epilogue::qt_outputs`).
// The width changes which block computes an output, not how: the bits are the same. Outputs are weight
// rows (store, add), gate/up row pairs (swiglu) or, for the rope epilogue, rotary pairs
// (columns 2i and 2i + 1 are rows ia and ib of pair i). Warp w plays lane classes w, w + 8,
// w + 16 and w + 24, so it takes the butterfly's first two levels itself
// ((v_w + v_w+16) + (v_w+8 + v_w+24)); shared memory then holds 8 sums per output, and one
// thread per output finishes the tree (+4, +2, +1).
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

// QT_WARPS (8), QT_BM (16) and the widths QT_NT (4) and QT_NT_NARROW (1) are defined by the
// host (cuda/compile.rs, `shared_constants`).

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
        q4_split<DT == DT_Q4_0>(w, &b[0], &b[1]);
    }
}

// The end of warp_sum's butterfly for one output (lane 0's result), from the 8 sums the warps
// left (s[w] = (v_w + v_w+16) + (v_w+8 + v_w+24)): + 4, + 2, + 1.
__device__ __forceinline__ float qt_tree(const float* s, int stride) {
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; i++) v[i] = __fadd_rn(s[i * stride], s[(i + 4) * stride]);
    v[0] = __fadd_rn(v[0], v[2]);
    v[1] = __fadd_rn(v[1], v[3]);
    return __fadd_rn(v[0], v[1]);
}

template <int DT, int EPI, int T>
__device__ __forceinline__ void mmqt_body(const MmParams& p) {
    constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;
    constexpr int NT = T / W > 0 ? T / W : 1;
    constexpr int BN = 8 * NT;
    constexpr int CB = MmQ<DT>::CB;
    constexpr int SB = MmQ<DT>::SB;
    // The warps' sums: red[warp][v][m][column].
    __shared__ float red[QT_WARPS][W][QT_BM][BN];

    int si = 0;
#pragma unroll
    for (int k = 1; k < MM_SEGS; k++) {
        if (k < p.nseg && (int)blockIdx.x >= p.seg[k].block0) si = k;
    }
    const MmSeg& sg = p.seg[si];
    const int c0 = ((int)blockIdx.x - sg.block0) * BN;  // the block's first column
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
        return (size_t)min(n, sg.n - 1) * sg.row_bytes;
    };
    // Per column tile: the B row (column g) and the scale rows of this thread's outputs
    // (columns 2t, 2t + 1), as offsets into the weights.
    size_t brow[NT], srow[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        brow[nt] = col_row(8 * nt + g);
        srow[nt][0] = col_row(8 * nt + 2 * t) + (size_t)groups * CB;
        srow[nt][1] = col_row(8 * nt + 2 * t + 1) + (size_t)groups * CB;
    }
    const u8* const wv[2] = {(const u8*)sg.w, (const u8*)sg.w2};
    // x rows of this thread's A fragments and outputs (g, g + 8); rows past M re-read row m0.
    const signed char* __restrict__ xq = (const signed char*)p.x;
    const float2* __restrict__ xs = (const float2*)p.xs;
    const size_t xr[2] = {(size_t)(m0 + (g < ml ? g : 0)), (size_t)(m0 + (g + 8 < ml ? g + 8 : 0))};

    // acc[j][nt][v][e]: lane class warp + 8j, column tile nt, weight v, fragment element e.
    float acc[4][NT][W][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int v = 0; v < W; v++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][nt][v][e] = 0.0f;

    df_kernel_begin();
    for (int gb = warp; gb < groups; gb += 32) {
        // Every load of the four groups first, then their MMAs and float steps in order.
        u32 a[4][4], b[4][NT][W][2], sw[4][NT][2][W];
        float2 sx[4][2];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int gi = gb + 8 * j;
            if (gi < groups) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const signed char* xg = xq + xr[h] * K + (size_t)gi * GROUP;
                    a[j][h] = __ldg((const unsigned int*)(xg + 4 * t));
                    a[j][2 + h] = __ldg((const unsigned int*)(xg + 16 + 4 * t));
                    sx[j][h] = __ldg(xs + xr[h] * groups + gi);
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        qt_b<DT>(wv[v] + brow[nt], gi, t, b[j][nt][v]);
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const u8* sp = wv[v] + srow[nt][h] + (size_t)gi * SB;
                            sw[j][nt][h][v] =
                                SB == 4 ? __ldg((const unsigned int*)sp) : (u32)__ldg((const unsigned short*)sp);
                        }
                    }
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (gb + 8 * j < groups) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        int d[4];
                        mma_s8(d, a[j], b[j][nt][v][0], b[j][nt][v][1]);
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            const float2 sc = sx[j][e >> 1];
                            const u32 s = sw[j][nt][e & 1][v];
                            const float dw = f16_to_f32((u16)(s & 0xffffu));
                            float r = __fmaf_rn(__fmul_rn(dw, sc.x), (float)d[e], acc[j][nt][v][e]);
                            if (DT == DT_Q4_1) r = __fmaf_rn(f16_to_f32((u16)(s >> 16)), sc.y, r);
                            acc[j][nt][v][e] = r;
                        }
                    }
            }
        }
    }
    // The butterfly's first two levels: classes (w, w + 16) and (w + 8, w + 24), then both.
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int v = 0; v < W; v++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float lo = __fadd_rn(acc[0][nt][v][e], acc[2][nt][v][e]);
                const float hi = __fadd_rn(acc[1][nt][v][e], acc[3][nt][v][e]);
                red[warp][v][g + 8 * (e >> 1)][8 * nt + 2 * t + (e & 1)] = __fadd_rn(lo, hi);
            }
    __syncthreads();

    float* out = (float*)sg.out;
    constexpr int WS = W * QT_BM * BN;  // floats between two warps' sums in red
    if (EPI == EPI_ROPE) {
        // Thread (m, i): pair i of the block for token m0 + m (BN / 2 pairs).
        for (int o = tid; o < QT_BM * BN / 2; o += QT_WARPS * 32) {
            const int m = o / (BN / 2);
            const int i = o % (BN / 2);
            const int unit = c0 / 2 + i;
            if (m < ml && 2 * unit < sg.n) {
                const int h = unit / p.half;
                const int pair = unit - h * p.half;
                int ia, ib;
                rope_offsets(pair, p.half, p.style, &ia, &ib);
                const float va = qt_tree(&red[0][0][m][2 * i], WS);
                const float vb = qt_tree(&red[0][0][m][2 * i + 1], WS);
                const RopeLane rl = rope_lane(p, si, pair, m0 + m);
                float ra = va, rb = vb;
                if (si < 2) rope_apply(va, vb, rl.c, rl.s, p.style, &ra, &rb);
                float* o_row = out + (size_t)(m0 + m) * sg.n;
                const int na = h * p.head_dim + ia;
                const int nb = h * p.head_dim + ib;
                o_row[na] = ra;
                o_row[nb] = rb;
                if (rl.slot) {
                    rl.slot[na] = ra;
                    rl.slot[nb] = rb;
                }
            }
        }
        return;
    }
    for (int o = tid; o < QT_BM * BN; o += QT_WARPS * 32) {
        const int m = o / BN;
        const int c = o % BN;
        const int n = c0 + c;
        if (m < ml && n < sg.n) {
            const float up = W == 2 ? qt_tree(&red[0][W - 1][m][c], WS) : 0.0f;
            mm_epilogue<EPI>(out + (size_t)(m0 + m) * sg.n + n, qt_tree(&red[0][0][m][c], WS), up);
        }
    }
}

#else

template <int DT, int EPI, int T>
__device__ __forceinline__ void mmqt_body(const MmParams& p) {}

#endif
