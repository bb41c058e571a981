// dflash-rs CUDA kernels: shared definitions.
//
// This file is not compiled on its own: the Rust side pastes it in place of the
// `#include "common.cu"` line of every other kernel file before handing the source to NVRTC.
// It needs no CUDA header (no <cuda_fp16.h>, no <stdint.h>), so NVRTC compiles the kernels
// with no include path at all.
//
// Numerics. The kernels are compiled with --fmad=false, so the compiler never fuses a
// multiply and an add on its own: every fused multiply-add below is written out
// (`__fmaf_rn`), exactly where the CPU reference (crates/runtime/src/quant/*.rs) uses
// `mul_add`, and everything else rounds after each operation as the Rust code does.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define DF_INF (__int_as_float(0x7f800000))
#define DF_FULL_MASK 0xffffffffu

// Stored formats: DT_<NAME> (format number) and DT_<NAME>_BYTES (bytes per block) are
// defined ahead of this file by the Rust side, from the format table (`dtype::FORMATS`), and so
// are the launch shapes and limits host and kernels share (block sizes, tiles, splits: see
// `shared_constants` in cuda/compile.rs).

// A KV row's storage: one allocation of 2 * layers * cap * kv_dim values (f32, or f16 in a
// half cache: `KvType`, kv_put and kv_addr below); layer l's keys at (2l) * cap * kv_dim, its values
// at (2l + 1) * cap * kv_dim, position-major. Released rows have base 0 and cap 0. Mirrors
// `RowDesc` in cuda/kv.rs.
struct RowDesc {
    u64 base;
    u64 cap;
};

// Programmatic dependent launch (sm_90 and later). The Rust side launches every kernel with
// programmatic stream serialization, so a kernel's blocks may start while the kernel before it
// in the stream is still running. Every kernel therefore calls df_kernel_begin() first, before
// it reads anything or leaves: `griddepcontrol.wait` returns once the previous grid has
// completed and its writes are visible (so a kernel also waits, transitively, for every
// earlier one), then `griddepcontrol.launch_dependents` lets the next kernel's blocks start
// and wait in turn, which hides the launch gap between dependent kernels. Both are no-ops for
// a kernel launched without the attribute, and are left out below sm_90.
__device__ __forceinline__ void df_kernel_begin() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Weights that launches after this one will read: up to L2A_RANGES byte ranges (16-byte
// aligned, lengths multiples of 16; zero length: none), handed to the attention split and
// product kernels by the host (cuda/l2_ahead.rs). df_l2_ahead, called before the kernel waits for
// the one before it, asks the copy engine of each SM to bring them into L2 in chunks of
// L2A_CHUNK bytes, dealt to the grid's blocks in turn (chunk i: block i mod blocks, then
// thread), so HBM streams them while the step waits on dependent steps. A hint only: nothing
// waits for it and no result depends on it (below sm_90 it does nothing).
struct L2Ahead {
    u64 base[L2A_RANGES];
    u64 bytes[L2A_RANGES];
};

__device__ __forceinline__ void df_l2_ahead(const L2Ahead& a) {
#if __CUDA_ARCH__ >= 900
    const u64 blocks = (u64)gridDim.x * gridDim.y * gridDim.z;
    const u64 block = ((u64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    const u64 workers = blocks * blockDim.x;
    const u64 me = (u64)threadIdx.x * blocks + block;
    u64 first = 0;  // chunks of the ranges before
#pragma unroll
    for (int r = 0; r < L2A_RANGES; r++) {
        const u64 n = (a.bytes[r] + L2A_CHUNK - 1) / L2A_CHUNK;
        for (u64 c = (me + workers - first % workers) % workers; c < n; c += workers) {
            const u64 off = c * L2A_CHUNK;
            const u32 len = (u32)min((u64)L2A_CHUNK, a.bytes[r] - off);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a.base[r] + off), "r"(len) : "memory");
        }
        first += n;
    }
#endif
}

// Token metadata, 4 u32 per token: row, pos, kv_start, kv_end (backend::TokenMeta).
#define META_ROW 0
#define META_POS 1
#define META_START 2
#define META_END 3

// ---- RoPE arithmetic (ops.cu's rope kernels and matmul.cu's rope epilogue) -----------------
//
// Rotates the first 2*half dimensions of every head_dim head of token t at its position.
// angle = pos * inv_freq[i] in f32 (as the CPU and HF compute it); cos and sin are evaluated
// in double and rounded to f32 (closer to the CPU's libm cosf/sinf than the f32 intrinsics).
// style 0: neox (i pairs with i + half); style 1: interleaved (2i pairs with 2i + 1).

// Pair i of a head: the offsets of its two values.
__device__ __forceinline__ void rope_offsets(int i, int half, int style, int* ia, int* ib) {
    *ia = style == 0 ? i : 2 * i;
    *ib = style == 0 ? i + half : 2 * i + 1;
}

// cos and sin of pair i's angle at position pos.
__device__ __forceinline__ void rope_cs(int i, float pos, const float* inv_freq, float* c, float* s) {
    const float angle = __fmul_rn(pos, inv_freq[i]);
    double sd, cd;
    sincos((double)angle, &sd, &cd);
    *c = (float)cd;
    *s = (float)sd;
}

// The pair (a, b) rotated by the angle of (c, s).
__device__ __forceinline__ void rope_apply(float a, float b, float c, float s, int style, float* ra, float* rb) {
    if (style == 0) {
        *ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        *rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    } else {
        *ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        *rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// The pair (a, b) at pair index i rotated to angle pos * inv_freq[i].
__device__ __forceinline__ void rope_rotate(float a, float b, int i, int style, float pos, const float* inv_freq,
                                            float* ra, float* rb) {
    float c, s;
    rope_cs(i, pos, inv_freq, &c, &s);
    rope_apply(a, b, c, s, style, ra, rb);
}

// Values per decode group: every format is read 32 values at a time (quant::GROUP).
#define GROUP 32

// IEEE half (bits) to float: exact.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// float to IEEE half (bits), rounded to nearest even (infinite past +-65504): the CPU's
// `half::f16::from_f32`.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The KV cache's values (`KvType`): f32, or f16 (half != 0) rounded once when written and
// widened exactly when read, so every reader of a position sees the same bits. `at` is the
// address of value 0 of a run; kv_put writes value i of it.
__device__ __forceinline__ void kv_put(u64 at, size_t i, float v, int half) {
    if (half) {
        ((u16*)at)[i] = f32_to_f16(v);
    } else {
        ((float*)at)[i] = v;
    }
}

// The address of value i of a KV row's storage (`base`).
__device__ __forceinline__ u64 kv_addr(u64 base, size_t i, int half) {
    return base + (half ? 2 * i : 4 * i);
}

// bfloat16 (bits) to float: exact.
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __int_as_float(((u32)h) << 16);
}

// Byte k (0..3) of `w`, minus OFF, as an exact float. The byte becomes the low mantissa bits
// of 2^23 (one byte permute: 0x4B0000bb is the float 2^23 + b), and one exact subtraction
// takes 2^23 + OFF away. Bit-identical to (float)((int)b - OFF), but integer-to-float
// conversions issue at a quarter of the FP32 rate (16 per SM per clock on sm_80/sm_90), which
// capped the M = 1 products at about one weight per conversion: far below memory speed.
template <int OFF>
__device__ __forceinline__ float byte_to_f32(u32 w, int k) {
    const u32 bits = __byte_perm(w, 0x4B000000u, 0x7540u | (u32)k);
    return __fsub_rn(__int_as_float(bits), 8388608.0f + (float)OFF);
}

// The four low nibbles and the four high nibbles of `w`, one per byte.
#define DF_LO_NIBBLES(w) ((w) & 0x0F0F0F0Fu)
#define DF_HI_NIBBLES(w) (((w) >> 4) & 0x0F0F0F0Fu)

// Little-endian u16 at a 2-byte aligned address.
__device__ __forceinline__ u16 ld_u16(const u8* p) {
    return *(const u16*)p;
}

// Little-endian u32 at a 4-byte aligned address.
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return *(const u32*)p;
}

// ---- group decoders: values g*32 .. g*32+32 of a row -------------------------------------
// `row` is the start of the row; rows start at multiples of the row size in a buffer from
// cuMemAlloc (256-byte aligned), so each format's natural alignment holds (see each decoder).

// f32: 128 bytes per group, 16-byte aligned (row bytes = 4*K, K a multiple of 32).
__device__ __forceinline__ void decode_f32(const u8* row, int g, float* w) {
    const float4* p = (const float4*)(row + (size_t)g * 128);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        float4 v = p[i];
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
    }
}

// f16 / bf16: 64 bytes per group, 16-byte aligned.
template <bool BF>
__device__ __forceinline__ void decode_half(const u8* row, int g, float* w) {
    const uint4* p = (const uint4*)(row + (size_t)g * 64);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint4 v = p[i];
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u16 lo = (u16)(words[k] & 0xffffu);
            u16 hi = (u16)(words[k] >> 16);
            w[8 * i + 2 * k] = BF ? bf16_to_f32(lo) : f16_to_f32(lo);
            w[8 * i + 2 * k + 1] = BF ? bf16_to_f32(hi) : f16_to_f32(hi);
        }
    }
}

// Q4_0: 18 bytes (f16 d, 16 nibble bytes); 2-byte aligned. Value = (q - 8) * d.
__device__ __forceinline__ void decode_q4_0(const u8* row, int g, float* w) {
    const u8* b = row + (size_t)g * DT_Q4_0_BYTES;
    float d = f16_to_f32(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 8; i++) {
        u16 two = ld_u16(b + 2 + 2 * i);
        u8 q0 = (u8)(two & 0xff);
        u8 q1 = (u8)(two >> 8);
        w[2 * i] = __fmul_rn((float)((int)(q0 & 0x0f) - 8), d);
        w[2 * i + 16] = __fmul_rn((float)((int)(q0 >> 4) - 8), d);
        w[2 * i + 1] = __fmul_rn((float)((int)(q1 & 0x0f) - 8), d);
        w[2 * i + 17] = __fmul_rn((float)((int)(q1 >> 4) - 8), d);
    }
}

// Q4_1: 20 bytes (f16 d, f16 m, 16 nibble bytes); 4-byte aligned. Value = fma(q, d, m).
__device__ __forceinline__ void decode_q4_1(const u8* row, int g, float* w) {
    const u8* b = row + (size_t)g * DT_Q4_1_BYTES;
    u32 dm = ld_u32(b);
    float d = f16_to_f32((u16)(dm & 0xffffu));
    float m = f16_to_f32((u16)(dm >> 16));
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u32 four = ld_u32(b + 4 + 4 * i);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 q = (four >> (8 * k)) & 0xffu;
            w[4 * i + k] = __fmaf_rn((float)(q & 0x0fu), d, m);
            w[4 * i + k + 16] = __fmaf_rn((float)(q >> 4), d, m);
        }
    }
}

// Q8_0: 34 bytes (f16 d, 32 signed bytes); 2-byte aligned. Value = q * d.
__device__ __forceinline__ void decode_q8_0(const u8* row, int g, float* w) {
    const u8* b = row + (size_t)g * DT_Q8_0_BYTES;
    float d = f16_to_f32(ld_u16(b));
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u16 two = ld_u16(b + 2 + 2 * i);
        w[2 * i] = __fmul_rn((float)(signed char)(two & 0xff), d);
        w[2 * i + 1] = __fmul_rn((float)(signed char)(two >> 8), d);
    }
}

// Q4_K: 144-byte super-blocks of 256 values (8 groups): f16 d, f16 dmin, 12 bytes of packed
// 6-bit (scale, min) codes, 128 nibble bytes; group (sub-block) s of the super-block uses
// bytes 32*(s/2).. (low nibbles for even s, high for odd). 16-byte aligned.
// Value = fma(q, d*scale_s, -(dmin*min_s)).
__device__ __forceinline__ void decode_q4k(const u8* row, int g, float* w) {
    const u8* blk = row + (size_t)(g >> 3) * DT_Q4K_BYTES;
    const int sub = g & 7;
    u32 dd = ld_u32(blk);
    float d = f16_to_f32((u16)(dd & 0xffffu));
    float dmin = f16_to_f32((u16)(dd >> 16));
    const u8* s = blk + 4;
    u32 sc, mn;
    if (sub < 4) {
        sc = s[sub] & 63u;
        mn = s[sub + 4] & 63u;
    } else {
        sc = (s[sub + 4] & 0x0fu) | ((u32)(s[sub - 4] >> 6) << 4);
        mn = (u32)(s[sub + 4] >> 4) | ((u32)(s[sub] >> 6) << 4);
    }
    float scale = __fmul_rn(d, (float)sc);
    float neg_min = -__fmul_rn(dmin, (float)mn);
    const uint4* qs = (const uint4*)(blk + 16 + (sub >> 1) * 32);
    const int shift = (sub & 1) * 4;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        uint4 v = qs[i];
        u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
#pragma unroll
            for (int b = 0; b < 4; b++) {
                u32 q = (words[k] >> (8 * b + shift)) & 0x0fu;
                w[16 * i + 4 * k + b] = __fmaf_rn((float)q, scale, neg_min);
            }
        }
    }
}

// Q6_K: 210-byte super-blocks of 256 values: 128 bytes of low nibbles (ql), 64 bytes of
// high 2-bit pairs (qh), 16 signed 8-bit scales, f16 d (at 208). 2-byte aligned.
// Group sub (0..8): half h = sub/4, quarter q = sub%4; low nibble from ql[64h + l + 32(q&1)]
// (low half for q < 2, high half otherwise), high bits (qh[32h + l] >> 2q) & 3; the group's
// two 16-value runs use scales 8h+2q and 8h+2q+1. Value = (d*scale) * (code - 32).
__device__ __forceinline__ void decode_q6k(const u8* row, int g, float* w) {
    const u8* blk = row + (size_t)(g >> 3) * DT_Q6K_BYTES;
    const int sub = g & 7;
    const int half = sub >> 2;
    const int quarter = sub & 3;
    float d = f16_to_f32(ld_u16(blk + 208));
    const int slot = 4 * half + quarter;
    u16 sc2 = ld_u16(blk + 192 + 2 * slot);
    float s0 = __fmul_rn(d, (float)(signed char)(sc2 & 0xff));
    float s1 = __fmul_rn(d, (float)(signed char)(sc2 >> 8));
    const u8* ql = blk + 64 * half + 32 * (quarter & 1);
    const u8* qh = blk + 128 + 32 * half;
    const int lshift = (quarter >> 1) * 4;
    const int hshift = 2 * quarter;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        u16 l2 = ld_u16(ql + 2 * i);
        u16 h2 = ld_u16(qh + 2 * i);
#pragma unroll
        for (int k = 0; k < 2; k++) {
            int l = 2 * i + k;
            u32 low = ((u32)(k ? (l2 >> 8) : (l2 & 0xff)) >> lshift) & 0x0fu;
            u32 high = ((u32)(k ? (h2 >> 8) : (h2 & 0xff)) >> hshift) & 3u;
            int q = (int)(low | (high << 4)) - 32;
            w[l] = __fmul_rn((float)q, l < 16 ? s0 : s1);
        }
    }
}

// Decodes group g of a row stored as DT into w[0..32].
template <int DT>
__device__ __forceinline__ void decode_group(const u8* row, int g, float* w) {
    if (DT == DT_F32) {
        decode_f32(row, g, w);
    } else if (DT == DT_F16) {
        decode_half<false>(row, g, w);
    } else if (DT == DT_BF16) {
        decode_half<true>(row, g, w);
    } else if (DT == DT_Q4_0) {
        decode_q4_0(row, g, w);
    } else if (DT == DT_Q4_1) {
        decode_q4_1(row, g, w);
    } else if (DT == DT_Q8_0) {
        decode_q8_0(row, g, w);
    } else if (DT == DT_Q4K) {
        decode_q4k(row, g, w);
    } else {
        decode_q6k(row, g, w);
    }
}

// ---- warp reductions with a fixed order ----------------------------------------------------

// Sum over the 32 lanes by xor butterfly (offsets 16, 8, 4, 2, 1). Every lane ends with the
// same value: at each step a lane adds its partner's partial to its own, and float addition
// is commutative, so the two partners compute the same sum.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v = __fadd_rn(v, __shfl_xor_sync(DF_FULL_MASK, v, off));
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(DF_FULL_MASK, v, off));
    }
    return v;
}

// ---- int8 activations ----------------------------------------------------------------------
//
// One 32-value block of x quantized to int8 as the CPU defines it (cpu/int8/quantize.rs), bit
// for bit: amax = max |x_j| (compared as bits), d = amax / 127, q_j = clamp(rint(x_j * (127 /
// amax)), -127, 127) (inverse 0 when amax = 0), and per block (d, d * Σ q_j). Called by a whole
// warp, lane j holding x_j: lane j writes code j to `code`, lane 0 the block's pair to `scale`;
// returns the value the code stands for, fl(q_j * d). Every kernel that writes int8 x
// (quant_q8_f32, and the RMS norm, the attention merge and the SwiGLU product when they also
// hand their output to int8 products) goes through here, so all give the same bits; max and an
// integer sum are exact in any order.
__device__ __forceinline__ float q8_block(float v, int lane, signed char* code, float2* scale) {
    u32 a = __float_as_uint(v) & 0x7fffffffu;
#if __CUDA_ARCH__ >= 800
    a = __reduce_max_sync(DF_FULL_MASK, a);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(DF_FULL_MASK, a, o));
#endif
    const float amax = __uint_as_float(a);
    const float d = __fdiv_rn(amax, 127.0f);
    const float inv = amax > 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    const int q = (int)fminf(fmaxf(rintf(__fmul_rn(v, inv)), -127.0f), 127.0f);
    *code = (signed char)q;
#if __CUDA_ARCH__ >= 800
    const int sum = __reduce_add_sync(DF_FULL_MASK, q);
#else
    int sum = q;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(DF_FULL_MASK, sum, o);
#endif
    if (lane == 0) *scale = make_float2(d, __fmul_rn(d, (float)sum));
    return __fmul_rn((float)q, d);
}

// Where value (row, col) of a row-major [rows, n] f32 tensor goes in its int8 copy of form `form`
// (cuda/int8_x.rs `X8Form`: the terms per row below the flag X8_TILED, defined by the host),
// for term `term` (0, or 1: the residual's): its code's byte offset from the codes and its
// block's pair's index from the pairs.
// - By rows: int8 rows interleave (row i's first term is int8 row terms * i, its second the
//   row after, so rows m0.. of x are one run of int8 rows), codes and pairs row-major.
// - Tiled: per tile of QT_BM int8 rows (int8 row r = row mod XM + term * XM, XM = QT_BM /
//   terms rows of x a tile) and block of 32 values, QT_BM * 32 bytes of codes, where lane
//   4g + t finds the A fragment of mma.m16n8k32 (matmul_qtc.cu's header) as 16 bytes at 16
//   (4g + t): a0..a3 = int8 rows g, g + 8, g, g + 8 at values 4t..4t+3, 4t.., 16+4t.., 16+4t..;
//   then QT_BM pairs per tile, rows g and g + 8 side by side at 2g. Tiles run over the blocks
//   of a row, then over the rows.
// (Callers pass row and column: a 64-bit division per value cost the default model's decode
// step 3 %.)
__device__ __forceinline__ void q8_at(int row, int col, int n, int form, int term, size_t* code, size_t* pair) {
    const int terms = form & (X8_TILED - 1);
    const int blocks = n / GROUP;
    if (form & X8_TILED) {
        // Rows of x per tile, QT_BM / terms, as constant divisors (shifts).
        const int xm = terms == 2 ? QT_BM / 2 : QT_BM;
        const int rb = terms == 2 ? row / (QT_BM / 2) : row / QT_BM;
        const size_t tile = (size_t)rb * blocks + col / GROUP;
        const int r = row - rb * xm + term * xm;
        const int k = col % GROUP;
        const int lane = 4 * (r & 7) + ((k & 15) >> 2);
        const int word = (r >> 3) + 2 * (k >> 4);
        *code = tile * (QT_BM * GROUP) + 16 * lane + 4 * word + (k & 3);
        *pair = tile * QT_BM + 2 * (r & 7) + (r >> 3);
    } else {
        const size_t r8 = (size_t)row * terms + term;
        *code = r8 * n + col;
        *pair = r8 * blocks + col / GROUP;
    }
}

// The int8 copy of x in `terms` int8 rows per row (1, or 2: two-term activations, the CPU's
// `Terms::Two`): the codes of x, then (terms = 2) those of its residual r = fl(x - fl(q d)),
// which the products add (out = first + second). v is value (row, col) of a row-major [rows, n]
// tensor (lane j of a warp holding value j of a block), stored at `codes` and `pairs` in form
// `form` (q8_at).
__device__ __forceinline__ void q8_terms(float v, int lane, signed char* codes, float2* pairs, int row, int col,
                                         int n, int form) {
    size_t c, s;
    q8_at(row, col, n, form, 0, &c, &s);
    const float first = q8_block(v, lane, codes + c, pairs + s);
    if ((form & (X8_TILED - 1)) == 2) {
        q8_at(row, col, n, form, 1, &c, &s);
        q8_block(__fsub_rn(v, first), lane, codes + c, pairs + s);
    }
}
