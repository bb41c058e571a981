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
// (warp_sum). Here `mma.sync.m16n8k32.s32.s8.s8.s32` computes the same D_g for 16 int8 rows
// (16 rows of x, or 8 rows' two terms) by 8 weight rows at once: integer sums are exact in any order, so D_g is equal. Each warp
// then plays 4 of the 32 lanes ("lane classes"): for class l it walks groups l, l + 32,
// ... in increasing order with the same two float operations; the class sums are added in
// the butterfly's tree (below). The result depends on K and the format only, as mmq_warp's,
// so a verify row equals its decode row.
//
// Tiles. A block (QT_WARPS = 8 warps) computes QT_BM = 16 int8 rows (blockIdx.y; QT_XM rows of
// x: 16, or 8 with two terms, see below) by T column
// tiles of 8 outputs (SwiGLU: T / 2 tiles, at least one, each with two MMAs per group, gate
// and up), which share each A fragment. Three widths are built: T = QT_NT (4: x is read once
// per 32 outputs, not per 8), T = QT_NT_MID (2) and T = 1, picked by product on the host
// (`CudaBackend::qt_width`: a 576-output product at 16 rows is 18 wide blocks, 72 narrow
// ones). A block reads K / 32 groups of x (640 bytes each at 16
// rows) for 8 T weight rows (144 bytes a group in Q4_0): the narrow blocks of Qwen3-4B's o
// projection read 4.4x more x than weights, from L2.
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
// x is the int8 copy in its tiled form (q8_at in common.cu, cuda/int8_x.rs `X8Form`), where a
// thread's a0..a3 of a group are one 16-byte load and the (d, ds) pairs of its rows g and g + 8
// another (a warp reads 512 + 128 contiguous bytes a group: by rows it was four 4-byte loads
// of 8 rows each and two 8-byte ones, three quarters of the kernel's L1 requests; the tiled
// form took Qwen3-4B's products at 16 rows from 17.9 to 10.8 us (q) and 33.3 to 25.9 us (down)
// on an H100, docs/benchmarks/2026-12-07-h100-tiled-int8-x.md). A packed Q4 group's code
// byte j holds values j (low nibble) and j + 16 (high), so b0 and b1 are the two nibble
// halves of one 4-byte load (Q8_0: two loads).
//
// Two-term activations (DF_X_TERMS = 2; mmq_warp's header): a block takes QT_XM = 8 rows of
// x, whose first terms are A rows g and second terms A rows g + 8, so a thread's fragment
// elements c0, c1 and c2, c3 are the two terms of one output each. Each term is accumulated and
// summed over the lane classes as above, then first + second (qt_sum), as mmq_warp's term_sum.
//
// Needs sm_80 (integer m16n8k32); below that the kernels are empty and the host never
// launches them (`Device::int8_mma_min_m`).

// QT_WARPS (8), QT_BM (16) and the widths QT_NT (4), QT_NT_MID (2) and QT_NT_NARROW (1) are defined by the
// host (cuda/compile.rs, `shared_constants`).

// Rows of x per block: the 16 A rows carry 16 rows, or 8 rows' two terms.
#define QT_XM (QT_BM / DF_X_TERMS)

#if __CUDA_ARCH__ >= 800

// d = A · B for one 16 x 8 x 32 tile of int8 (fragments as in the header).
__device__ __forceinline__ void mma_s8(int* d, const u32* a, u32 b0, u32 b1) {
    d[0] = d[1] = d[2] = d[3] = 0;
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// The sum of A row `row` (v * QT_BM + m: weight v, row m of x) at column c from the sums the
// warps left in `red` (rows of BN): the tree, and with two terms first + second (A row + 8).
template <int BN>
__device__ __forceinline__ float qt_sum(const float* red, int row, int c, int stride) {
    float s = qt_tree(red + row * BN + c, stride);
    if (DF_X_TERMS == 2) s = __fadd_rn(s, qt_tree(red + (row + 8) * BN + c, stride));
    return s;
}

// Block shape of the kernels T column tiles wide (see above).
template <int DT, int EPI, int T>
struct QtShape {
    static constexpr int W = EPI == EPI_SWIGLU ? 2 : 1;  // weights per output
    static constexpr int NT = T / W > 0 ? T / W : 1;     // column tiles of 8 outputs
    static constexpr int BN = 8 * NT;                     // outputs per block
    static constexpr int CB = MmQ<DT>::CB;
    static constexpr int SB = MmQ<DT>::SB;
};

// Byte offset of the weight row of column c of the block whose first column is c0 (rope: pair
// c / 2, row ia or ib); past the end clamped to the last row (its results are not stored).
template <int EPI>
__device__ __forceinline__ size_t qt_col_row(const MmParams& p, const MmSeg& sg, int c0, int c) {
    int n = c0 + c;
    if (EPI == EPI_ROPE) {
        const int unit = c0 / 2 + c / 2;
        const int h = unit / p.half;
        int ia, ib;
        rope_offsets(unit - h * p.half, p.half, p.style, &ia, &ib);
        n = h * p.head_dim + ((c & 1) ? ib : ia);
    }
    return (size_t)min(n, sg.n - 1) * sg.row_bytes;
}

// One group of one column tile and weight: the exact integer tile D = A · B by one MMA, then
// each fragment element's float step, mmq_warp's: acc = fma(dw · dx, D, acc) (Q4_1: then
// fma(m, ds, acc)). sx: the (d, ds) pairs of x rows g and g + 8; sw: the scale words of this
// thread's columns 2t and 2t + 1.
template <int DT>
__device__ __forceinline__ void qt_step(float (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1, const float2 (&sx)[2],
                                        const u32 (&sw)[2]) {
    int d[4];
    mma_s8(d, a, b0, b1);
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const float2 sc = sx[e >> 1];
        const u32 s = sw[e & 1];
        const float dw = f16_to_f32((u16)(s & 0xffffu));
        float r = __fmaf_rn(__fmul_rn(dw, sc.x), (float)d[e], acc[e]);
        if (DT == DT_Q4_1) r = __fmaf_rn(f16_to_f32((u16)(s >> 16)), sc.y, r);
        acc[e] = r;
    }
}

// The sums of the block's outputs from every warp's four lane classes, and the epilogue: the
// butterfly's first two levels in each warp ((v_w + v_w+16) + (v_w+8 + v_w+24)) into `red`
// (QT_WARPS * W * QT_BM * BN floats of shared memory, free to use), then one thread per output
// finishes the tree (+4, +2, +1) and applies the epilogue.
template <int DT, int EPI, int T>
__device__ __forceinline__ void qt_finish(const MmParams& p, const MmSeg& sg, int si, int c0, int m0, int ml,
                                          const float (&acc)[4][QtShape<DT, EPI, T>::NT][QtShape<DT, EPI, T>::W][4],
                                          float* red) {
    using Sh = QtShape<DT, EPI, T>;
    constexpr int W = Sh::W;
    constexpr int NT = Sh::NT;
    constexpr int BN = Sh::BN;
    constexpr int WS = W * QT_BM * BN;  // floats between two warps' sums in red
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int v = 0; v < W; v++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float lo = __fadd_rn(acc[0][nt][v][e], acc[2][nt][v][e]);
                const float hi = __fadd_rn(acc[1][nt][v][e], acc[3][nt][v][e]);
                red[warp * WS + (v * QT_BM + g + 8 * (e >> 1)) * BN + 8 * nt + 2 * t + (e & 1)] = __fadd_rn(lo, hi);
            }
    __syncthreads();

    float* out = (float*)sg.out;
    if (EPI == EPI_ROPE) {
        // Thread (m, i): pair i of the block for token m0 + m (BN / 2 pairs).
        for (int o = tid; o < QT_XM * BN / 2; o += QT_WARPS * 32) {
            const int m = o / (BN / 2);
            const int i = o % (BN / 2);
            const int unit = c0 / 2 + i;
            if (m < ml && 2 * unit < sg.n) {
                const int h = unit / p.half;
                const int pair = unit - h * p.half;
                int ia, ib;
                rope_offsets(pair, p.half, p.style, &ia, &ib);
                const float va = qt_sum<BN>(red, m, 2 * i, WS);
                const float vb = qt_sum<BN>(red, m, 2 * i + 1, WS);
                const RopeLane rl = rope_lane(p, si, pair, m0 + m);
                float ra = va, rb = vb;
                if (si < 2) rope_apply(va, vb, rl.c, rl.s, p.style, &ra, &rb);
                float* o_row = out + (size_t)(m0 + m) * sg.n;
                const int na = h * p.head_dim + ia;
                const int nb = h * p.head_dim + ib;
                o_row[na] = ra;
                o_row[nb] = rb;
                if (rl.slot) {
                    kv_put(rl.slot, na, ra, p.kv_half);
                    kv_put(rl.slot, nb, rb, p.kv_half);
                }
            }
        }
        return;
    }
    for (int o = tid; o < QT_XM * BN; o += QT_WARPS * 32) {
        const int m = o / BN;
        const int c = o % BN;
        const int n = c0 + c;
        if (m < ml && n < sg.n) {
            const float up = W == 2 ? qt_sum<BN>(red, (W - 1) * QT_BM + m, c, WS) : 0.0f;
            mm_epilogue<EPI>(out + (size_t)(m0 + m) * sg.n + n, qt_sum<BN>(red, m, c, WS), up);
        }
    }
}

// What a block of either kernel works on: its segment, first column c0, rows m0 .. m0 + ml of
// x (tile blockIdx.y of the tiled copy), and this thread's warp and fragment coordinates
// (g, t).
struct QtBlock {
    int si, c0, m0, ml, groups, warp, g, t;
};

__device__ __forceinline__ QtBlock qt_block(const MmParams& p, int bn) {
    QtBlock b;
    b.si = mm_segment(p);
    b.c0 = ((int)blockIdx.x - p.seg[b.si].block0) * bn;
    b.m0 = (int)blockIdx.y * QT_XM;
    b.ml = min(QT_XM, p.m - b.m0);
    b.groups = p.k / GROUP;
    b.warp = threadIdx.x >> 5;
    b.g = (threadIdx.x & 31) >> 2;
    b.t = threadIdx.x & 3;
    return b;
}

// The A fragments and x scales of group gi for this thread: its 16 bytes of the tile's codes
// and the pairs of its rows g and g + 8 (see the header). A tile's rows past M are padding
// that nothing writes, read as they are: an A row reaches only its own row of D (integer
// MMA) and of the float steps, and rows past M are never stored. (Selecting zeros for them
// took 8 ISETP, 16 SEL and 8 FSEL of the 188 instructions of a round of the narrow kernel;
// without them the 4B's 16-row o/down products took 10.2 -> 8.7 us and 17.3 -> 15.0 us on an
// H100, Q4_1's down 33.6 -> 16.3 us, docs/benchmarks/2026-12-07-h100-qt-padding-rows.md.)
__device__ __forceinline__ void qt_load_x(const MmParams& p, const QtBlock& b, int gi, u32 (&a)[4],
                                          float2 (&sx)[2]) {
    const size_t tile = (size_t)blockIdx.y * b.groups + gi;
    const uint4 c = __ldg((const uint4*)p.x + tile * 32 + (threadIdx.x & 31));
    const float4 s = __ldg((const float4*)p.xs + tile * (QT_BM / 2) + b.g);
    a[0] = c.x;
    a[1] = c.y;
    a[2] = c.z;
    a[3] = c.w;
    sx[0] = make_float2(s.x, s.y);
    sx[1] = make_float2(s.z, s.w);
}

// The raw weight words and scale words of one round (groups gb + 8j) of a warp's column
// tiles. A group's B fragment (codes k = 4t..4t+3 and 16+4t..16+4t+3, as the signed weights
// mmq_warp's dot multiplies) is two words of Q8_0 codes, or one packed Q4 word whose nibble
// halves q4_split makes the two (Q4_0: q - 8).
template <int DT, int EPI, int T>
struct QtRound {
    using Sh = QtShape<DT, EPI, T>;
    u32 b[4][Sh::NT][Sh::W][2], sw[4][Sh::NT][Sh::W][2];
};

// Group gi's words into slot j of a round.
template <int DT, int EPI, int T>
__device__ __forceinline__ void qt_load_group(QtRound<DT, EPI, T>& r, int j, int gi, int t, const u8* const (&wv)[2],
                                              const size_t* brow, const size_t (*srow)[2]) {
    using Sh = QtShape<DT, EPI, T>;
#pragma unroll
    for (int nt = 0; nt < Sh::NT; nt++)
#pragma unroll
        for (int v = 0; v < Sh::W; v++) {
            const u8* row = wv[v] + brow[nt];
            if (DT == DT_Q8_0) {
                const u8* c = row + (size_t)gi * 32;
                r.b[j][nt][v][0] = __ldg((const unsigned int*)(c + 4 * t));
                r.b[j][nt][v][1] = __ldg((const unsigned int*)(c + 16 + 4 * t));
            } else {
                r.b[j][nt][v][0] = __ldg((const unsigned int*)(row + (size_t)gi * 16 + 4 * t));
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u8* sp = wv[v] + srow[nt][h] + (size_t)gi * Sh::SB;
                r.sw[j][nt][v][h] = Sh::SB == 4 ? __ldg((const unsigned int*)sp) : (u32)__ldg((const unsigned short*)sp);
            }
        }
}

// The round of groups gb + 8j (those below `groups`).
template <int DT, int EPI, int T>
__device__ __forceinline__ void qt_load_round(QtRound<DT, EPI, T>& r, int gb, int groups, int t,
                                              const u8* const (&wv)[2], const size_t* brow,
                                              const size_t (*srow)[2]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (gb + 8 * j < groups) qt_load_group(r, j, gb + 8 * j, t, wv, brow, srow);
    }
}

// The kernel with every load in registers: per round of 32 groups, warp w loads its four
// groups' x and weights, then multiplies them. AHEAD: the round's weights were requested a
// round earlier (the first round's before the wait: weights are the host's), and the next
// round's are on their way during this round's MMAs; the same words go into the same MMAs, so
// the same bits, for twice the weight registers.
template <int DT, int EPI, int T, bool AHEAD>
__device__ __forceinline__ void mmqt_body(const MmParams& p) {
    using Sh = QtShape<DT, EPI, T>;
    constexpr int W = Sh::W;
    constexpr int NT = Sh::NT;
    constexpr int BN = Sh::BN;
    constexpr int CB = Sh::CB;
    __shared__ float red[QT_WARPS * W * QT_BM * BN];

    const QtBlock blk = qt_block(p, BN);
    const int si = blk.si, c0 = blk.c0, m0 = blk.m0, ml = blk.ml, groups = blk.groups;
    const int warp = blk.warp, g = blk.g, t = blk.t;
    const MmSeg& sg = p.seg[si];

    // Per column tile: the B row (column g) and the scale rows of this thread's outputs
    // (columns 2t, 2t + 1), as offsets into the weights.
    size_t brow[NT], srow[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        brow[nt] = qt_col_row<EPI>(p, sg, c0, 8 * nt + g);
        srow[nt][0] = qt_col_row<EPI>(p, sg, c0, 8 * nt + 2 * t) + (size_t)groups * CB;
        srow[nt][1] = qt_col_row<EPI>(p, sg, c0, 8 * nt + 2 * t + 1) + (size_t)groups * CB;
    }
    const u8* const wv[2] = {(const u8*)sg.w, (const u8*)sg.w2};

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

    QtRound<DT, EPI, T> cur, next;
    if (AHEAD) qt_load_round(cur, warp, groups, t, wv, brow, srow);
    df_kernel_begin();
    for (int gb = warp; gb < groups; gb += 32) {
        // Every load of the four groups first, then their MMAs and float steps in order.
        u32 a[4][4];
        float2 sx[4][2];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int gi = gb + 8 * j;
            if (gi < groups) {
                qt_load_x(p, blk, gi, a[j], sx[j]);
                if (!AHEAD) qt_load_group(cur, j, gi, t, wv, brow, srow);
            }
        }
        if (AHEAD && gb + 32 < groups) qt_load_round(next, gb + 32, groups, t, wv, brow, srow);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (gb + 8 * j < groups) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int v = 0; v < W; v++) {
                        u32 b0, b1;
                        if (DT == DT_Q8_0) {
                            b0 = cur.b[j][nt][v][0];
                            b1 = cur.b[j][nt][v][1];
                        } else {
                            q4_split<DT == DT_Q4_0>(cur.b[j][nt][v][0], &b0, &b1);
                        }
                        qt_step<DT>(acc[j][nt][v], a[j], b0, b1, sx[j], cur.sw[j][nt][v]);
                    }
            }
        }
        if (AHEAD) cur = next;
    }
    qt_finish<DT, EPI, T>(p, sg, si, c0, m0, ml, acc, red);
}

// ---- the pipelined kernel ----------------------------------------------------------------
//
// The kernel above keeps few bytes in flight: a warp requests its four groups of one round
// (512 bytes of weights for a tile of 8 outputs) and waits for them before the next round, so
// a product of 16 rows with Qwen3-4B's shapes reads its weights at 7% of the HBM bandwidth
// (ncu: two thirds of the stalls wait on those loads; docs/benchmarks/
// 2026-12-03-h200-attention-values-verify-profile.md). Here the block's weights (codes and
// scales of its NT * W tiles) stream through a ring of S stages in shared memory with
// `cp.async` (no registers held for bytes in flight): a stage is one round of 32 groups,
// S - 1 stages are requested ahead (the first before the wait for the kernel before: weights
// are the host's), and a warp takes its B fragments from a stage with `ldmatrix` (one x4 for
// the four groups of a Q4 tile, two for Q8_0: matrix q, row r is 16 code bytes of group
// w + 8q of weight row r, whose lane (g, t) word is exactly the B fragment's). x is read from
// memory as above, at the top of its stage, so that its loads overlap the wait for the
// stage's weights (read a stage ahead, its fragments took 32 more registers, which spilled
// once the SwiGLU kernels were bounded to two blocks an SM). Same lane classes, same groups
// per warp, same order and the same qt_step and qt_finish as the kernel above: the same bits.
//
// A staged row is its 32 groups' code bytes padded by 16 (rows 4 banks apart: conflict-free
// ldmatrix), then the 32 groups' scales; tiles follow each other, then stages. Groups past K
// are zero-filled (cp.async with no source bytes) and never multiplied.
template <int DT, int EPI, int T>
struct QtPipe {
    using Sh = QtShape<DT, EPI, T>;
    static constexpr int NTW = Sh::NT * Sh::W;     // staged tiles of 8 weight rows
    static constexpr int CROW = 32 * Sh::CB + 16;  // staged code bytes per row
    static constexpr int SROW = 32 * Sh::SB;       // staged scale bytes per row
    static constexpr int CCH = 32 * Sh::CB / 16;   // 16-byte code chunks per row
    static constexpr int SCH = SROW / 16;          // 16-byte scale chunks per row
    static constexpr int TILE = 8 * (CROW + SROW);
    static constexpr int STAGE = NTW * TILE;
    static constexpr int BUDGET = 46 * 1024;  // static shared memory for the ring
    static constexpr int S = BUDGET / STAGE < 8 ? BUDGET / STAGE : 8;
};

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// One part of a stage (the code bytes or the scales of its rows): thread c copies the 16-byte
// chunks c, c + 256, ... of the part, chunk c being bytes 16 (c % CH) of staged row c / CH (tile
// c / CH / 8, row c / CH % 8), taken from `from` bytes into that weight row and put `at` bytes
// into the row's tile, rows `pitch` apart; a chunk holds groups 16 (c % CH) / UNIT on. CH is a
// power of two, so a chunk's row and place are shifts of the thread index, the same at every
// stage.
template <int DT, int EPI, int T, unsigned CH, int UNIT>
__device__ __forceinline__ void qt_stage_part(u32 base, u32 at, u32 pitch, size_t from, int g0, int groups,
                                              const u8* const (&wv)[2], const size_t* rows) {
    using P = QtPipe<DT, EPI, T>;
    constexpr int W = P::Sh::W;
    constexpr unsigned THREADS = QT_WARPS * 32;
    constexpr unsigned CHUNKS = P::NTW * 8 * CH;
    static_assert((CH & (CH - 1)) == 0, "chunks per row are a power of two");
#pragma unroll
    for (unsigned i = 0; i < (CHUNKS + THREADS - 1) / THREADS; i++) {
        const unsigned c = threadIdx.x + i * THREADS;
        if (CHUNKS % THREADS == 0 || c < CHUNKS) {
            const unsigned rr = c / CH, k = c % CH;
            const unsigned tv = rr >> 3;
            const unsigned nt = tv / W;
            const u8* row = (W == 1 || tv - nt * W == 0 ? wv[0] : wv[1]) + rows[8 * nt + (rr & 7)];
            const bool ok = g0 + (int)(16 * k / UNIT) < groups;
            cp_async16(base + tv * P::TILE + at + (rr & 7) * pitch + 16 * k, ok ? row + from + 16 * k : row,
                       ok ? 16 : 0);
        }
    }
}

// Requests stage st (groups 32 st ..) of the block's tiles into ring slot `slot`: the code
// bytes, then the scales.
template <int DT, int EPI, int T>
__device__ __forceinline__ void qt_stage(u32 ring, int slot, int st, int groups, const u8* const (&wv)[2],
                                         const size_t* rows) {
    using P = QtPipe<DT, EPI, T>;
    constexpr int CB = P::Sh::CB;
    constexpr int SB = P::Sh::SB;
    const int g0 = 32 * st;
    const u32 base = ring + slot * P::STAGE;
    qt_stage_part<DT, EPI, T, P::CCH, CB>(base, 0, P::CROW, (size_t)g0 * CB, g0, groups, wv, rows);
    qt_stage_part<DT, EPI, T, P::SCH, SB>(base, 8 * P::CROW, P::SROW, (size_t)groups * CB + (size_t)g0 * SB, g0,
                                          groups, wv, rows);
}

template <int DT, int EPI, int T>
__device__ __forceinline__ void mmqt_pipe_body(const MmParams& p) {
    using P = QtPipe<DT, EPI, T>;
    using Sh = typename P::Sh;
    constexpr int W = Sh::W;
    constexpr int NT = Sh::NT;
    constexpr int BN = Sh::BN;
    constexpr int SB = Sh::SB;
    constexpr int S = P::S;
    static_assert(S >= 2, "the ring needs two stages");
    static_assert(QT_WARPS * W * QT_BM * BN * 4 <= S * P::STAGE, "the sums fit in the ring");
    __shared__ __align__(128) u8 ring_mem[S * P::STAGE];
    __shared__ size_t rows[8 * NT];  // weight row offsets of the block's columns

    const QtBlock blk = qt_block(p, BN);
    const int si = blk.si, c0 = blk.c0, m0 = blk.m0, ml = blk.ml, groups = blk.groups;
    const int warp = blk.warp, g = blk.g, t = blk.t;
    const MmSeg& sg = p.seg[si];
    const u8* const wv[2] = {(const u8*)sg.w, (const u8*)sg.w2};
    const u32 ring = (u32)__cvta_generic_to_shared(ring_mem);
    const int nst = (groups + 31) / 32;

    // The weights are the host's: the first S - 1 stages are requested before the wait.
    for (int i = threadIdx.x; i < 8 * NT; i += QT_WARPS * 32) rows[i] = qt_col_row<EPI>(p, sg, c0, i);
    __syncthreads();
#pragma unroll 1
    for (int s = 0; s < S - 1; s++) {
        if (s < nst) qt_stage<DT, EPI, T>(ring, s, s, groups, wv, rows);
        cp_async_commit();
    }

    float acc[4][NT][W][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int v = 0; v < W; v++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[j][nt][v][e] = 0.0f;

    // This warp's four groups of stage st are 32 st + w + 8j (lane class w + 8j); a/sx hold
    // their x (A fragments and scales). (Groups past K leave theirs as they were; they are
    // never multiplied.)
    u32 a[4][4] = {};
    float2 sx[4][2] = {};
    df_kernel_begin();
    const auto load_x = [&](int st, u32(&ax)[4][4], float2(&sxx)[4][2]) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int gi = 32 * st + warp + 8 * j;
            if (gi < groups) qt_load_x(p, blk, gi, ax[j], sxx[j]);
        }
    };
#pragma unroll 1
    for (int st = 0; st < nst; st++) {
        const int gb = 32 * st + warp;
        load_x(st, a, sx);
        // Stage st has landed for every thread, and every warp is done with stage st - 1,
        // whose slot now takes stage st + S - 1.
        cp_async_wait<S - 2>();
        __syncthreads();
        if (st + S - 1 < nst) qt_stage<DT, EPI, T>(ring, (st + S - 1) % S, st + S - 1, groups, wv, rows);
        cp_async_commit();

        const u32 stage = ring + (st % S) * P::STAGE;
        const u8* stage_mem = ring_mem + (st % S) * P::STAGE;
        const int q = (threadIdx.x & 31) >> 3;  // the ldmatrix matrix this lane addresses
        const int r = threadIdx.x & 7;           // and its row
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int v = 0; v < W; v++) {
                const int tv = nt * W + v;
                const u32 tile = stage + tv * P::TILE;
                // B words: bw[j][0] (Q4: the packed word; Q8_0: the low half), bw[j][1] (Q8_0).
                u32 bw[4][2];
                if (DT == DT_Q8_0) {
                    u32 m01[4], m23[4];
                    ldsm_x4(tile + r * P::CROW + (warp + 8 * (q >> 1)) * 32 + 16 * (q & 1), m01);
                    ldsm_x4(tile + r * P::CROW + (warp + 8 * (2 + (q >> 1))) * 32 + 16 * (q & 1), m23);
                    bw[0][0] = m01[0], bw[0][1] = m01[1], bw[1][0] = m01[2], bw[1][1] = m01[3];
                    bw[2][0] = m23[0], bw[2][1] = m23[1], bw[3][0] = m23[2], bw[3][1] = m23[3];
                } else {
                    u32 m4[4];
                    ldsm_x4(tile + r * P::CROW + (warp + 8 * q) * 16, m4);
#pragma unroll
                    for (int j = 0; j < 4; j++) bw[j][0] = bw[j][1] = m4[j];
                }
                const u8* scales = stage_mem + tv * P::TILE + 8 * P::CROW;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    if (gb + 8 * j < groups) {
                        u32 b0, b1, sw[2];
                        if (DT == DT_Q8_0) {
                            b0 = bw[j][0];
                            b1 = bw[j][1];
                        } else {
                            q4_split<DT == DT_Q4_0>(bw[j][0], &b0, &b1);
                        }
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const u8* sp = scales + (2 * t + h) * P::SROW + (warp + 8 * j) * SB;
                            sw[h] = SB == 4 ? *(const unsigned int*)sp : (u32) * (const unsigned short*)sp;
                        }
                        qt_step<DT>(acc[j][nt][v], a[j], b0, b1, sx[j], sw);
                    }
                }
            }
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring: it holds the sums now
    qt_finish<DT, EPI, T>(p, sg, si, c0, m0, ml, acc, (float*)ring_mem);
}

// The kernel of a (format, epilogue, width): the pipelined one for the SwiGLU products (where
// its ring holds two stages), the register one above for the rest. On the H200 the ring took
// Qwen3-4B's 16-row gate/up product from 46 to 40 us and a verify of 16 from 6.07 to 5.74 ms,
// but lost where fewer blocks each walk a longer K (o, down, q: by register count two of its
// blocks fit an SM against three, and each stage waits on a barrier); with every
// epilogue pipelined the 4B verify gained only 1% (docs/benchmarks/
// 2026-12-03-h200-qtpipe-end-to-end.md). The wide blocks of the register kernel load a round
// ahead: one of them fits an SM either way (202 or 252 registers), and on the H200 their
// products at 8 / 16 rows took 14-20% less time so (Qwen3-4B's q and wide gate/up, the same
// document, section 5); the narrow ones do not (88 registers instead of 80 leave two blocks an
// SM instead of three, and the o/down products of the 4B lost a wave: +25-31%), nor do Q8_0's
// (two weight words a group: its wide blocks would spill). The ring kernel was bound by the
// instructions it issues: qt_stage's chunk indices by division and a weight pointer picked
// from a local array (~225 instructions a thread a stage), and spills; staging by shifts, two
// blocks an SM and x read at its stage took the 4B's 16-row gate/up from 36.8 to 24.3 us on
// an H100, and its verify of 16 from 4.14 to 3.70 ms (docs/benchmarks/
// 2026-12-07-h100-swiglu-ring-issue.md). Keeping all S stages in flight (a second barrier a
// stage) did not move it, nor did the ring (old staging) for the other epilogues: +80-100%.
template <int DT, int EPI, int T>
__device__ __forceinline__ void mmqt_kernel_body(const MmParams& p) {
    if constexpr (EPI == EPI_SWIGLU && QtPipe<DT, EPI, T>::S >= 2) {
        mmqt_pipe_body<DT, EPI, T>(p);
    } else {
        mmqt_body<DT, EPI, T, T == QT_NT && DT != DT_Q8_0>(p);
    }
}

#else

template <int DT, int EPI, int T>
__device__ __forceinline__ void mmqt_kernel_body(const MmParams& p) {}

#endif
