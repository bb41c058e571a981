//! `Backend` for the CPU: f32 activation tensors, weights in their stored form (target
//! projections also repacked for the int8 kernels, see `policy`), a worker pool.

use std::cell::RefCell;
use std::sync::Arc;

use super::argmax_screen::ArgmaxScreen;
use super::attention_tasks;
use super::gdn::CpuGdn;
use super::int8::{self, pack::PackedWeight, quantize::Terms, Int8Kernel};
use super::kv::{CpuKv, KvType};
use super::matmul::{self, Isa};
use super::ops::{conv, elementwise, gdn, norm, rope};
use super::policy::{self, CpuPath, MatmulMode};
use super::pool::{CpuPool, SyncPtr};
use super::tensor::CpuTensor;
use super::weight::{on_huge_pages, CpuWeight, Int8Weight};
use crate::backend::{
    Activations, AttnShape, Backend, GdnShape, RopeStyle, RowSpan, TokenMeta, WeightPath,
    WeightRole,
};
use crate::error::RuntimeError;
use crate::weight::HostWeight;

/// Rows x columns below which element-wise ops stay on the calling thread.
const PARALLEL_MIN_ELEMS: usize = 1 << 15;

/// The CPU backend.
pub struct CpuBackend {
    pool: CpuPool,
    isa: Isa,
    mode: MatmulMode,
    /// Whether vocabulary weights get a greedy screen (`policy::screen_for`).
    screen: bool,
    /// How KV caches made from now on hold their values.
    kv_type: KvType,
}

impl CpuBackend {
    /// A backend with `threads` workers (0 = one per core), the best kernels for this CPU and
    /// the matmul mode of `DFLASH_MATMUL` (panics on a bad value; see [`CpuBackend::from_env`]).
    pub fn new(threads: usize) -> Self {
        Self::from_env(threads).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`CpuBackend::new`], refusing a bad `DFLASH_MATMUL`, `DFLASH_ARGMAX_SCREEN` or
    /// `DFLASH_KV_CACHE` with an error.
    pub fn from_env(threads: usize) -> Result<Self, RuntimeError> {
        let b = Self::with_options(threads, Isa::detect(), MatmulMode::from_env()?);
        Ok(b.with_screen(policy::screen_from_env()?)
            .with_kv_type(KvType::from_env()?))
    }

    /// A backend using the f32 kernels of `isa` (which the CPU must support) and `mode`, with
    /// greedy screens and f16 KV caches.
    pub fn with_options(threads: usize, isa: Isa, mode: MatmulMode) -> Self {
        assert!(isa.is_supported(), "{isa} kernels are not supported here");
        Self {
            pool: CpuPool::new(threads),
            isa,
            mode,
            screen: true,
            kv_type: KvType::default(),
        }
    }

    /// This backend with KV caches made from now on holding `ty` values.
    pub fn with_kv_type(mut self, ty: KvType) -> Self {
        self.kv_type = ty;
        self
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// This backend with greedy screens of the vocabulary weights uploaded from now on
    /// (`on`) or without.
    pub fn with_screen(mut self, on: bool) -> Self {
        self.screen = on;
        self
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn mode(&self) -> MatmulMode {
        self.mode
    }

    /// The path a `rows x cols` weight stored as `dtype` takes for `role`.
    pub fn path_for(
        &self,
        role: WeightRole,
        dtype: crate::DType,
        rows: usize,
        cols: usize,
    ) -> CpuPath {
        let int8 = match self.mode {
            MatmulMode::Reference => None,
            _ => Int8Kernel::best(),
        };
        policy::select(self.mode, role, dtype, rows, cols, int8, self.isa)
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Applies `f(row_index, row)` to every `cols`-wide row of `data`, in parallel when large.
    fn rows_mut(&self, data: &mut [f32], cols: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
        let rows = data.len().checked_div(cols).unwrap_or(0);
        if data.len() < PARALLEL_MIN_ELEMS || rows < 2 {
            for (r, row) in data.chunks_exact_mut(cols.max(1)).enumerate() {
                f(r, row);
            }
            return;
        }
        let tasks = rows.min(self.pool.threads() * 4);
        let ptr = SyncPtr(data.as_mut_ptr());
        self.pool.for_each(tasks, |t| {
            for r in rows * t / tasks..rows * (t + 1) / tasks {
                // SAFETY: tasks cover disjoint row ranges of `data`.
                let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * cols), cols) };
                f(r, row);
            }
        });
    }
}

/// The CPU's step inputs: host vectors.
#[derive(Debug, Default)]
pub struct CpuStep {
    meta: Vec<TokenMeta>,
    ids: Vec<u32>,
    sel: Vec<u32>,
}

thread_local! {
    static GDN_SCRATCH: RefCell<GdnScratch> = RefCell::new(GdnScratch::default());
}

/// Per-thread buffers of the gated delta rule.
#[derive(Default)]
struct GdnScratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    g: Vec<f32>,
    beta: Vec<f32>,
    kv: Vec<f32>,
    out: Vec<f32>,
    chunk: gdn::ChunkScratch,
}

/// q and k of v-head `h` of one post-conv qkv row, L2-normalised (q also scaled by
/// `k_dim^-1/2`), into `q` and `k`; the arithmetic every path (step, chunk, replay) shares.
fn head_qk(shape: &GdnShape, row: &[f32], h: usize, q: &mut [f32], k: &mut [f32]) {
    let dk = shape.k_dim;
    let kh = shape.k_head_of(h);
    q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
    let k0 = shape.key_dim() + kh * dk;
    k.copy_from_slice(&row[k0..k0 + dk]);
    gdn::l2_normalize(q);
    gdn::l2_normalize(k);
    let scale = 1.0 / (dk as f32).sqrt();
    for x in q.iter_mut() {
        *x *= scale;
    }
}

/// v of v-head `h` of one post-conv qkv row.
fn head_v<'a>(shape: &GdnShape, row: &'a [f32], h: usize) -> &'a [f32] {
    let v0 = 2 * shape.key_dim() + h * shape.v_dim;
    &row[v0..v0 + shape.v_dim]
}

/// The recurrence of v-head `h` over `n` recorded tokens (post-conv rows `qkv`, gates `g`,
/// `beta` with `v_heads` columns) on state `s`, token by token; outputs go to `out`
/// (`n x v_dim`) when given.
#[allow(clippy::too_many_arguments)]
fn head_recurrent(
    shape: &GdnShape,
    s: &mut [f32],
    qkv: &[f32],
    g: &[f32],
    beta: &[f32],
    h: usize,
    sc: &mut GdnScratch,
    mut out: Option<&mut [f32]>,
) {
    let (dk, dv, hv, cd) = (shape.k_dim, shape.v_dim, shape.v_heads, shape.conv_dim());
    sc.q.resize(dk, 0.0);
    sc.k.resize(dk, 0.0);
    sc.kv.resize(dv, 0.0);
    let n = g.len() / hv;
    for t in 0..n {
        let row = &qkv[t * cd..(t + 1) * cd];
        head_qk(shape, row, h, &mut sc.q, &mut sc.k);
        let o = out.as_deref_mut().map(|o| &mut o[t * dv..(t + 1) * dv]);
        gdn::delta_step(
            s,
            &sc.q,
            &sc.k,
            head_v(shape, row, h),
            g[t * hv + h],
            beta[t * hv + h],
            &mut sc.kv,
            o,
        );
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type Meta = Vec<TokenMeta>;
    type Gdn = CpuGdn;
    type Step = CpuStep;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn upload_weight(&self, w: &HostWeight, role: WeightRole) -> Result<CpuWeight, RuntimeError> {
        let path = self.path_for(role, w.dtype, w.rows, w.cols);
        let int8 = match path {
            CpuPath::Int8(kernel, terms) => PackedWeight::pack(w).map(|packed| {
                Arc::new(Int8Weight {
                    packed,
                    kernel,
                    terms,
                })
            }),
            CpuPath::F32(_) => None,
        };
        let best = Int8Kernel::best();
        let screen = policy::screen_for(self.mode, role, w.dtype, path, best, self.screen)
            .and_then(|(k, format)| ArgmaxScreen::new(&self.pool, w, format, k))
            .map(Arc::new);
        // Matrices the f32 kernels stream move to huge pages (see `huge`); embedding tables,
        // read a row at a time, and vectors stay where they are.
        let host = if int8.is_none() && role != WeightRole::Embedding && w.rows > 1 {
            on_huge_pages(w)
        } else {
            w.clone()
        };
        Ok(CpuWeight { host, int8, screen })
    }

    fn weight_path(&self, w: &CpuWeight) -> WeightPath {
        let greedy_screen = (w.screen.as_ref()).map(|s| format!("{} {}", s.format(), s.kernel()));
        match &w.int8 {
            Some(i) => WeightPath {
                format: w.host.dtype,
                activations: match i.terms {
                    Terms::One => Activations::Int8,
                    Terms::Two => Activations::Int8x2,
                },
                kernel: i.kernel.to_string(),
                greedy_screen,
            },
            None => WeightPath {
                format: w.host.dtype,
                activations: Activations::F32,
                kernel: self.isa.to_string(),
                greedy_screen,
            },
        }
    }

    fn tensor(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor::zeros(rows, cols)
    }

    fn reshape(&self, t: &mut CpuTensor, rows: usize, cols: usize) {
        t.reshape(rows, cols);
    }

    fn shape(&self, t: &CpuTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CpuTensor {
        assert_eq!(data.len(), rows * cols);
        CpuTensor {
            data: data.to_vec(),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &CpuTensor) -> Vec<f32> {
        t.data.clone()
    }

    fn copy_to_host(&self, t: &CpuTensor, out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(&t.data);
    }

    fn upload_meta(&self, meta: &[TokenMeta]) -> Vec<TokenMeta> {
        meta.to_vec()
    }

    fn step_new(&self) -> CpuStep {
        CpuStep::default()
    }

    fn step_upload(&self, step: &mut CpuStep, meta: &[TokenMeta], ids: &[u32], sel: &[u32]) {
        for (dst, src) in [(&mut step.ids, ids), (&mut step.sel, sel)] {
            dst.clear();
            dst.extend_from_slice(src);
        }
        step.meta.clear();
        step.meta.extend_from_slice(meta);
    }

    fn step_meta<'a>(&self, step: &'a CpuStep) -> &'a Vec<TokenMeta> {
        &step.meta
    }

    fn kv_new(&self, layers: usize, kv_heads: usize, head_dim: usize) -> CpuKv {
        CpuKv::new(layers, kv_heads, head_dim, self.kv_type)
    }

    fn kv_reserve(&self, kv: &mut CpuKv, row: usize, capacity: usize, keep: usize) {
        kv.reserve(row, capacity, keep);
    }

    fn kv_capacity(&self, kv: &CpuKv, row: usize) -> usize {
        kv.capacity(row)
    }

    fn kv_value_bytes(&self, kv: &CpuKv) -> usize {
        kv.ty.bytes()
    }

    fn kv_copy_row(&self, kv: &mut CpuKv, src: usize, dst: usize, len: usize) {
        kv.copy_row(src, dst, len);
    }

    fn kv_release(&self, kv: &mut CpuKv, row: usize) {
        kv.release(row);
    }

    fn kv_write(
        &self,
        kv: &mut CpuKv,
        layer: usize,
        k: &CpuTensor,
        v: &CpuTensor,
        meta: &Vec<TokenMeta>,
    ) {
        let dim = kv.kv_dim();
        assert_eq!(k.cols, dim);
        assert_eq!(v.cols, dim);
        for (t, m) in meta.iter().enumerate() {
            kv.write(layer, m.row as usize, m.pos as usize, k.row(t), v.row(t));
        }
    }

    fn gdn_new(&self, layers: usize, shape: GdnShape, history: usize) -> CpuGdn {
        assert!(
            shape.conv_kernel >= 1
                && shape.k_heads > 0
                && shape.v_heads.is_multiple_of(shape.k_heads),
            "GDN shape {shape:?}"
        );
        CpuGdn::new(layers, shape, history)
    }

    fn gdn_open_row(&self, st: &mut CpuGdn, row: usize) {
        st.open(row);
    }

    fn gdn_release_row(&self, st: &mut CpuGdn, row: usize) {
        st.release(row);
    }

    fn gdn_copy_row(&self, st: &mut CpuGdn, src: usize, dst: usize) {
        st.copy_row(src, dst);
    }

    fn gdn_begin(&self, st: &mut CpuGdn, spans: &[RowSpan]) {
        for s in spans {
            st.begin(s.row as usize, s.count as usize);
        }
    }

    fn gdn_rollback(&self, st: &mut CpuGdn, row: usize, keep: usize) -> Result<(), RuntimeError> {
        st.check_rollback(row, keep)?;
        let shape = st.shape;
        let r = st.row_mut(row);
        if keep == r.last {
            return Ok(());
        }
        let (cur, prev) = (r.cur, r.prev());
        let (cd, hist, hv, sl) = (
            shape.conv_dim(),
            shape.conv_kernel - 1,
            shape.v_heads,
            shape.k_dim * shape.v_dim,
        );
        let mut jobs = Vec::with_capacity(r.layers.len());
        for l in &mut r.layers {
            // Conv window: the last `hist` inputs of [checkpoint window, kept tokens].
            let mut all = l.conv[prev].clone();
            all.extend_from_slice(&l.hist_x[..keep * cd]);
            let from = all.len() - hist * cd;
            l.conv[cur].copy_from_slice(&all[from..]);
            let [s0, s1] = &mut l.state;
            let (dst, src) = if cur == 0 { (s0, &*s1) } else { (s1, &*s0) };
            dst.copy_from_slice(src);
            jobs.push((
                SyncPtr(dst.as_mut_ptr()),
                &l.hist_qkv[..keep * cd],
                &l.hist_g[..keep * hv],
                &l.hist_beta[..keep * hv],
            ));
        }
        let jobs = &jobs;
        self.pool.for_each(jobs.len() * hv, |task| {
            let (ptr, qkv, g, beta) = jobs[task / hv];
            let h = task % hv;
            // SAFETY: each task owns head h of one layer's current state.
            let s = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(h * sl), sl) };
            GDN_SCRATCH
                .with(|sc| head_recurrent(&shape, s, qkv, g, beta, h, &mut sc.borrow_mut(), None));
        });
        r.last = keep;
        Ok(())
    }

    fn causal_conv(
        &self,
        st: &mut CpuGdn,
        layer: usize,
        x: &CpuTensor,
        weight: &CpuTensor,
        spans: &[RowSpan],
        out: &mut CpuTensor,
    ) {
        let shape = st.shape;
        let (cd, k) = (shape.conv_dim(), shape.conv_kernel);
        assert_eq!(x.cols, cd);
        assert_eq!((weight.rows, weight.cols), (cd, k));
        out.reshape(x.rows, cd);
        let history = st.history;
        for sp in spans {
            let (first, n) = (sp.first as usize, sp.count as usize);
            let r = st.row_mut(sp.row as usize);
            let cur = r.cur;
            let l = &mut r.layers[layer];
            let [c0, c1] = &mut l.conv;
            let (next, prev) = if cur == 0 { (c0, &*c1) } else { (c1, &*c0) };
            gdn::conv_span(
                prev,
                &x.data[first * cd..(first + n) * cd],
                &weight.data,
                k,
                cd,
                &mut out.data[first * cd..(first + n) * cd],
                next,
            );
            let rec = n.min(history);
            l.hist_x
                .extend_from_slice(&x.data[first * cd..(first + rec) * cd]);
        }
    }

    fn gated_delta(
        &self,
        st: &mut CpuGdn,
        layer: usize,
        qkv: &CpuTensor,
        g: &CpuTensor,
        beta: &CpuTensor,
        spans: &[RowSpan],
        out: &mut CpuTensor,
    ) {
        let shape = st.shape;
        let (cd, hv, dk, dv) = (shape.conv_dim(), shape.v_heads, shape.k_dim, shape.v_dim);
        let vd = shape.value_dim();
        let sl = dk * dv;
        assert_eq!(qkv.cols, cd);
        assert_eq!((g.cols, beta.cols), (hv, hv));
        out.reshape(qkv.rows, vd);
        let history = st.history;
        let mut states = Vec::with_capacity(spans.len());
        for sp in spans {
            let r = st.row_mut(sp.row as usize);
            let (cur, prev) = (r.cur, r.prev());
            let l = &mut r.layers[layer];
            let (first, n) = (sp.first as usize, sp.count as usize);
            let rec = n.min(history);
            l.hist_qkv
                .extend_from_slice(&qkv.data[first * cd..(first + rec) * cd]);
            l.hist_g
                .extend_from_slice(&g.data[first * hv..(first + rec) * hv]);
            l.hist_beta
                .extend_from_slice(&beta.data[first * hv..(first + rec) * hv]);
            let [s0, s1] = &mut l.state;
            let (dst, src) = if cur == 0 { (s0, &*s1) } else { (s1, &*s0) };
            let _ = prev;
            states.push((SyncPtr(dst.as_mut_ptr()), src.as_ptr() as usize));
        }
        let states = &states;
        let out_ptr = SyncPtr(out.data.as_mut_ptr());
        self.pool.for_each(spans.len() * hv, |task| {
            let (si, h) = (task / hv, task % hv);
            let sp = spans[si];
            let (first, n) = (sp.first as usize, sp.count as usize);
            let (dst, src) = states[si];
            // SAFETY: each task owns head h of one row's current state; the checkpoint copy is
            // only read.
            let s = unsafe { std::slice::from_raw_parts_mut(dst.get().add(h * sl), sl) };
            let s0 = unsafe { std::slice::from_raw_parts((src as *const f32).add(h * sl), sl) };
            s.copy_from_slice(s0);
            let rows = &qkv.data[first * cd..(first + n) * cd];
            let (gs, bs) = (
                &g.data[first * hv..(first + n) * hv],
                &beta.data[first * hv..(first + n) * hv],
            );
            GDN_SCRATCH.with(|sc| {
                let sc = &mut *sc.borrow_mut();
                let mut o = std::mem::take(&mut sc.out);
                o.resize(n * dv, 0.0);
                if sp.chunked {
                    for v in [&mut sc.q, &mut sc.k] {
                        v.resize(n * dk, 0.0);
                    }
                    sc.v.resize(n * dv, 0.0);
                    sc.g.clear();
                    sc.beta.clear();
                    for t in 0..n {
                        let row = &rows[t * cd..(t + 1) * cd];
                        head_qk(
                            &shape,
                            row,
                            h,
                            &mut sc.q[t * dk..(t + 1) * dk],
                            &mut sc.k[t * dk..(t + 1) * dk],
                        );
                        sc.v[t * dv..(t + 1) * dv].copy_from_slice(head_v(&shape, row, h));
                        sc.g.push(gs[t * hv + h]);
                        sc.beta.push(bs[t * hv + h]);
                    }
                    gdn::delta_chunked(
                        s,
                        &sc.q,
                        &sc.k,
                        &sc.v,
                        &sc.g,
                        &sc.beta,
                        &mut o,
                        dk,
                        dv,
                        &mut sc.chunk,
                    );
                } else {
                    head_recurrent(&shape, s, rows, gs, bs, h, sc, Some(&mut o));
                }
                for t in 0..n {
                    // SAFETY: each task writes head h of its own span's tokens.
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(
                            out_ptr.get().add((first + t) * vd + h * dv),
                            dv,
                        )
                    };
                    dst.copy_from_slice(&o[t * dv..(t + 1) * dv]);
                }
                sc.out = o;
            });
        });
    }

    fn gdn_gates(
        &self,
        a: &mut CpuTensor,
        b: &mut CpuTensor,
        a_neg: &CpuTensor,
        dt_bias: &CpuTensor,
    ) {
        let hv = a_neg.cols;
        assert_eq!((a.cols, b.cols, dt_bias.cols), (hv, hv, hv));
        assert_eq!(a.rows, b.rows);
        for row in a.data.chunks_exact_mut(hv) {
            for ((x, &an), &db) in row.iter_mut().zip(&a_neg.data).zip(&dt_bias.data) {
                *x = an * gdn::softplus(*x + db);
            }
        }
        for x in &mut b.data {
            *x = gdn::sigmoid(*x);
        }
    }

    fn rms_norm_gated(&self, x: &mut CpuTensor, z: &CpuTensor, weight: &CpuTensor, eps: f32) {
        assert_eq!((x.rows, x.cols), (z.rows, z.cols));
        let (w, dim, zs) = (&weight.data, weight.cols, &z.data);
        assert_eq!(x.cols % dim, 0);
        let cols = x.cols;
        self.rows_mut(&mut x.data, cols, |r, row| {
            let zr = &zs[r * cols..(r + 1) * cols];
            for (xg, zg) in row.chunks_exact_mut(dim).zip(zr.chunks_exact(dim)) {
                gdn::rms_norm_gated(xg, zg, w, eps);
            }
        });
    }

    fn sigmoid_mul(&self, x: &mut CpuTensor, gate: &CpuTensor) {
        assert_eq!(x.data.len(), gate.data.len());
        let (gs, cols) = (&gate.data, x.cols);
        self.rows_mut(&mut x.data, cols, |r, row| {
            for (v, &gv) in row.iter_mut().zip(&gs[r * cols..(r + 1) * cols]) {
                *v *= gdn::sigmoid(gv);
            }
        });
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) {
        let table = &table.host;
        out.reshape(ids.len(), table.cols);
        for (t, &id) in ids.iter().enumerate() {
            assert!(
                (id as usize) < table.rows,
                "token id {id} outside the embedding table"
            );
            table.dequantize_row(id as usize, out.row_mut(t));
        }
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight, out: &mut CpuTensor) {
        self.matmul_many(x, &[w], &mut [out]);
    }

    fn matmul_argmax(&self, x: &CpuTensor, w: &CpuWeight, out: &mut CpuTensor) {
        let Some(screen) = &w.screen else {
            return self.matmul(x, w, out);
        };
        assert_eq!(
            x.cols, w.host.cols,
            "matmul {}: inner dimensions differ",
            w.host.name
        );
        out.reshape(x.rows, w.host.rows);
        let rescored = screen.matmul(
            &self.pool,
            self.isa,
            &w.host,
            &x.data,
            x.rows,
            &mut out.data,
        );
        tracing::trace!(?rescored, "greedy screen of {}", w.host.name);
    }

    fn matmul_many(&self, x: &CpuTensor, ws: &[&CpuWeight], outs: &mut [&mut CpuTensor]) {
        assert_eq!(ws.len(), outs.len());
        // Weights on the int8 path, by family and terms (one family per process; the terms
        // follow the weight's role: the target's and a drafter's may differ), and on the f32
        // path.
        type Int8Jobs<'a> = Vec<(&'a PackedWeight, &'a mut [f32])>;
        let mut int8_jobs: Vec<((Int8Kernel, Terms), Int8Jobs<'_>)> = Vec::new();
        let mut f32_jobs: Vec<(&HostWeight, &mut [f32])> = Vec::new();
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            let h = &w.host;
            assert_eq!(x.cols, h.cols, "matmul {}: inner dimensions differ", h.name);
            out.reshape(x.rows, h.rows);
            match &w.int8 {
                Some(i) => {
                    let key = (i.kernel, i.terms);
                    let job = (&i.packed, &mut out.data[..]);
                    match int8_jobs.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, jobs)) => jobs.push(job),
                        None => int8_jobs.push((key, vec![job])),
                    }
                }
                None => f32_jobs.push((h, &mut out.data)),
            }
        }
        for ((k, terms), jobs) in &mut int8_jobs {
            int8::matmul_many(&self.pool, *k, *terms, &x.data, x.rows, jobs);
        }
        if !f32_jobs.is_empty() {
            matmul::matmul_many(&self.pool, self.isa, &x.data, x.rows, &mut f32_jobs);
        }
    }

    fn add_bias(&self, x: &mut CpuTensor, bias: &CpuTensor) {
        assert_eq!(x.cols, bias.cols);
        let b = &bias.data;
        self.rows_mut(&mut x.data, x.cols, |_, row| elementwise::add(row, b));
    }

    fn rms_norm(
        &self,
        x: &mut CpuTensor,
        weight: &CpuTensor,
        eps: f32,
        zero_centred: bool,
        out: Option<&mut CpuTensor>,
    ) {
        let w = &weight.data;
        assert_eq!(x.cols % w.len(), 0);
        match out {
            None => self.rows_mut(&mut x.data, x.cols, |_, row| {
                norm::rms_norm_inplace(row, w, eps, zero_centred)
            }),
            Some(out) => {
                out.reshape(x.rows, x.cols);
                let (src, cols) = (&x.data, x.cols);
                self.rows_mut(&mut out.data, cols, |r, row| {
                    norm::rms_norm(&src[r * cols..(r + 1) * cols], w, eps, zero_centred, row)
                });
            }
        }
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        meta: &Vec<TokenMeta>,
        inv_freq: &CpuTensor,
        head_dim: usize,
        style: RopeStyle,
    ) {
        assert_eq!(x.rows, meta.len());
        let inv = &inv_freq.data;
        self.rows_mut(&mut x.data, x.cols, |t, row| {
            rope::rope_token(row, meta[t].pos, inv, head_dim, style)
        });
    }

    fn attention(
        &self,
        q: &CpuTensor,
        kv: &CpuKv,
        layer: usize,
        meta: &Vec<TokenMeta>,
        shape: AttnShape,
        out: &mut CpuTensor,
    ) {
        attention_tasks::attention(&self.pool, self.isa, q, kv, layer, meta, shape, out);
    }

    fn silu_mul(&self, gate: &mut CpuTensor, up: &CpuTensor) {
        assert_eq!(gate.data.len(), up.data.len());
        let (u, cols) = (&up.data, gate.cols);
        self.rows_mut(&mut gate.data, cols, |r, row| {
            elementwise::silu_mul(row, &u[r * cols..(r + 1) * cols])
        });
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        assert_eq!(x.data.len(), y.data.len());
        let (src, cols) = (&y.data, x.cols);
        self.rows_mut(&mut x.data, cols, |r, row| {
            elementwise::add(row, &src[r * cols..(r + 1) * cols])
        });
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) {
        let cols = x.cols;
        self.rows_mut(&mut x.data, cols, |_, row| {
            for v in row {
                *v *= s;
            }
        });
    }

    fn grouped_conv(
        &self,
        x: &CpuTensor,
        base: &CpuTensor,
        dynamic: &CpuTensor,
        col: usize,
        group: usize,
        meta: &Vec<TokenMeta>,
        out: &mut CpuTensor,
    ) {
        assert_eq!(x.rows, meta.len());
        assert_eq!(base.cols, x.cols);
        assert!(group > 0 && x.cols.is_multiple_of(group));
        assert_eq!(dynamic.rows, x.rows);
        assert!(col + base.rows * (x.cols / group) <= dynamic.cols);
        out.reshape(x.rows, x.cols);
        let shape = conv::ConvShape {
            cols: x.cols,
            taps: base.rows,
            group,
            dyn_cols: dynamic.cols,
            col,
        };
        let (xs, b, d) = (&x.data, &base.data, &dynamic.data);
        self.rows_mut(&mut out.data, shape.cols, |t, row| {
            conv::conv_token(t, xs, b, d, meta, shape, row)
        });
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[u32], out: &mut CpuTensor) {
        out.reshape(rows.len(), x.cols);
        self.gather_rows_at(x, rows, out, 0);
    }

    fn gather_rows_at(&self, x: &CpuTensor, rows: &[u32], out: &mut CpuTensor, at: usize) {
        assert_eq!(out.cols, x.cols, "gather_rows_at: columns differ");
        assert!(
            at + rows.len() <= out.rows,
            "gather_rows_at: rows past the end of out"
        );
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(at + i).copy_from_slice(x.row(r as usize));
        }
    }

    fn copy_columns(&self, src: &CpuTensor, dst: &mut CpuTensor, col: usize) {
        assert_eq!(src.rows, dst.rows);
        assert!(col + src.cols <= dst.cols);
        for r in 0..src.rows {
            let c = src.cols;
            dst.row_mut(r)[col..col + c].copy_from_slice(src.row(r));
        }
    }

    fn argmax_rows(&self, x: &CpuTensor) -> Vec<u32> {
        (0..x.rows).map(|r| elementwise::argmax(x.row(r))).collect()
    }

    fn embed_step(&self, table: &CpuWeight, step: &CpuStep, out: &mut CpuTensor) {
        self.embed(table, &step.ids, out);
    }

    fn gather_step(&self, x: &CpuTensor, step: &CpuStep, out: &mut CpuTensor) {
        self.gather_rows(x, &step.sel, out);
    }
}
