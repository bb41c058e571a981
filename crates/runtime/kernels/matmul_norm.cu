// dflash-rs CUDA kernels (a part of matmul.cu): the RMS norm as the prologue of the int8
// product after it (`mmqn_*`, `mmqsn_*`), so a decode step needs no norm launch before its
// q/k/v and gate/up products.
//
// The host defers a quantizing norm of a few rows (cuda/norm_fuse.rs) and hands it to the
// product that reads its output: x then arrives as f32 rows (p.nx), not yet normalised. Every
// block of the product normalises the rows of its tile itself, with the norm kernel's
// arithmetic in the norm kernel's order (rms_norm_staged_q8, ops.cu): the rows staged in shared
// memory, lanes 0..15 of warp m making row m's sixteen partial sums of squares (partial l
// over i = l, l + 16, ... in increasing order), norm_inv's halving tree, y = w' * (x * inv),
// then q8_block per 32-value block. So the int8 codes each block multiplies, and everything
// after them, have the bits of the norm launch followed by the plain product. The blocks of
// the first column (blockIdx.x == 0) also write what the norm launch would have: y to p.nout
// and the int8 copy to p.x / p.xs (later products of the same x read that copy, and later
// readers of y find it), while every block reads its own copy from shared memory.
//
// The norm weight is the host's, so it is staged before the wait for the kernel before; x is
// read after it. Dynamic shared memory (`mm_norm_smem_bytes` in cuda/norm_fuse.rs), in order:
// x as f32 [MT][K], the weight w' [K], the codes [MT][K], the (d, ds) pairs [MT][K / 32].

struct NormSmem {
    float* x;
    float* w;
    signed char* codes;
    float2* pairs;
};

// The regions of the dynamic shared memory for MT rows of K values (K % 32 == 0, so the codes
// start 16-byte aligned and the pairs 8-byte aligned).
__device__ __forceinline__ NormSmem mm_norm_regions(int mt, int k) {
    extern __shared__ __align__(16) unsigned char mm_norm_smem[];
    NormSmem s;
    s.x = (float*)mm_norm_smem;
    s.w = s.x + (size_t)mt * k;
    s.codes = (signed char*)(s.w + k);
    s.pairs = (float2*)(s.codes + (size_t)mt * k);
    return s;
}

// The prologue (see above) for the MT rows of x from m0; every thread of the block calls it
// (it has block barriers) before anything else, and it waits for the kernel before.
template <int MT>
__device__ __forceinline__ NormSmem mm_norm_x(const MmParams& p, int m0) {
    __shared__ float s_inv[MT];
    const int K = p.k;
    const NormSmem s = mm_norm_regions(MT, K);
    const int tid = threadIdx.x;
    const int nt = blockDim.x;
    const float* nw = (const float*)p.nw;
    for (int i = tid; i < K; i += nt) s.w[i] = norm_weight(nw[i], p.nzc);
    df_kernel_begin();
    const int ml = min(MT, p.m - m0);
    // The tile's rows are contiguous: 16-byte loads (K % 4 == 0).
    const float4* x4 = (const float4*)((const float*)p.nx + (size_t)m0 * K);
    float4* s4 = (float4*)s.x;
    for (int i = tid; i < ml * K / 4; i += nt) s4[i] = x4[i];
    __syncthreads();
    const int warp = tid >> 5;
    const int lane = tid & 31;
    if (warp < ml) {
        const float* xr = s.x + (size_t)warp * K;
        float acc = 0.0f;
        if (lane < 16) {
#pragma unroll 8
            for (int i = lane; i < K; i += 16) acc = __fadd_rn(acc, __fmul_rn(xr[i], xr[i]));
        }
        const float inv = norm_inv(acc, K, p.neps);
        if (lane == 0) s_inv[warp] = inv;
    }
    __syncthreads();
    // Block u of the tile (row u / nb, block u % nb) to warp u % warps; lane j holds value j.
    const int nb = K / GROUP;
    const bool first = blockIdx.x == 0;
    for (int u = warp; u < ml * nb; u += nt >> 5) {
        const int m = u / nb;
        const int i = (u - m * nb) * GROUP + lane;
        const float y = __fmul_rn(s.w[i], __fmul_rn(s.x[(size_t)m * K + i], s_inv[m]));
        signed char* code = s.codes + (size_t)m * K + i;
        q8_block(y, lane, code, s.pairs + u);
        if (first) {
            const size_t gi = (size_t)(m0 + m) * K + i;
            ((float*)p.nout)[gi] = y;
            ((signed char*)p.x)[gi] = *code;
            if (lane == 0) ((float2*)p.xs)[(size_t)m0 * nb + u] = s.pairs[u];
        }
    }
    __syncthreads();
    return s;
}
