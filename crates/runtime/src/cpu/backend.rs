//! `Backend` for the CPU: f32 activation tensors, weights in their stored form (target
//! projections also repacked for the int8 kernels, see `policy`), a worker pool.

use std::cell::RefCell;
use std::sync::Arc;

use super::int8::{self, pack::PackedWeight, Int8Kernel};
use super::kv::CpuKv;
use super::matmul::{self, Isa};
use super::ops::{attention, elementwise, norm, rope};
use super::policy::{self, CpuPath, MatmulMode};
use super::pool::{CpuPool, SyncPtr};
use super::tensor::CpuTensor;
use super::weight::{CpuWeight, Int8Weight};
use crate::backend::{
    Activations, AttnShape, Backend, RopeStyle, TokenMeta, WeightPath, WeightRole,
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
}

impl CpuBackend {
    /// A backend with `threads` workers (0 = one per core), the best kernels for this CPU and
    /// the matmul mode of `DFLASH_MATMUL` (panics on a bad value; see [`CpuBackend::from_env`]).
    pub fn new(threads: usize) -> Self {
        Self::from_env(threads).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`CpuBackend::new`], refusing a bad `DFLASH_MATMUL` with an error.
    pub fn from_env(threads: usize) -> Result<Self, RuntimeError> {
        Ok(Self::with_options(
            threads,
            Isa::detect(),
            MatmulMode::from_env()?,
        ))
    }

    /// A backend using the f32 kernels of `isa` (which the CPU must support) and `mode`.
    pub fn with_options(threads: usize, isa: Isa, mode: MatmulMode) -> Self {
        assert!(isa.is_supported(), "{isa} kernels are not supported here");
        Self {
            pool: CpuPool::new(threads),
            isa,
            mode,
        }
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
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type Meta = Vec<TokenMeta>;
    type Step = CpuStep;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    fn upload_weight(&self, w: &HostWeight, role: WeightRole) -> Result<CpuWeight, RuntimeError> {
        let int8 = match self.path_for(role, w.dtype, w.rows, w.cols) {
            CpuPath::Int8(kernel) => {
                PackedWeight::pack(w).map(|packed| Arc::new(Int8Weight { packed, kernel }))
            }
            CpuPath::F32(_) => None,
        };
        Ok(CpuWeight {
            host: w.clone(),
            int8,
        })
    }

    fn weight_path(&self, w: &CpuWeight) -> WeightPath {
        match &w.int8 {
            Some(i) => WeightPath {
                format: w.host.dtype,
                activations: Activations::Int8,
                kernel: i.kernel.to_string(),
            },
            None => WeightPath {
                format: w.host.dtype,
                activations: Activations::F32,
                kernel: self.isa.to_string(),
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

    fn kv_new(&self, layers: usize, kv_dim: usize) -> CpuKv {
        CpuKv::new(layers, kv_dim)
    }

    fn kv_reserve(&self, kv: &mut CpuKv, row: usize, capacity: usize, keep: usize) {
        kv.reserve(row, capacity, keep);
    }

    fn kv_capacity(&self, kv: &CpuKv, row: usize) -> usize {
        kv.capacity(row)
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
        let dim = kv.kv_dim;
        assert_eq!(k.cols, dim);
        assert_eq!(v.cols, dim);
        let rows = &mut kv.layers[layer];
        for (t, m) in meta.iter().enumerate() {
            let r = &mut rows[m.row as usize];
            let at = m.pos as usize * dim;
            assert!(
                at + dim <= r.k.len(),
                "KV write past the row's reserved capacity"
            );
            r.k[at..at + dim].copy_from_slice(k.row(t));
            r.v[at..at + dim].copy_from_slice(v.row(t));
        }
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

    fn matmul_many(&self, x: &CpuTensor, ws: &[&CpuWeight], outs: &mut [&mut CpuTensor]) {
        assert_eq!(ws.len(), outs.len());
        // Weights on the int8 path (one family per process) and on the f32 path.
        let mut int8_jobs: Vec<(&PackedWeight, &mut [f32])> = Vec::new();
        let mut f32_jobs: Vec<(&HostWeight, &mut [f32])> = Vec::new();
        let mut kernel = None;
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            let h = &w.host;
            assert_eq!(x.cols, h.cols, "matmul {}: inner dimensions differ", h.name);
            out.reshape(x.rows, h.rows);
            match &w.int8 {
                Some(i) => {
                    kernel = Some(i.kernel);
                    int8_jobs.push((&i.packed, &mut out.data));
                }
                None => f32_jobs.push((h, &mut out.data)),
            }
        }
        if let Some(k) = kernel {
            int8::matmul_many(&self.pool, k, &x.data, x.rows, &mut int8_jobs);
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
        let AttnShape {
            n_heads,
            n_kv_heads,
            head_dim,
            scale,
        } = shape;
        assert_eq!(q.cols, n_heads * head_dim);
        assert_eq!(q.rows, meta.len());
        out.reshape(q.rows, q.cols);
        let group = n_heads / n_kv_heads;
        let rows = &kv.layers[layer];
        let kv_dim = kv.kv_dim;
        let out_ptr = SyncPtr(out.data.as_mut_ptr());
        let tasks = q.rows * n_heads;
        let isa = self.isa;
        self.pool.for_each(tasks, |task| {
            let (t, h) = (task / n_heads, task % n_heads);
            let m = meta[t];
            let row = &rows[m.row as usize];
            let qh = &q.data[t * q.cols + h * head_dim..t * q.cols + (h + 1) * head_dim];
            // SAFETY: each task writes its own (token, head) slice of `out`.
            let o = unsafe {
                std::slice::from_raw_parts_mut(
                    out_ptr.get().add(t * q.cols + h * head_dim),
                    head_dim,
                )
            };
            let kv_slice = attention::KvSlice {
                k: &row.k,
                v: &row.v,
                kv_dim,
                head_off: (h / group) * head_dim,
                start: m.kv_start as usize,
                end: m.kv_end as usize,
            };
            SCORES.with(|s| attention::attend(isa, qh, kv_slice, scale, &mut s.borrow_mut(), o));
        });
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

    fn gather_rows(&self, x: &CpuTensor, rows: &[u32], out: &mut CpuTensor) {
        out.reshape(rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            out.row_mut(i).copy_from_slice(x.row(r as usize));
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
