// dflash-rs CUDA kernels: token choice on the device (greedy, sampling, DFlash drafts and
// verification), so that only token ids and accept counts go back to the host.
//
// The definition is the engine's host code (crates/engine/src/sampling.rs `distribution`,
// `Dist::pick`; crates/engine/src/dflash.rs `propose`, `judge`, `residual`), reproduced
// step by step:
// - penalty: each distinct history id's logit divided (positive) or multiplied (otherwise)
//   by the penalty, once;
// - greedy: the first largest processed logit;
// - softmax: e = exp((l - max) * (1/T)), exp evaluated in double and rounded to f32 as on the
//   host (the correctly rounded value on both, but for about one argument in 10^8),
//   p = (float)(e / total), total an f64 sum;
// - without a filter the distribution is in id order; with one (top-k, top-p, min-p) in
//   probability order, descending, ties by lower id, cut to a prefix of that order and
//   renormalised: q = (float)(p / kept mass);
// - pick(u): the first item of the order whose running mass exceeds u; when rounding leaves
//   the total at or below u, the last item of positive mass.
// Sums: f64 block reductions in a fixed order, and masses in 64-bit fixed point (2^-60 units:
// every f32 weight above 2^-37 converts exactly; integer sums do not depend on the order), so
// the device's cumulative masses are within about 1e-12 of exact. The host's f64 sums are as
// close, so both pick the same token unless u lies within the f32 rounding of the terms
// (about 1e-7) of a boundary between two tokens. Greedy choices are exact.
//
// A sorted order is never materialised: a prefix of it is "every item whose probability
// bits exceed b, and the items with bits == b up to id c" (non-negative floats order like
// their bits), found by a radix search over the bits (four 8-bit digits) and a scan of the
// ties in id order.
#include "common.cu"

// CH_THREADS (1024) is defined by the host (cuda/compile.rs, `shared_constants`).
#define CH_WARPS (CH_THREADS / 32)
#define FX_ONE 1152921504606846976.0  // 2^60
#define NO_ID 0xffffffffu

// Per-row parameters, 8 words (Rust: sample.rs `pack_params`).
struct ChParams {
    float temperature;  // <= 0: greedy
    u32 top_k;          // 0: off
    float top_p;        // 1: off
    float min_p;        // 0: off
    float penalty;      // 1: off
    u32 hist_off;       // the row's sorted distinct history ids: hist[hist_off .. +hist_len]
    u32 hist_len;
    u32 pad;
};

__device__ __forceinline__ int ch_greedy(const ChParams& p) { return p.temperature <= 0.0f; }
__device__ __forceinline__ int ch_filtered(const ChParams& p) {
    return p.top_k > 0u || p.top_p < 1.0f || p.min_p > 0.0f;
}

__device__ __forceinline__ u64 to_fx(float w) { return (u64)((double)w * FX_ONE); }

// ---- block reductions (fixed order: lanes by an xor butterfly, then warps by warp 0) -------

struct Red {
    double d[CH_WARPS];
    u64 x[CH_WARPS];
    float f[CH_WARPS];
    u32 i[CH_WARPS];
};

__device__ double block_sum_f64(double v, Red* r) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, o);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) r->d[w] = v;
    __syncthreads();
    if (w == 0) {
        v = l < CH_WARPS ? r->d[l] : 0.0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, o);
        if (l == 0) r->d[0] = v;
    }
    __syncthreads();
    return r->d[0];
}

__device__ u64 block_sum_u64(u64 v, Red* r) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, o);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) r->x[w] = v;
    __syncthreads();
    if (w == 0) {
        v = l < CH_WARPS ? r->x[l] : 0ull;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(DF_FULL_MASK, v, o);
        if (l == 0) r->x[0] = v;
    }
    __syncthreads();
    return r->x[0];
}

// Exclusive prefix sum over threads (thread order), and the total in *total.
__device__ u64 block_scan_u64(u64 v, Red* r, u64* total) {
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    u64 incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(DF_FULL_MASK, incl, o);
        if (l >= o) incl += n;
    }
    __syncthreads();
    if (l == 31) r->x[w] = incl;
    __syncthreads();
    if (w == 0) {
        u64 s = l < CH_WARPS ? r->x[l] : 0ull;
        for (int o = 1; o < 32; o <<= 1) {
            const u64 n = __shfl_up_sync(DF_FULL_MASK, s, o);
            if (l >= o) s += n;
        }
        if (l < CH_WARPS) r->x[l] = s;  // inclusive per warp
    }
    __syncthreads();
    const u64 before = w == 0 ? 0ull : r->x[w - 1];
    *total = r->x[CH_WARPS - 1];
    __syncthreads();
    return before + incl - v;
}

__device__ float block_max_f32(float v, Red* r) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DF_FULL_MASK, v, o));
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) r->f[w] = v;
    __syncthreads();
    if (w == 0) {
        v = l < CH_WARPS ? r->f[l] : -DF_INF;
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(DF_FULL_MASK, v, o));
        if (l == 0) r->f[0] = v;
    }
    __syncthreads();
    return r->f[0];
}

// (value, index): larger value, then smaller index; NO_ID marks "none".
__device__ __forceinline__ void am_merge(float& bv, u32& bi, float ov, u32 oi) {
    if (oi != NO_ID && (bi == NO_ID || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
    }
}

__device__ u32 block_argmax(float bv, u32 bi, Red* r) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(DF_FULL_MASK, bv, o);
        const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
        am_merge(bv, bi, ov, oi);
    }
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) {
        r->f[w] = bv;
        r->i[w] = bi;
    }
    __syncthreads();
    if (w == 0) {
        bv = l < CH_WARPS ? r->f[l] : -DF_INF;
        bi = l < CH_WARPS ? r->i[l] : NO_ID;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(DF_FULL_MASK, bv, o);
            const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
            am_merge(bv, bi, ov, oi);
        }
        if (l == 0) r->i[0] = bi;
    }
    __syncthreads();
    return r->i[0];
}

// The last item of a probability order among a set: smallest bits, then largest id. Packed as
// (~bits << 32 | id) and maximised. Returns NO_ID when the set is empty.
__device__ u32 block_last_in_order(u64 key, int have, Red* r) {
    u64 v = have ? key : 0ull;
    u32 h = have ? 1u : 0u;
    for (int o = 16; o > 0; o >>= 1) {
        const u64 ov = __shfl_xor_sync(DF_FULL_MASK, v, o);
        const u32 oh = __shfl_xor_sync(DF_FULL_MASK, h, o);
        if (oh && (!h || ov > v)) v = ov;
        h |= oh;
    }
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    __syncthreads();
    if (l == 0) {
        r->x[w] = v;
        r->i[w] = h;
    }
    __syncthreads();
    if (w == 0) {
        v = l < CH_WARPS ? r->x[l] : 0ull;
        h = l < CH_WARPS ? r->i[l] : 0u;
        for (int o = 16; o > 0; o >>= 1) {
            const u64 ov = __shfl_xor_sync(DF_FULL_MASK, v, o);
            const u32 oh = __shfl_xor_sync(DF_FULL_MASK, h, o);
            if (oh && (!h || ov > v)) v = ov;
            h |= oh;
        }
        if (l == 0) r->i[0] = h ? (u32)(v & 0xffffffffull) : NO_ID;
    }
    __syncthreads();
    return r->i[0];
}

// ---- a row's distribution, held by one block ----------------------------------------------

// The processed distribution of one row. `w` holds p (after softmax) for every id.
struct Dist {
    float* w;
    int V;
    int greedy;
    u32 argmax;
    int filtered;
    // Kept (when filtered): bits(p) > cut_bits, or == cut_bits with id <= cut_id.
    u32 cut_bits;
    u32 cut_id;
    double mass;  // of the kept items (renormalisation)
};

__device__ __forceinline__ int kept(const Dist& d, int i, u32 bits) {
    return !d.filtered || bits > d.cut_bits || (bits == d.cut_bits && (u32)i <= d.cut_id);
}

// Probability of id i in the distribution (0 when filtered out).
__device__ __forceinline__ float prob(const Dist& d, int i) {
    const float p = d.w[i];
    if (!d.filtered) return p;
    const u32 b = __float_as_uint(p);
    if (!kept(d, i, b)) return 0.0f;
    return (float)((double)p / d.mass);
}

// Shared state of one block.
struct Smem {
    Red red;
    u64 hmass[256];
    u32 sel_bits;
    u64 sel_above;
    int sel_found;
    u32 sel_id;
    Dist p, q;
};

// Contiguous id range of this thread (scans in id order use it).
__device__ __forceinline__ void my_range(int V, int& lo, int& hi) {
    const int per = (V + CH_THREADS - 1) / CH_THREADS;
    lo = min(V, (int)threadIdx.x * per);
    hi = min(V, lo + per);
}

// What a search measures per item: a count (1 each) or a weight in fixed point.
#define M_COUNT 0
#define M_SAMPLE 1    // weight = prob(p, i)
#define M_RESIDUAL 2  // weight = max(prob(p, i) - prob(q, i), 0) / rmass
#define M_RAW 3       // weight = p.w[i] (top-p, within the top-k cut held in p's cut)

struct Measure {
    int mode;
    double rmass;
};

__device__ __forceinline__ float residual_w(const Dist& p, const Dist& q, int i, double rmass) {
    const float r = fmaxf(__fsub_rn(prob(p, i), prob(q, i)), 0.0f);
    return (float)((double)r / rmass);
}

// The item's weight under `m`, and whether it is in the order at all (a filtered p's kept set).
__device__ __forceinline__ u64 measure(const Smem* s, const Measure& m, int i, int& in) {
    const Dist& p = s->p;
    const u32 b = __float_as_uint(p.w[i]);
    in = kept(p, i, b);
    if (!in) return 0ull;
    switch (m.mode) {
        case M_COUNT: return 1ull;
        case M_SAMPLE: return to_fx(prob(p, i));
        case M_RESIDUAL: return to_fx(residual_w(p, s->q, i, m.rmass));
        default: return to_fx(p.w[i]);
    }
}

// In p's probability order (bits descending, ties by id), restricted to p's kept set: the
// first item at which the running measure reaches `target` (>= target). Sets s->sel_found,
// and when found s->sel_bits, s->sel_id.
__device__ __noinline__ void select_sorted(Smem* s, const Measure& m, u64 target) {
    const int V = s->p.V;
    u32 prefix = 0;
    u64 above = 0;
    int found = 1;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int k = threadIdx.x; k < 256; k += CH_THREADS) {
            s->hmass[k] = 0;
        }
        __syncthreads();
        const u32 hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < V; i += CH_THREADS) {
            const u32 b = __float_as_uint(s->p.w[i]);
            if ((b & hi_mask) != prefix) continue;
            int in;
            const u64 v = measure(s, m, i, in);
            if (!in || v == 0ull) continue;
            atomicAdd(&s->hmass[(b >> shift) & 255u], (unsigned long long)v);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255;
            for (; d >= 0; d--) {
                if (above + s->hmass[d] >= target) break;
                above += s->hmass[d];
            }
            s->sel_found = d >= 0;
            s->sel_bits = prefix | ((u32)(d < 0 ? 0 : d) << shift);
            s->sel_above = above;
        }
        __syncthreads();
        found = s->sel_found;
        prefix = s->sel_bits;
        above = s->sel_above;
        if (!found) break;
    }
    if (!found) return;
    // The ties at `prefix`, in id order.
    if (threadIdx.x == 0) s->sel_id = NO_ID;
    int lo, hi;
    my_range(V, lo, hi);
    u64 mine = 0;
    for (int i = lo; i < hi; i++) {
        if (__float_as_uint(s->p.w[i]) != prefix) continue;
        int in;
        mine += measure(s, m, i, in);
    }
    u64 total;
    const u64 before = above + block_scan_u64(mine, &s->red, &total);
    if (before < target && before + mine >= target) {
        u64 acc = before;
        for (int i = lo; i < hi; i++) {
            if (__float_as_uint(s->p.w[i]) != prefix) continue;
            int in;
            acc += measure(s, m, i, in);
            if (acc >= target) {
                s->sel_id = (u32)i;
                break;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && (above + total < target || s->sel_id == NO_ID)) s->sel_found = 0;
    __syncthreads();
}

// In id order over every id (p unfiltered): the first id at which the running measure
// reaches `target`; NO_ID when the total stays below it.
__device__ __noinline__ u32 select_ids(Smem* s, const Measure& m, u64 target) {
    int lo, hi;
    my_range(s->p.V, lo, hi);
    u64 mine = 0;
    for (int i = lo; i < hi; i++) {
        int in;
        mine += measure(s, m, i, in);
    }
    u64 total;
    const u64 before = block_scan_u64(mine, &s->red, &total);
    if (threadIdx.x == 0) s->sel_id = NO_ID;
    __syncthreads();
    if (before < target && before + mine >= target) {
        u64 acc = before;
        for (int i = lo; i < hi; i++) {
            int in;
            acc += measure(s, m, i, in);
            if (acc >= target) {
                s->sel_id = (u32)i;
                break;
            }
        }
    }
    __syncthreads();
    return s->sel_id;
}

// The token at cumulative mass u under measure m (M_SAMPLE or M_RESIDUAL) in p's order.
__device__ __noinline__ u32 pick(Smem* s, const Measure& m, float u) {
    const u64 target = to_fx(u) + 1ull;  // running mass > u
    u32 id;
    if (s->p.filtered) {
        select_sorted(s, m, target);
        id = s->sel_found ? s->sel_id : NO_ID;
    } else {
        id = select_ids(s, m, target);
    }
    if (id != NO_ID) return id;
    // Rounding left the total at or below u: the last item of positive weight.
    u64 key = 0;
    int have = 0;
    for (int i = threadIdx.x; i < s->p.V; i += CH_THREADS) {
        int in;
        if (measure(s, m, i, in) == 0ull) continue;
        const u64 b = s->p.filtered ? (u64)__float_as_uint(s->p.w[i]) : 0ull;
        const u64 k = ((u64)(~(u32)b) << 32) | (u64)i;
        if (!have || k > key) key = k;
        have = 1;
    }
    id = block_last_in_order(key, have, &s->red);
    return id == NO_ID ? 0u : id;
}

// Is `id` in the sorted distinct ids h[0..n]?
__device__ __forceinline__ int in_sorted(const u32* h, u32 n, u32 id) {
    u32 lo = 0, hi = n;
    while (lo < hi) {
        const u32 mid = (lo + hi) >> 1;
        if (h[mid] < id) lo = mid + 1; else hi = mid;
    }
    return lo < n && h[lo] == id;
}

__device__ __forceinline__ float penalize(float l, float r) {
    return l > 0.0f ? __fdiv_rn(l, r) : __fmul_rn(l, r);
}

// Builds the distribution of `logits` (V values) into d, with `w` as its work row: penalty
// over the row's history and the `extra` ids (drafts before this slot), then greedy argmax or
// softmax and the filters.
__device__ __noinline__ void build(Smem* s, Dist* dd, const ChParams& cp, const float* logits, float* w, int V,
                      const u32* hist, const u32* extra, int n_extra) {
    Red* red = &s->red;
    const float* src = logits;
    if (cp.penalty != 1.0f) {
        for (int i = threadIdx.x; i < V; i += CH_THREADS) w[i] = logits[i];
        __syncthreads();
        const u32* h = hist + cp.hist_off;
        for (u32 k = threadIdx.x; k < cp.hist_len; k += CH_THREADS) {
            const u32 id = h[k];
            if ((int)id < V) w[id] = penalize(w[id], cp.penalty);
        }
        if (threadIdx.x == 0) {
            for (int j = 0; j < n_extra; j++) {
                const u32 id = extra[j];
                if ((int)id >= V || in_sorted(h, cp.hist_len, id)) continue;
                int seen = 0;
                for (int k = 0; k < j; k++) seen |= extra[k] == id;
                if (!seen) w[id] = penalize(w[id], cp.penalty);
            }
        }
        __syncthreads();
        src = w;
    }
    if (threadIdx.x == 0) {
        dd->w = w;
        dd->V = V;
        dd->greedy = ch_greedy(cp);
        dd->filtered = 0;
        dd->cut_bits = 0;
        dd->cut_id = NO_ID;
        dd->mass = 1.0;
    }
    if (ch_greedy(cp)) {
        float bv = -DF_INF;
        u32 bi = NO_ID;
        for (int i = threadIdx.x; i < V; i += CH_THREADS) {
            const float v = src[i];
            if (v > bv) {
                bv = v;
                bi = (u32)i;
            }
        }
        const u32 a = block_argmax(bv, bi, red);
        if (threadIdx.x == 0) dd->argmax = a == NO_ID ? 0u : a;
        __syncthreads();
        return;
    }
    // Softmax: e into w, total in f64, then p = e / total in place.
    float mx = -DF_INF;
    for (int i = threadIdx.x; i < V; i += CH_THREADS) mx = fmaxf(mx, src[i]);
    mx = block_max_f32(mx, red);
    const float inv_t = __fdiv_rn(1.0f, cp.temperature);
    double part = 0.0;
    for (int i = threadIdx.x; i < V; i += CH_THREADS) {
        const float x = __fmul_rn(__fsub_rn(src[i], mx), inv_t);
        const float e = (float)exp((double)x);
        w[i] = e;
        part += (double)e;
    }
    const double total = block_sum_f64(part, red);
    for (int i = threadIdx.x; i < V; i += CH_THREADS) w[i] = (float)((double)w[i] / total);
    __syncthreads();
    if (!ch_filtered(cp)) return;

    // Filters, as prefixes of the probability order. s->p must be this distribution while
    // the searches run (they read s->p).
    Dist* p = &s->p;
    if (threadIdx.x == 0) {
        *p = *dd;
        p->filtered = 0;  // the whole order while cutting
    }
    __syncthreads();
    u32 cb = 0, ci = 0;
    int cut = 0;
    if (cp.top_k > 0u && cp.top_k < (u32)V) {
        const Measure m = {M_COUNT, 1.0};
        select_sorted(s, m, (u64)cp.top_k);
        if (s->sel_found) {
            cb = s->sel_bits;
            ci = s->sel_id;
            cut = 1;
        }
    }
    if (threadIdx.x == 0 && cut) {
        p->filtered = 1;
        p->cut_bits = cb;
        p->cut_id = ci;
    }
    __syncthreads();
    if (cp.top_p < 1.0f) {
        u64 mine = 0;
        for (int i = threadIdx.x; i < V; i += CH_THREADS) {
            if (kept(*p, i, __float_as_uint(w[i]))) mine += to_fx(w[i]);
        }
        const u64 mass = block_sum_u64(mine, red);
        const double target = (double)cp.top_p * ((double)mass / FX_ONE);
        const Measure m = {M_RAW, 1.0};
        select_sorted(s, m, (u64)ceil(target * FX_ONE));
        if (s->sel_found) {
            // The top-p prefix ends inside the top-k one (it cannot end after it).
            cb = s->sel_bits;
            ci = s->sel_id;
            cut = 1;
        }
        if (threadIdx.x == 0 && cut) {
            p->filtered = 1;
            p->cut_bits = cb;
            p->cut_id = ci;
        }
        __syncthreads();
    }
    if (cp.min_p > 0.0f) {
        // The first item is the largest p; keep p >= floor: the last such item of the order.
        float pm = 0.0f;
        for (int i = threadIdx.x; i < V; i += CH_THREADS) pm = fmaxf(pm, w[i]);
        pm = block_max_f32(pm, red);
        const float floor = __fmul_rn(pm, cp.min_p);
        u64 key = 0;
        int have = 0;
        for (int i = threadIdx.x; i < V; i += CH_THREADS) {
            const float v = w[i];
            if (!(v >= floor) || !kept(*p, i, __float_as_uint(v))) continue;
            const u64 k = ((u64)(~__float_as_uint(v)) << 32) | (u64)i;
            if (!have || k > key) key = k;
            have = 1;
        }
        const u32 last = block_last_in_order(key, have, red);
        if (threadIdx.x == 0 && last != NO_ID) {
            p->filtered = 1;
            p->cut_bits = __float_as_uint(w[last]);
            p->cut_id = last;
        }
        __syncthreads();
    }
    // Renormalise by the kept mass (f64, fixed order).
    double kmass = 0.0;
    for (int i = threadIdx.x; i < V; i += CH_THREADS) {
        if (kept(*p, i, __float_as_uint(w[i]))) kmass += (double)w[i];
    }
    kmass = block_sum_f64(kmass, red);
    if (threadIdx.x == 0) {
        p->filtered = 1;
        if (!cut && cp.min_p <= 0.0f) {
            // A filter asked for but nothing cut (e.g. top-k >= V): everything, still sorted.
            p->cut_bits = 0;
            p->cut_id = NO_ID;
        }
        p->mass = kmass;
        *dd = *p;
    }
    __syncthreads();
}

// One block's token from the distribution in s->p: argmax, or pick at u.
__device__ u32 choose_from_p(Smem* s, float u) {
    if (s->p.greedy) return s->p.argmax;
    const Measure m = {M_SAMPLE, 1.0};
    return pick(s, m, u);
}

__device__ __forceinline__ ChParams load_params(const u32* words, int row) {
    const u32* q = words + 8 * row;
    ChParams c;
    c.temperature = __uint_as_float(q[0]);
    c.top_k = q[1];
    c.top_p = __uint_as_float(q[2]);
    c.min_p = __uint_as_float(q[3]);
    c.penalty = __uint_as_float(q[4]);
    c.hist_off = q[5];
    c.hist_len = q[6];
    c.pad = 0;
    return c;
}

// ---- kernels --------------------------------------------------------------------------------

// One token per row: block r chooses from logits row r with uniform u[r] into out[r].
extern "C" __global__ void __launch_bounds__(CH_THREADS)
sample_rows_f32(const float* logits, float* work, int V, const u32* params, const u32* hist,
                const float* u, u32* out) {
    df_kernel_begin();
    __shared__ Smem s;
    const int r = blockIdx.x;
    const ChParams cp = load_params(params, r);
    build(&s, &s.p, cp, logits + (size_t)r * V, work + (size_t)r * V, V, hist, 0, 0);
    const u32 t = choose_from_p(&s, u[r]);
    if (threadIdx.x == 0) out[r] = t;
}

// Drafts: block (x, r) chooses slot slot0 + x of row r from logits row r * slots + slot, with
// the history followed by the row's drafts of the slots before (read from `drafts`, which
// earlier launches filled), and writes drafts[r * slots + slot].
extern "C" __global__ void __launch_bounds__(CH_THREADS)
draft_rows_f32(const float* logits, float* work, int V, int slots, int slot0, const u32* params,
               const u32* hist, const float* u, u32* drafts) {
    df_kernel_begin();
    __shared__ Smem s;
    const int r = blockIdx.y;
    const int slot = slot0 + blockIdx.x;
    const size_t at = (size_t)r * slots + slot;
    const ChParams cp = load_params(params, r);
    build(&s, &s.p, cp, logits + at * V, work + at * V, V, hist, drafts + (size_t)r * slots, slot);
    const u32 t = choose_from_p(&s, u[at]);
    if (threadIdx.x == 0) drafts[at] = t;
}

// Verification, one block per (slot i, row r) of a block of `block` slots (n = block - 1
// drafts): p from target row r * block + i; at T > 0 and i < n, q from draft row r * n + i,
// both with the history and the drafts before slot i. Writes accept[r * block + i] (draft i
// accepted: greedy, argmax(p) == d; else u_acc * q(d) < p(d)) and cand[r * block + i], the
// token if slot i is the first not accepted: greedy argmax(p); else the residual max(p - q, 0)
// (p when empty) at u_last, or p at u_last for the last slot.
extern "C" __global__ void __launch_bounds__(CH_THREADS)
verify_slots_f32(const float* target, const float* draft, float* work, int V, int block,
                 const u32* params, const u32* hist, const u32* drafts, const float* u_acc,
                 const float* u_last, u32* accept, u32* cand) {
    df_kernel_begin();
    __shared__ Smem s;
    const int r = blockIdx.y;
    const int i = blockIdx.x;
    const int n = block - 1;
    const size_t at = (size_t)r * block + i;
    const ChParams cp = load_params(params, r);
    const u32* rd = drafts + (size_t)r * n;
    const int with_q = !ch_greedy(cp) && i < n;
    // q first: building a distribution uses s.p as its scratch.
    if (with_q) build(&s, &s.q, cp, draft + ((size_t)r * n + i) * V, work + (2 * at + 1) * V, V, hist, rd, i);
    build(&s, &s.p, cp, target + at * V, work + 2 * at * V, V, hist, rd, i);
    u32 acc = 0, tok;
    if (ch_greedy(cp)) {
        tok = s.p.argmax;
        acc = i < n && tok == rd[i];
    } else if (with_q) {
        const u32 d = rd[i];
        const float pd = prob(s.p, (int)d), qd = prob(s.q, (int)d);
        acc = __fmul_rn(u_acc[(size_t)r * n + i], qd) < pd;
        // The residual's mass; p itself when it is empty.
        double rm = 0.0;
        for (int k = threadIdx.x; k < V; k += CH_THREADS) {
            const float v = fmaxf(__fsub_rn(prob(s.p, k), prob(s.q, k)), 0.0f);
            rm += (double)v;
        }
        rm = block_sum_f64(rm, &s.red);
        if (rm > 0.0) {
            const Measure m = {M_RESIDUAL, rm};
            tok = pick(&s, m, u_last[r]);
        } else {
            tok = choose_from_p(&s, u_last[r]);
        }
    } else {
        tok = choose_from_p(&s, u_last[r]);
    }
    if (threadIdx.x == 0) {
        accept[at] = acc;
        cand[at] = tok;
    }
}

// Per row: the accepted prefix and the token after it. With `amax` (greedy rows whose slots
// were argmaxed by argmax_rows), accept and cand come from it and the drafts.
extern "C" __global__ void verify_finish(int rows, int block, const u32* accept, const u32* cand,
                                         const u32* amax, const u32* drafts, u32* out) {
    df_kernel_begin();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const int n = block - 1;
    int a = 0;
    for (; a < n; a++) {
        const size_t at = (size_t)r * block + a;
        const int ok = amax ? amax[at] == drafts[(size_t)r * n + a] : accept[at] != 0u;
        if (!ok) break;
    }
    const size_t at = (size_t)r * block + a;
    out[2 * r] = (u32)a;
    out[2 * r + 1] = amax ? amax[at] : cand[at];
}

// ---- greedy argmax over long rows ------------------------------------------------------------
//
// Stage 1: block (c, r) scans columns [c * ARGMAX_CHUNK, +ARGMAX_CHUNK) of row r; stage 2: one
// warp per row merges the chunks. Both merge (larger value, then smaller index), so the result
// is the first largest value whatever the order; NaN is never chosen, and a row with nothing
// above -inf gives 0 (cpu::ops::elementwise::argmax).
// ARGMAX_CHUNK (4096) and ARGMAX_THREADS (256) are defined by the host (cuda/compile.rs).

extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_part_f32(const float* x, int cols, float* pv, u32* pi) {
    df_kernel_begin();
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ u32 si[ARGMAX_THREADS / 32];
    const int c = blockIdx.x, r = blockIdx.y;
    const float* xr = x + (size_t)r * cols;
    const int lo = c * ARGMAX_CHUNK, hi = min(cols, lo + ARGMAX_CHUNK);
    float bv = -DF_INF;
    u32 bi = NO_ID;
    for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) {
        const float v = xr[i];
        if (v > bv) {
            bv = v;
            bi = (u32)i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(DF_FULL_MASK, bv, o);
        const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
        am_merge(bv, bi, ov, oi);
    }
    const int w = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        sv[w] = bv;
        si[w] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < ARGMAX_THREADS / 32; k++) am_merge(bv, bi, sv[k], si[k]);
        const size_t at = (size_t)r * gridDim.x + c;
        pv[at] = bv;
        pi[at] = bi;
    }
}

extern "C" __global__ void argmax_final(const float* pv, const u32* pi, int chunks, u32* out) {
    df_kernel_begin();
    const int r = blockIdx.x;
    float bv = -DF_INF;
    u32 bi = NO_ID;
    for (int c = threadIdx.x; c < chunks; c += 32) am_merge(bv, bi, pv[(size_t)r * chunks + c], pi[(size_t)r * chunks + c]);
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(DF_FULL_MASK, bv, o);
        const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
        am_merge(bv, bi, ov, oi);
    }
    if (threadIdx.x == 0) out[r] = bi == NO_ID ? 0u : bi;
}

// ---- top-k of rows (the DFlash2 selector's candidates) ------------------------------------
//
// The k first items of each row in the host's order (crates/models/src/selector.rs
// `top_k_indices`): value descending as `f32::total_cmp` ranks values (+0 above -0), NaN as
// -inf, ties to the lower index. Block per row; round j takes the first item of that order
// strictly after round j - 1's (each thread scans its columns, then a block reduction), so
// the choice is exact whatever the thread count. Out: ids [rows][k], the raw values beside.

// An int that orders like f32::total_cmp over non-NaN floats (NaN taken as -inf).
__device__ __forceinline__ int tk_key(float v) {
    if (v != v) v = -DF_INF;
    const int b = __float_as_int(v);
    return b >= 0 ? b : b ^ 0x7fffffff;
}

// (key, index): larger key, then smaller index; NO_ID marks "none".
__device__ __forceinline__ void tk_merge(int& bk, u32& bi, int ok, u32 oi) {
    if (oi != NO_ID && (bi == NO_ID || ok > bk || (ok == bk && oi < bi))) {
        bk = ok;
        bi = oi;
    }
}

extern "C" __global__ void __launch_bounds__(CH_THREADS)
topk_rows_f32(const float* x, int cols, int k, u32* ids, float* vals) {
    df_kernel_begin();
    __shared__ int sk[CH_WARPS];
    __shared__ u32 si[CH_WARPS];
    __shared__ int s_lk;
    __shared__ u32 s_li;
    const int r = blockIdx.x;
    const float* xr = x + (size_t)r * cols;
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    int lk = 0;
    u32 li = NO_ID;  // the previous round's pick (none before the first)
    for (int j = 0; j < k; j++) {
        int bk = 0;
        u32 bi = NO_ID;
        for (int i = threadIdx.x; i < cols; i += CH_THREADS) {
            const int key = tk_key(xr[i]);
            if (li == NO_ID || key < lk || (key == lk && (u32)i > li)) tk_merge(bk, bi, key, (u32)i);
        }
        for (int o = 16; o > 0; o >>= 1) {
            const int ok = __shfl_xor_sync(DF_FULL_MASK, bk, o);
            const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
            tk_merge(bk, bi, ok, oi);
        }
        if (l == 0) {
            sk[w] = bk;
            si[w] = bi;
        }
        __syncthreads();
        if (w == 0) {
            bk = l < CH_WARPS ? sk[l] : 0;
            bi = l < CH_WARPS ? si[l] : NO_ID;
            for (int o = 16; o > 0; o >>= 1) {
                const int ok = __shfl_xor_sync(DF_FULL_MASK, bk, o);
                const u32 oi = __shfl_xor_sync(DF_FULL_MASK, bi, o);
                tk_merge(bk, bi, ok, oi);
            }
            if (l == 0) {
                const size_t at = (size_t)r * k + j;
                ids[at] = bi;
                vals[at] = bi == NO_ID ? -DF_INF : xr[bi];
                s_lk = bk;
                s_li = bi;
            }
        }
        __syncthreads();
        lk = s_lk;
        li = s_li;
    }
}
