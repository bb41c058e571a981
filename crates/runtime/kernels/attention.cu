// dflash-rs CUDA kernels: softmax attention of each token's query heads over its own row's
// KV slice kv_start..kv_end, split over the key length (flash-decoding).
#include "common.cu"

// Keys are cut into tiles of 32 at fixed offsets from kv_start; a token with `ntiles` tiles
// has its tiles grouped into nsplit <= ATT_MAX_SPLITS contiguous splits of `tps` tiles
// (tps = ceil(ntiles / ATT_MAX_SPLITS), at least 2). Everything below depends on the token's own
// (q, KV slice, kv length) only, never on the other tokens of the batch, so a token gets the
// same output alone (decode), in a verify block, or next to other rows.
//
// attention_split: a block per (token, KV head, split). The G query heads of the KV head's
// group share every K and V load. A split's tiles are dealt to ATT_SLOTS slots: slot s takes
// tiles s, s + ATT_SLOTS, ... of the split and keeps, per query head, an online softmax state
// (running max m, running sum l, unnormalised output acc over head dimensions, lanes owning
// dimensions lane + 32 i):
//   1. lane j scores key (tile start + j) for each of the G heads: dot(q, k) walked in
//      dimension order with fma (four dimensions per 16-byte load), times scale;
//   2. per head, the tile max and the sum of exp(score - new max) use the fixed warp trees;
//   3. acc is rescaled, then the tile's values are added in key order with fma.
// Slot s's state and slot s + ATT_SLOTS / 2's merge first (att_pair), then the pairs in order,
// and the split's (m, l, acc) is written out. The block's warps take the slots in turn (warp
// w: slots w, w + warps), so a launch may give its blocks one warp per slot (decode: every
// tile of a split in flight at once) or half as many (verify and prompt launches: more
// blocks per SM) without changing a bit. Up to ATT_SLOTS / 2 tiles a split (2,048 keys)
// the upper slots are empty and the bits are those of one state per lower slot.
//
// attention_merge: a block per (token, query head) combines the token's splits in split
// order: m* = max m_s, f_s = exp(m_s - m*), out = (sum acc_s f_s) / (sum l_s f_s).
// attention_merge_q8 also quantizes out to int8 for the output projection (q8_terms: one or two
// terms), saving its quantizer launch.
//
// With p.count set, attention_split merges by itself (one launch per layer instead of two):
// every split block of a (token, KV head) counts itself in after writing its state, and the
// last one to arrive merges the group's query heads with the merge kernel's arithmetic and
// order (att_merge_out), so the bits do not depend on which block that is, nor on the mode.

// ATT_SLOTS (8), ATT_MAX_SPLITS (16), ATT_MAX_GHD (1024: query heads per group x head_dim)
// and ATT_PREFETCH_MAX_TOKENS (16) are defined by the host (cuda/compile.rs,
// `shared_constants`), and so is DF_KV_HALF: the module is compiled for one cache type
// (`KvType`), 1 where the cache holds f16. Keys and values are widened to f32 as they are
// loaded (exactly), so every variant does the same arithmetic on the values the cache holds.

#if DF_KV_HALF
typedef u16 kv_t;
// Four consecutive cache values (8-byte aligned), widened.
__device__ __forceinline__ float4 kv_load4(const kv_t* p) {
    const uint2 w = *(const uint2*)p;
    return make_float4(f16_to_f32((u16)(w.x & 0xffffu)), f16_to_f32((u16)(w.x >> 16)),
                       f16_to_f32((u16)(w.y & 0xffffu)), f16_to_f32((u16)(w.y >> 16)));
}
__device__ __forceinline__ float kv_load(const kv_t* p) { return f16_to_f32(*p); }
#else
typedef float kv_t;
__device__ __forceinline__ float4 kv_load4(const kv_t* p) { return *(const float4*)p; }
__device__ __forceinline__ float kv_load(const kv_t* p) { return *p; }
#endif

struct AttParams {
    u64 q;        // [T, n_heads * head_dim]
    u64 meta;     // [T][4] u32: row, pos, kv_start, kv_end
    u64 rows;     // RowDesc per KV row
    u64 part;     // [T][n_heads][ATT_MAX_SPLITS][2 + head_dim] f32 partial states
    u64 out;      // [T, n_heads * head_dim]
    int layer;
    int t;
    int n_heads;
    int n_kv_heads;
    int head_dim;
    int kv_dim;
    float scale;
    int form;  // the form word of the int8 copy (q8_at in common.cu: terms, rows or tiled)
    u64 qc;  // attention_merge_q8 (head_dim % 32 == 0): out quantized, its codes (q8_terms)
    u64 qs;  // and their (d, ds) pairs
    u64 count;  // [T][n_kv_heads] u32 arrivals, zero between launches; 0: a separate merge launch
    L2Ahead ahead;  // weights of the launches after this one, requested into L2 (split kernel)
};

// Splits of a token with `len` visible keys, and tiles per split.
__device__ __forceinline__ void att_splits(int len, int* nsplit, int* tps) {
    const int ntiles = (len + 31) >> 5;
    // At least two tiles per split: half the blocks and splits to merge at short contexts
    // (a 512-token prompt prefills at 56k tok/s instead of 48k on the H200; decode unchanged).
    const int per = max((ntiles + ATT_MAX_SPLITS - 1) / ATT_MAX_SPLITS, ntiles > 0 ? 2 : 0);
    *tps = per;
    *nsplit = per > 0 ? (ntiles + per - 1) / per : 0;
}

__device__ __forceinline__ float* att_part(const AttParams& p, int t, int h, int s) {
    return (float*)p.part + (((size_t)t * p.n_heads + h) * ATT_MAX_SPLITS + s) * (size_t)(2 + p.head_dim);
}

// Output d of query head h of token t from the token's nsplit split states (all written and
// visible): the merge's arithmetic in split order (attention_merge_body holds the same steps,
// one split per lane for m* and f_s; max and exp do not depend on where they run). Parts are
// read past L1 (__ldcg): other blocks wrote them during this launch. With p.qc, whole warps
// call this for 32 consecutive dimensions of one head (head_dim % 32 == 0) and quantize.
__device__ __forceinline__ void att_merge_out(const AttParams& p, int t, int h, int d, int nsplit) {
    float ms[ATT_MAX_SPLITS], ls[ATT_MAX_SPLITS], vs[ATT_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) {
        ms[s] = -DF_INF;
        ls[s] = 0.0f;
        vs[s] = 0.0f;
        if (s < nsplit) {
            const float* ps = att_part(p, t, h, s);
            ms[s] = __ldcg(ps);
            ls[s] = __ldcg(ps + 1);
            vs[s] = __ldcg(ps + 2 + d);
        }
    }
    float gm = -DF_INF;
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) {
        if (ls[s] > 0.0f) gm = fmaxf(gm, ms[s]);
    }
    float o = 0.0f;
    float gl = 0.0f;
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) {
        if (ls[s] > 0.0f) {
            const float f = expf(__fsub_rn(ms[s], gm));
            gl = __fadd_rn(gl, __fmul_rn(ls[s], f));
            o = __fmaf_rn(vs[s], f, o);
        }
    }
    const float inv = gl > 0.0f ? __fdiv_rn(1.0f, gl) : 0.0f;
    const float y = __fmul_rn(o, inv);
    const size_t i = (size_t)t * p.n_heads * p.head_dim + (size_t)h * p.head_dim + d;
    ((float*)p.out)[i] = y;
    if (p.qc) {
        const int n = p.n_heads * p.head_dim;
        q8_terms(y, threadIdx.x & 31, (signed char*)p.qc, (float2*)p.qs, t, h * p.head_dim + d, n, p.form);
    }
}

// The in-kernel merge (p.count): called by every split block of (t, kvh) after its state is
// written; the last to arrive merges the G query heads and resets the count for the next
// launch. A token with no keys (nsplit == 0) gets the merge of nothing (zeros) from split 0.
__device__ __forceinline__ void att_merge_last(const AttParams& p, int t, int kvh, int G, int nsplit) {
    __shared__ int s_last;
    if (nsplit > 0) {
        __threadfence();  // this block's states, visible before it counts itself in
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned* c = (unsigned*)p.count + (size_t)t * p.n_kv_heads + kvh;
            const int last = atomicAdd(c, 1u) == (unsigned)nsplit - 1;
            if (last) *c = 0u;  // every split has counted: nothing else touches it this launch
            s_last = last;
        }
        __syncthreads();
        if (!s_last) return;
        __threadfence();
    }
    const int hd = p.head_dim;
    for (int idx = threadIdx.x; idx < G * hd; idx += blockDim.x) {
        const int g = idx / hd;
        att_merge_out(p, t, kvh * G + g, idx - g * hd, nsplit);
    }
}

// One slot's (or pair's) online softmax state to shared memory (lane d of the warp holds
// dimensions d + 32 i).
template <int PER, int GM>
__device__ __forceinline__ void att_store(float* sm, float* sl, float* sacc, const float (&m)[GM], const float (&l)[GM],
                                          const float (&acc)[GM][PER], int G, int hd) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g < G) {
            if (lane == 0) {
                sm[g] = m[g];
                sl[g] = l[g];
            }
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int d = lane + 32 * i;
                if (d < hd) sacc[g * hd + d] = acc[g][i];
            }
        }
    }
}

// (m, l, acc), the state of a pair's upper slot, becomes the merge of the lower slot's state
// (m0, l0, acc0) and itself: a state that saw no key (l == 0) leaves the other as it is; else
// both are rescaled to the larger max and added, lower first.
template <int PER, int GM>
__device__ __forceinline__ void att_pair(const float (&m0)[GM], const float (&l0)[GM], const float (&acc0)[GM][PER],
                                         float (&m)[GM], float (&l)[GM], float (&acc)[GM][PER], int G) {
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G || !(l0[g] > 0.0f)) continue;
        if (l[g] > 0.0f) {
            const float mn = fmaxf(m0[g], m[g]);
            const float f0 = expf(__fsub_rn(m0[g], mn));
            const float f1 = expf(__fsub_rn(m[g], mn));
            l[g] = __fadd_rn(__fmul_rn(l0[g], f0), __fmul_rn(l[g], f1));
#pragma unroll
            for (int i = 0; i < PER; i++) acc[g][i] = __fmaf_rn(acc[g][i], f1, __fmul_rn(acc0[g][i], f0));
            m[g] = mn;
        } else {
            m[g] = m0[g];
            l[g] = l0[g];
#pragma unroll
            for (int i = 0; i < PER; i++) acc[g][i] = acc0[g][i];
        }
    }
}

// PER = dimensions per lane (head_dim <= 32 * PER), GM = most query heads per KV head.
// EARLY: the first tile's loads before q is staged (below).
template <int PER, int GM, bool EARLY>
__device__ __forceinline__ void attention_split_body(const AttParams& p) {
    __shared__ __align__(16) float qs[GM * 32 * PER];
    __shared__ float st_m[ATT_SLOTS / 2][GM];
    __shared__ float st_l[ATT_SLOTS / 2][GM];
    __shared__ float st_acc[ATT_SLOTS / 2][GM * 32 * PER];

    const int t = blockIdx.x;
    const int kvh = blockIdx.y;
    const int sp = blockIdx.z;
    const int hd = p.head_dim;
    const int G = GM;  // the kernel is chosen for the model's exact group (host)
    // Before the wait for the kernel before: what only the host writes (the token's metadata
    // and the KV row table, copied before the step) and, in launches of at most
    // ATT_PREFETCH_MAX_TOKENS tokens (decode, verify), the split's keys and values requested
    // into L2, so the reads after the wait find them there (decode +3-5% on the H200; prompt
    // launches, whose blocks share most of their rows, lose 3-5% with it). An L2 prefetch is safe even where the kernel before writes those
    // rows (the new tokens' keys): writes land in L2, so the lines read after the wait are
    // the written ones.
    const u32* meta = (const u32*)p.meta + 4 * t;
    const int start = (int)meta[2];
    const int end = (int)meta[3];
    int nsplit, tps;
    att_splits(end > start ? end - start : 0, &nsplit, &tps);
    const RowDesc rd = ((const RowDesc*)p.rows)[meta[0]];
    const kv_t* kb = (const kv_t*)rd.base + (size_t)(2 * p.layer) * rd.cap * p.kv_dim + (size_t)kvh * hd;
    const kv_t* vb = (const kv_t*)rd.base + (size_t)(2 * p.layer + 1) * rd.cap * p.kv_dim + (size_t)kvh * hd;
    if ((EARLY || p.t <= ATT_PREFETCH_MAX_TOKENS) && sp < nsplit) {
        const int k0 = start + 32 * sp * tps;
        const int nk = min(32 * tps, end - k0);
        constexpr int LINE = 128 / (int)sizeof(kv_t);  // values per 128-byte line
        const int lines = (hd + LINE - 1) / LINE;      // lines of a key's head_dim values
        for (int i = threadIdx.x; i < 2 * nk * lines; i += blockDim.x) {
            const int kv = i / (nk * lines);
            const int r = i - kv * nk * lines;
            const int key = r / lines;
            const kv_t* row = (kv ? vb : kb) + (size_t)(k0 + key) * p.kv_dim + LINE * (r - key * lines);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(row));
        }
    }
    // Then the weights of the products after attention (the host's hint, after the keys and
    // values this launch needs first): attention is a chain of dependent steps that leaves
    // HBM mostly idle.
    df_l2_ahead(p.ahead);
    df_kernel_begin();
    if (nsplit == 0 && sp == 0 && p.count) return att_merge_last(p, t, kvh, G, 0);
    if (sp >= nsplit) return;  // the whole block leaves
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const int lane = threadIdx.x & 31;

    const bool vec4 = ((hd | p.kv_dim) & 3) == 0;
    const int ntile = ((end - start) + 31) >> 5;
    const int tile_end = min((sp + 1) * tps, ntile);
    // Values of VB keys are loaded before they are added (in key order). EARLY with up to 64
    // dimensions: the whole tile's values in one round trip (a decode warp has one tile).
    constexpr int VB = EARLY && PER <= 2 ? 32 : PER <= 2 ? 16 : 8;
    // EARLY: the first tile's keys (the first 64 dimensions, four per 16-byte load) and the
    // values of its first VB keys are requested before q is staged, so the three round trips
    // to memory overlap (a decode step's warps have one tile each at short contexts); else a
    // tile's keys are loaded at its top and its values after the softmax, which holds fewer
    // registers, so more blocks fit an SM (prefill and verify blocks of 16: many blocks).
    float4 kk[16];
    float vv[VB][PER];
    const auto load_k = [&](int t0, int d0) {
        const int j = t0 + lane;
        const kv_t* kr = kb + (size_t)j * p.kv_dim;
        const int n4 = hd / 4;
#pragma unroll
        for (int u = 0; u < 16; u++) kk[u] = j < end && d0 + u < n4 ? kv_load4(kr + 4 * (d0 + u)) : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    const auto load_v = [&](int t0, int k0, int nk) {
#pragma unroll
        for (int u = 0; u < VB; u++) {
            const kv_t* vr = vb + (size_t)(t0 + k0 + u) * p.kv_dim;
#pragma unroll
            for (int i = 0; i < PER; i++) {
                const int d = lane + 32 * i;
                vv[u][i] = (k0 + u < nk && d < hd) ? kv_load(vr + d) : 0.0f;
            }
        }
    };
    // The warp's first slot is slot `warp`: its first tile is loaded early.
    if (EARLY && sp * tps + warp < tile_end) {
        const int t0 = start + 32 * (sp * tps + warp);
        if (vec4) load_k(t0, 0);
        load_v(t0, 0, min(32, end - t0));
    }

    const int q_cols = p.n_heads * hd;
    const float* qt = (const float*)p.q + (size_t)t * q_cols + (size_t)kvh * G * hd;
    // q in one round trip where it can: 16-byte loads (G * hd / 4 <= ATT_MAX_GHD / 4 = 256, two
    // per thread at most, issued together), else one value per load.
    if (vec4) {
        const float4* q4 = (const float4*)qt;
        float4* s4 = (float4*)qs;
        const int n4 = G * hd / 4;
        const int a = threadIdx.x, b = threadIdx.x + blockDim.x;
        const float4 va = a < n4 ? q4[a] : make_float4(0.f, 0.f, 0.f, 0.f);
        const float4 vb = b < n4 ? q4[b] : make_float4(0.f, 0.f, 0.f, 0.f);
        if (a < n4) s4[a] = va;
        if (b < n4) s4[b] = vb;
        for (int i = threadIdx.x + 2 * blockDim.x; i < n4; i += blockDim.x) s4[i] = q4[i];
    } else {
        for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = qt[i];
    }
    __syncthreads();

    // Walks slot `slot`'s tiles into the empty state (m, l, acc); `first`: the slot's first
    // tile was loaded early.
    const auto walk = [&](int slot, bool first, float(&m)[GM], float(&l)[GM], float(&acc)[GM][PER]) {
#pragma unroll
        for (int g = 0; g < GM; g++) {
            m[g] = -DF_INF;
            l[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; i++) acc[g][i] = 0.0f;
        }
        for (int tile = sp * tps + slot; tile < tile_end; tile += ATT_SLOTS, first = false) {
            const int t0 = start + 32 * tile;
            const int j = t0 + lane;
            const bool valid = j < end;
            const int nk = min(32, end - t0);
            if (!EARLY || !first) {
                if (vec4) load_k(t0, 0);
                if (EARLY) load_v(t0, 0, nk);
            }
            float dot[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) dot[g] = 0.0f;
            if (vec4) {
                // The products in dimension order, 16 loads of four dimensions at a time.
                const int n4 = hd / 4;
                for (int d0 = 0; d0 < n4; d0 += 16) {
                    if (d0 > 0) load_k(t0, d0);
#pragma unroll
                    for (int u = 0; u < 16; u++) {
                        if (valid && d0 + u < n4) {
#pragma unroll
                            for (int g = 0; g < GM; g++) {
                                if (g < G) {
                                    const float4 q4 = *(const float4*)(qs + g * hd + 4 * (d0 + u));
                                    float a = dot[g];
                                    a = __fmaf_rn(q4.x, kk[u].x, a);
                                    a = __fmaf_rn(q4.y, kk[u].y, a);
                                    a = __fmaf_rn(q4.z, kk[u].z, a);
                                    a = __fmaf_rn(q4.w, kk[u].w, a);
                                    dot[g] = a;
                                }
                            }
                        }
                    }
                }
            } else if (valid) {
                const kv_t* kr = kb + (size_t)j * p.kv_dim;
                for (int d = 0; d < hd; d++) {
                    const float kv = kv_load(kr + d);
#pragma unroll
                    for (int g = 0; g < GM; g++) {
                        if (g < G) dot[g] = __fmaf_rn(qs[g * hd + d], kv, dot[g]);
                    }
                }
            }
            float pr[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) {
                if (g < G) {
                    const float sc = valid ? __fmul_rn(dot[g], p.scale) : -DF_INF;
                    const float mn = fmaxf(m[g], warp_max(sc));
                    const float corr = expf(__fsub_rn(m[g], mn));
                    pr[g] = valid ? expf(__fsub_rn(sc, mn)) : 0.0f;
                    l[g] = __fadd_rn(__fmul_rn(l[g], corr), warp_sum(pr[g]));
                    m[g] = mn;
#pragma unroll
                    for (int i = 0; i < PER; i++) acc[g][i] = __fmul_rn(acc[g][i], corr);
                } else {
                    pr[g] = 0.0f;
                }
            }
            for (int k0 = 0; k0 < nk; k0 += VB) {
                if (k0 > 0 || !EARLY) load_v(t0, k0, nk);
#pragma unroll
                for (int u = 0; u < VB; u++) {
                    if (k0 + u < nk) {
#pragma unroll
                        for (int g = 0; g < GM; g++) {
                            if (g < G) {
                                const float pk = __shfl_sync(DF_FULL_MASK, pr[g], k0 + u);
#pragma unroll
                                for (int i = 0; i < PER; i++) acc[g][i] = __fmaf_rn(pk, vv[u][i], acc[g][i]);
                            }
                        }
                    }
                }
            }
        }
    };

    // Slot s and slot s + ATT_PAIR merge first (att_pair), then the ATT_PAIR pairs in order.
    // The lower slot's state goes to st_* (pair s's place); the warp that walked the upper
    // slot, which has tiles only past ATT_PAIR tiles a split, merges it in. With ATT_SLOTS
    // warps (one slot each; every warp runs the loop once, so the barrier is uniform) that is
    // warp s + ATT_PAIR after the lower warp's store; with ATT_PAIR warps warp s walks both.
    constexpr int ATT_PAIR = ATT_SLOTS / 2;
    for (int slot = warp; slot < ATT_SLOTS; slot += warps) {
        float m[GM], l[GM], acc[GM][PER];
        walk(slot, slot == warp, m, l, acc);
        if (slot < ATT_PAIR) att_store<PER, GM>(st_m[slot], st_l[slot], st_acc[slot], m, l, acc, G, hd);
        if (warps == ATT_SLOTS) {
            __syncthreads();
        } else {
            __syncwarp();
        }
        if (slot >= ATT_PAIR && sp * tps + slot < tile_end) {
            const int s = slot - ATT_PAIR;
            float m0[GM], l0[GM], acc0[GM][PER];
#pragma unroll
            for (int g = 0; g < GM; g++) {
                m0[g] = st_m[s][g];
                l0[g] = st_l[s][g];
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int d = lane + 32 * i;
                    acc0[g][i] = d < hd ? st_acc[s][g * hd + d] : 0.0f;
                }
            }
            __syncwarp();
            att_pair<PER, GM>(m0, l0, acc0, m, l, acc, G);
            att_store<PER, GM>(st_m[s], st_l[s], st_acc[s], m, l, acc, G, hd);
        }
    }
    __syncthreads();

    // Merge the pairs in order (a pair that saw no key has l == 0 and is skipped).
    for (int idx = threadIdx.x; idx < G * (hd + 2); idx += blockDim.x) {
        const int g = idx / (hd + 2);
        const int c = idx - g * (hd + 2);
        float gm = -DF_INF;
        for (int w = 0; w < ATT_PAIR; w++) {
            if (st_l[w][g] > 0.0f) gm = fmaxf(gm, st_m[w][g]);
        }
        float v = 0.0f;
        if (c == 0) {
            v = gm;
        } else {
            for (int w = 0; w < ATT_PAIR; w++) {
                if (st_l[w][g] > 0.0f) {
                    const float f = expf(__fsub_rn(st_m[w][g], gm));
                    v = c == 1 ? __fadd_rn(v, __fmul_rn(st_l[w][g], f)) : __fmaf_rn(st_acc[w][g * hd + c - 2], f, v);
                }
            }
        }
        att_part(p, t, kvh * G + g, sp)[c] = v;
    }
    if (p.count) att_merge_last(p, t, kvh, G, nsplit);
}

// attention_split_<PER>_<GM> and attention_split_early_<PER>_<GM> (EARLY loads; the host
// takes them for launches of few tokens, ATT_EARLY_MAX_ROWS in cuda/attention.rs).
#define ATT_KERNEL(PER, GM)                                                                   \
    extern "C" __global__ void __launch_bounds__(ATT_SLOTS * 32)                              \
        attention_split_##PER##_##GM(const AttParams p) {                                     \
        attention_split_body<PER, GM, false>(p); /* waits itself, after the host's data */    \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_SLOTS * 32)                              \
        attention_split_early_##PER##_##GM(const AttParams p) {                               \
        attention_split_body<PER, GM, true>(p); /* waits itself */                            \
    }

// Dimensions per lane (head_dim up to 32, 64, 128, 256) x query heads per KV head, exactly
// (1..8; a compile-time group count drops the work and branches of absent heads: 8.7 against
// 12.4 us per decode call of the default model on the H200), GM * 32 * PER <= ATT_MAX_GHD.
#define ATT_KERNELS_G8(PER)                                                                    \
    ATT_KERNEL(PER, 1) ATT_KERNEL(PER, 2) ATT_KERNEL(PER, 3) ATT_KERNEL(PER, 4)                 \
    ATT_KERNEL(PER, 5) ATT_KERNEL(PER, 6) ATT_KERNEL(PER, 7) ATT_KERNEL(PER, 8)
ATT_KERNELS_G8(1)
ATT_KERNELS_G8(2)
ATT_KERNELS_G8(4)
ATT_KERNEL(8, 1) ATT_KERNEL(8, 2) ATT_KERNEL(8, 3) ATT_KERNEL(8, 4)

// Block per (token, query head); thread per head dimension (blockDim.x >= head_dim, a
// multiple of 32). Lane s of each warp holds split s's (m, l) and computes its factor
// f_s = exp(m_s - m*) once; the splits are then combined in split order from shuffled
// factors (the same operations and order as one thread evaluating every factor).
// Q: out is also quantized for an int8 output projection (attention_merge_q8).
template <bool Q>
__device__ __forceinline__ void attention_merge_body(const AttParams& p) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int d = threadIdx.x;
    const int lane = threadIdx.x & 31;
    const int hd = p.head_dim;
    // The token's metadata is the host's (copied before the step): read before the wait.
    const u32* meta = (const u32*)p.meta + 4 * t;
    const int start = (int)meta[2];
    const int end = (int)meta[3];
    int nsplit, tps;
    att_splits(end > start ? end - start : 0, &nsplit, &tps);
    df_kernel_begin();
    float ms = -DF_INF, ls = 0.0f;
    if (lane < nsplit) {
        const float* ps = att_part(p, t, h, lane);
        ms = ps[0];
        ls = ps[1];
    }
    float vs[ATT_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) vs[s] = (s < nsplit && d < hd) ? att_part(p, t, h, s)[2 + d] : 0.0f;
    const float gm = warp_max(ls > 0.0f ? ms : -DF_INF);
    const float fs = ls > 0.0f ? expf(__fsub_rn(ms, gm)) : 0.0f;
    float o = 0.0f;
    float gl = 0.0f;
#pragma unroll
    for (int s = 0; s < ATT_MAX_SPLITS; s++) {
        const float f = __shfl_sync(DF_FULL_MASK, fs, s);
        const float l = __shfl_sync(DF_FULL_MASK, ls, s);
        if (l > 0.0f) {
            gl = __fadd_rn(gl, __fmul_rn(l, f));
            o = __fmaf_rn(vs[s], f, o);
        }
    }
    const float inv = gl > 0.0f ? __fdiv_rn(1.0f, gl) : 0.0f;
    if (d < hd) {
        const float y = __fmul_rn(o, inv);
        const size_t i = (size_t)t * p.n_heads * hd + (size_t)h * hd + d;
        ((float*)p.out)[i] = y;
        // Warp w holds block i / 32 of the row in its lanes (head_dim % 32 == 0 with Q, so
        // whole warps take this branch).
        if (Q) {
            const int n = p.n_heads * hd;
            q8_terms(y, lane, (signed char*)p.qc, (float2*)p.qs, t, h * hd + d, n, p.form);
        }
    }
}

extern "C" __global__ void attention_merge(const AttParams p) {
    attention_merge_body<false>(p); /* waits itself, after the host's metadata */
}

extern "C" __global__ void attention_merge_q8(const AttParams p) {
    attention_merge_body<true>(p); /* waits itself */
}
