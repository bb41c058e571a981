//! Gated DeltaNet math on one row and head: causal conv, L2 norm, gates, the gated delta
//! rule in its recurrent (token by token) and chunked forms, and the gated RMS norm.
//!
//! Formulas (notes/qwen35_gdn.md §2): with state `S` (`k_dim x v_dim`, f32), per token
//! `S <- exp(g) S; δ = β (v - Sᵀk); S <- S + k δᵀ; o = Sᵀq`. The chunked form computes the
//! same for up to [`CHUNK`] tokens at a time through the WY/UT transform.

use super::{dot, sum_squares};

/// Tokens per chunk of the chunked form.
pub const CHUNK: usize = 64;
/// The L2 norm's epsilon on q and k (fixed in the reference implementations).
pub const L2_EPS: f32 = 1e-6;

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `log(1 + e^x)`, linear above 20 (as torch's softplus).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x <- x / sqrt(Σx² + eps)`.
pub fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (sum_squares(x) + L2_EPS).sqrt();
    for v in x {
        *v *= inv;
    }
}

/// Depthwise causal conv + SiLU over `n = x.len() / c` tokens of one row: `prev` holds the
/// `k - 1` inputs before the first token (oldest first, `c` channels each), `w` is `[c, k]`
/// with tap `k - 1` on the current token. Writes `out` (`n x c`) and the new window `next`.
pub fn conv_span(
    prev: &[f32],
    x: &[f32],
    w: &[f32],
    k: usize,
    c: usize,
    out: &mut [f32],
    next: &mut [f32],
) {
    let n = x.len() / c;
    let hist = k - 1;
    let input = |t: isize, ch: usize| -> f32 {
        if t < 0 {
            prev[(hist as isize + t) as usize * c + ch]
        } else {
            x[t as usize * c + ch]
        }
    };
    for t in 0..n {
        let o = &mut out[t * c..(t + 1) * c];
        for (ch, o) in o.iter_mut().enumerate() {
            let wc = &w[ch * k..(ch + 1) * k];
            let mut acc = 0f32;
            for (i, &wi) in wc.iter().enumerate() {
                acc += wi * input(t as isize + i as isize - hist as isize, ch);
            }
            *o = silu(acc);
        }
    }
    for j in 0..hist {
        let t = n as isize - hist as isize + j as isize;
        for ch in 0..c {
            next[j * c + ch] = input(t, ch);
        }
    }
}

/// One token of the gated delta rule on state `s` (`k_dim x v_dim`, row-major in k):
/// `kv` is scratch of `v_dim`; `out`, when given, receives `Sᵀq` after the update.
#[allow(clippy::too_many_arguments)]
#[inline]
pub fn delta_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    kv: &mut [f32],
    out: Option<&mut [f32]>,
) {
    let dv = v.len();
    let alpha = g.exp();
    kv.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (sv, acc) in row.iter_mut().zip(kv.iter_mut()) {
            *sv *= alpha;
            *acc += *sv * ki;
        }
    }
    for (d, &vj) in kv.iter_mut().zip(v) {
        *d = (vj - *d) * beta;
    }
    match out {
        Some(out) => {
            out.fill(0.0);
            for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
                for ((sv, &d), o) in row.iter_mut().zip(kv.iter()).zip(out.iter_mut()) {
                    *sv += ki * d;
                    *o += *sv * qi;
                }
            }
        }
        None => {
            for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
                for (sv, &d) in row.iter_mut().zip(kv.iter()) {
                    *sv += ki * d;
                }
            }
        }
    }
}

/// Scratch buffers of the chunked form, reused across calls.
#[derive(Default)]
pub struct ChunkScratch {
    gam: Vec<f32>,
    t: Vec<f32>,
    u: Vec<f32>,
    w: Vec<f32>,
    tmp: Vec<f32>,
}

/// The gated delta rule over `n` tokens in chunks of [`CHUNK`]: `q`, `k` (`n x k_dim`, q
/// already scaled, both normalised), `v` (`n x v_dim`), `g`, `beta` (`n`); state `s` is read
/// and updated; `out` gets `n x v_dim`. Equal to `n` calls of [`delta_step`] up to rounding.
#[allow(clippy::too_many_arguments)]
pub fn delta_chunked(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
    sc: &mut ChunkScratch,
) {
    let n = g.len();
    let mut c0 = 0;
    while c0 < n {
        let m = CHUNK.min(n - c0);
        let (q, k, v) = (
            &q[c0 * dk..(c0 + m) * dk],
            &k[c0 * dk..(c0 + m) * dk],
            &v[c0 * dv..(c0 + m) * dv],
        );
        let (g, beta) = (&g[c0..c0 + m], &beta[c0..c0 + m]);
        let out = &mut out[c0 * dv..(c0 + m) * dv];
        chunk(s, q, k, v, g, beta, out, dk, dv, sc);
        c0 += m;
    }
}

#[allow(clippy::too_many_arguments)]
fn chunk(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    dk: usize,
    dv: usize,
    sc: &mut ChunkScratch,
) {
    let m = g.len();
    let kr = |i: usize| &k[i * dk..(i + 1) * dk];
    let qr = |i: usize| &q[i * dk..(i + 1) * dk];
    // Cumulative log decay.
    sc.gam.clear();
    let mut acc = 0f32;
    for &gi in g {
        acc += gi;
        sc.gam.push(acc);
    }
    let gam = &sc.gam;
    // T = (I + L)^-1 with L[i][j] = β_i (k_i·k_j) e^{γ_i - γ_j} for j < i (forward
    // substitution; T is unit lower triangular).
    sc.t.clear();
    sc.t.resize(m * m, 0.0);
    let t = &mut sc.t;
    sc.tmp.clear();
    sc.tmp.resize(m, 0.0);
    for i in 0..m {
        for l in 0..i {
            sc.tmp[l] = beta[i] * dot(kr(i), kr(l)) * (gam[i] - gam[l]).exp();
        }
        for j in 0..i {
            let mut sum = sc.tmp[j];
            for l in j + 1..i {
                sum += sc.tmp[l] * t[l * m + j];
            }
            t[i * m + j] = -sum;
        }
        t[i * m + i] = 1.0;
        for j in i + 1..m {
            t[i * m + j] = 0.0;
        }
    }
    // U = T diag(β) V, W = T diag(β e^γ) K; then V_new = U - W S (stored in u).
    sc.u.clear();
    sc.u.resize(m * dv, 0.0);
    sc.w.clear();
    sc.w.resize(m * dk, 0.0);
    for i in 0..m {
        let ui = &mut sc.u[i * dv..(i + 1) * dv];
        let wi = &mut sc.w[i * dk..(i + 1) * dk];
        for j in 0..=i {
            let c = t[i * m + j] * beta[j];
            for (a, &b) in ui.iter_mut().zip(&v[j * dv..(j + 1) * dv]) {
                *a += c * b;
            }
            let cw = c * gam[j].exp();
            for (a, &b) in wi.iter_mut().zip(kr(j)) {
                *a += cw * b;
            }
        }
        for (a, srow) in wi.iter().zip(s.chunks_exact(dv)) {
            for (x, &sv) in ui.iter_mut().zip(srow) {
                *x -= a * sv;
            }
        }
    }
    // O_i = e^{γ_i} q_iᵀ S + Σ_{j<=i} (q_i·k_j) e^{γ_i-γ_j} V_new_j.
    for i in 0..m {
        let oi = &mut out[i * dv..(i + 1) * dv];
        oi.fill(0.0);
        let e = gam[i].exp();
        for (&qa, srow) in qr(i).iter().zip(s.chunks_exact(dv)) {
            let c = qa * e;
            for (o, &sv) in oi.iter_mut().zip(srow) {
                *o += c * sv;
            }
        }
        for j in 0..=i {
            let c = dot(qr(i), kr(j)) * (gam[i] - gam[j]).exp();
            for (o, &x) in oi.iter_mut().zip(&sc.u[j * dv..(j + 1) * dv]) {
                *o += c * x;
            }
        }
    }
    // S <- e^{γ_last} S + Σ_j e^{γ_last-γ_j} k_j V_new_jᵀ.
    let last = gam[m - 1];
    let decay = last.exp();
    for (a, srow) in s.chunks_exact_mut(dv).enumerate() {
        for x in srow.iter_mut() {
            *x *= decay;
        }
        for j in 0..m {
            let c = k[j * dk + a] * (last - gam[j]).exp();
            for (x, &u) in srow.iter_mut().zip(&sc.u[j * dv..(j + 1) * dv]) {
                *x += c * u;
            }
        }
    }
}

/// `x <- rms_norm(x) * w * silu(z)` over one group.
pub fn rms_norm_gated(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (sum_squares(x) / x.len() as f32 + eps).sqrt();
    for ((v, &zv), &wv) in x.iter_mut().zip(z).zip(w) {
        *v = wv * (*v * inv) * silu(zv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rand_vec(seed: &mut u64, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 33) as f32 / (1u64 << 31) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// Token-by-token in f64 (the definition).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        s0: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        dk: usize,
        dv: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut s: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let mut out = Vec::new();
        for t in 0..g.len() {
            let a = (g[t] as f64).exp();
            for x in s.iter_mut() {
                *x *= a;
            }
            let mut kv = vec![0f64; dv];
            for i in 0..dk {
                for j in 0..dv {
                    kv[j] += s[i * dv + j] * k[t * dk + i] as f64;
                }
            }
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] +=
                        k[t * dk + i] as f64 * (v[t * dv + j] as f64 - kv[j]) * beta[t] as f64;
                }
            }
            for j in 0..dv {
                out.push((0..dk).map(|i| s[i * dv + j] * q[t * dk + i] as f64).sum());
            }
        }
        (s, out)
    }

    #[test]
    fn recurrent_and_chunked_forms_equal_the_definition() {
        let (dk, dv) = (16, 8);
        let mut seed = 7u64;
        for n in [1usize, 5, 63, 64, 65, 130] {
            let s0 = rand_vec(&mut seed, dk * dv, 0.5);
            let mut q = rand_vec(&mut seed, n * dk, 1.0);
            let mut k = rand_vec(&mut seed, n * dk, 1.0);
            for t in 0..n {
                l2_normalize(&mut q[t * dk..(t + 1) * dk]);
                l2_normalize(&mut k[t * dk..(t + 1) * dk]);
            }
            let v = rand_vec(&mut seed, n * dv, 1.0);
            let g: Vec<f32> = rand_vec(&mut seed, n, 1.0)
                .iter()
                .map(|x| -x.abs() * 0.5)
                .collect();
            let beta: Vec<f32> = rand_vec(&mut seed, n, 4.0)
                .into_iter()
                .map(sigmoid)
                .collect();
            let (ws, wo) = reference(&s0, &q, &k, &v, &g, &beta, dk, dv);

            let mut s = s0.clone();
            let mut kv = vec![0f32; dv];
            let mut out = vec![0f32; n * dv];
            for t in 0..n {
                delta_step(
                    &mut s,
                    &q[t * dk..(t + 1) * dk],
                    &k[t * dk..(t + 1) * dk],
                    &v[t * dv..(t + 1) * dv],
                    g[t],
                    beta[t],
                    &mut kv,
                    Some(&mut out[t * dv..(t + 1) * dv]),
                );
            }
            let mut sc = s0.clone();
            let mut oc = vec![0f32; n * dv];
            delta_chunked(
                &mut sc,
                &q,
                &k,
                &v,
                &g,
                &beta,
                &mut oc,
                dk,
                dv,
                &mut ChunkScratch::default(),
            );
            for (form, st, o) in [("recurrent", &s, &out), ("chunked", &sc, &oc)] {
                for (a, b) in st.iter().zip(&ws) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()),
                        "{form} n={n} state {a} vs {b}"
                    );
                }
                for (a, b) in o.iter().zip(&wo) {
                    assert!(
                        (*a as f64 - b).abs() < 1e-4 * (1.0 + b.abs()),
                        "{form} n={n} out {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn conv_span_continues_its_window() {
        // Two channels, kernel 3: feeding 5 tokens at once equals 2 then 3.
        let (k, c) = (3, 2);
        let w = [0.5f32, -1.0, 2.0, 1.0, 0.25, -0.5];
        let prev = [0.1f32, -0.2, 0.3, 0.4];
        let x: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.3).collect();
        let mut out = vec![0f32; 10];
        let mut next = vec![0f32; 4];
        conv_span(&prev, &x, &w, k, c, &mut out, &mut next);
        let (mut o1, mut n1) = (vec![0f32; 4], vec![0f32; 4]);
        conv_span(&prev, &x[..4], &w, k, c, &mut o1, &mut n1);
        let (mut o2, mut n2) = (vec![0f32; 6], vec![0f32; 4]);
        conv_span(&n1, &x[4..], &w, k, c, &mut o2, &mut n2);
        assert_eq!(&out[..4], &o1[..]);
        assert_eq!(&out[4..], &o2[..]);
        assert_eq!(next, n2);
        assert_eq!(&next[..], &x[6..]);
        // First output of channel 0: w · [prev0, prev1, x0].
        let want = silu(0.5 * 0.1 - 0.3 + 2.0 * x[0]);
        assert!((out[0] - want).abs() < 1e-6);
    }
}
