//! `Backend` for CUDA GPUs.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::device::{
    ck, ensure, int, long, Arg, CudaOptions, Device, Epilogue, PrefillGemm, Scratch, MM_SEGS,
    MM_TILES, MM_WARPS, NORM_Q_FEW_ROWS, NORM_Q_FEW_THREADS, NORM_Q_THREADS, NORM_STAGE,
    NORM_THREADS, QT_BM, QT_NT, QT_NT_MID, QT_NT_NARROW, QT_WARPS, QT_WIDTHS, SQ_R, SQ_WARPS,
    TC_BM, TC_BN, TC_THREADS, X2_BM, X2_NT, X2_WARPS,
};
use super::gdn::CudaGdn;
use super::graph::Graphs;
use super::int8::int8_format;
use super::int8_x::{QuantizedX, X8Form};
use super::kv::CudaKv;
use super::l2_ahead::L2Ahead;
use super::pack;
use super::profile::{KernelClassTime, ProfileKeys, Profiler};
use super::rope_kv::HeadNorms;
use super::tensor::{CudaMeta, CudaStep, CudaTensor, CudaWeight};
use crate::backend::{
    k_norm_then_rope_kv, prompt_runs, qk_norm_then_rope_kv, qkv_then_rope_kv, Activations,
    AttnShape, Backend, GdnShape, GraphKey, QkNorm, Rope, RopeStyle, RowSpan, TokenMeta,
    WeightPath, WeightRole,
};
use crate::choice::{DraftRow, SampleRow, Verdict, VerifyRow};
use crate::cpu::int8::pack::PANEL;
use crate::dtype::DType;
use crate::error::RuntimeError;
use crate::kv_type::KvType;
use crate::quant::GROUP;
use crate::weight::HostWeight;

/// Threads per block of the element-wise kernels.
const EW_THREADS: u32 = 256;
/// Most blocks an element-wise kernel is launched with (they loop over the rest).
const EW_MAX_BLOCKS: usize = 4096;
/// Threads per block of the activation quantizer (a warp per 32-value block).
const QUANT_THREADS: u32 = 256;
/// Largest rotary half-dimension (as on the CPU).
const ROPE_MAX_HALF: usize = 256;
/// Floats of dequantized weight the cuBLAS path keeps at once.
const DEQ_PANEL_MAX: usize = 32 << 20;

/// KV rows the device table is first made for (it grows by doubling, which moves it).
const KV_TABLE_ROWS: usize = 256;

/// `usize` as an `int` launch parameter; panics when it does not fit.
fn int_of(v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{v} does not fit a 32-bit kernel parameter"))
}

/// One product of a fused matmul launch (`MmSeg` in matmul.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct MmSeg {
    w: u64,
    w2: u64,
    out: u64,
    row_bytes: i64,
    n: i32,
    block0: i32,
}

/// `MmParams` in matmul.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct MmParams {
    seg: [MmSeg; MM_SEGS],
    x: u64,
    /// Int8 kernels: the (d, ds) pairs of x's blocks (x then points at the codes).
    xs: u64,
    nseg: i32,
    k: i32,
    pub(super) m: i32,
    pad: i32,
    /// The rope epilogue's fields (zero for the others): see [`RopeEpi`].
    pub(super) rope: RopeEpi,
    /// `mmqs` kernels: where the int8 copy of the output goes (codes, pairs); else 0.
    oc: u64,
    os: u64,
    /// Weights of the launches after this one, requested into L2 before the kernel waits.
    ahead: L2Ahead,
}

/// The fields of `MmParams` (matmul.cu) that only the rope epilogue reads.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(super) struct RopeEpi {
    pub meta: u64,
    pub inv_freq: u64,
    pub kv_rows: u64,
    pub layer: i32,
    pub head_dim: i32,
    pub half: i32,
    pub style: i32,
    pub kv_dim: i32,
    /// The KV cache holds f16 (1) or f32 (0).
    pub kv_half: i32,
}

/// A weight (and, for SwiGLU, its partner) and the output of one fused product.
pub(super) struct Product<'a> {
    w: &'a CudaWeight,
    w2: Option<&'a CudaWeight>,
    out: u64,
}

/// The CUDA backend. See the module docs of [`crate::cuda`].
pub struct CudaBackend {
    dev: Arc<Device>,
    graphs: Mutex<Graphs>,
    owners: AtomicU64,
}

fn grid_1d(n: usize, threads: u32) -> u32 {
    n.div_ceil(threads as usize).clamp(1, EW_MAX_BLOCKS) as u32
}

impl CudaBackend {
    /// Opens device 0 (or `DFLASH_CUDA_DEVICE`) with the options of the environment
    /// (see [`CudaOptions::from_env`]). Fails with [`RuntimeError::Device`] saying what is
    /// missing when there is no driver, no GPU or no NVRTC; never panics.
    pub fn new() -> Result<Self, RuntimeError> {
        Self::with_options(CudaOptions::from_env()?)
    }

    pub fn with_options(opts: CudaOptions) -> Result<Self, RuntimeError> {
        let graphs = Graphs::from_env().map_err(RuntimeError::Device)?;
        Ok(Self {
            dev: Arc::new(Device::open(&opts)?),
            graphs: Mutex::new(graphs),
            owners: AtomicU64::new(1),
        })
    }

    /// Whether decode steps are replayed as CUDA graphs (on unless `DFLASH_CUDA_GRAPHS=0`
    /// or profiling is on).
    pub fn graphs_enabled(&self) -> bool {
        self.graphs.lock().expect("graph lock").enabled()
            && self.dev.profiler.lock().expect("profiler lock").is_none()
    }

    /// Milliseconds of GPU time of the work `f` enqueues (CUDA events around it; waits for it).
    pub fn time_gpu(&self, f: &mut dyn FnMut()) -> f64 {
        use cudarc::driver::sys as cu;
        self.dev.bind();
        let ev = || {
            ck(
                self.dev
                    .ctx
                    .new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT)),
                "event creation",
            )
        };
        let (start, end) = (ev(), ev());
        ck(start.record(&self.dev.stream), "event record");
        f();
        ck(end.record(&self.dev.stream), "event record");
        ck(start.elapsed_ms(&end), "event timing") as f64
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written per second),
    /// median of 5 copies of `bytes` bytes after a warm-up: the memory ceiling kernels are
    /// compared with.
    pub fn copy_bandwidth(&self, bytes: usize) -> f64 {
        self.dev.bind();
        let n = bytes / 4;
        let (src, mut dst) = (self.dev.zeros::<f32>(n), self.dev.zeros::<f32>(n));
        let mut copy = || {
            self.dev.fresh_x.forget();
            ck(
                self.dev.stream.memcpy_dtod(&src, &mut dst),
                "device-to-device copy",
            )
        };
        copy();
        let mut t: Vec<f64> = (0..5).map(|_| self.time_gpu(&mut copy)).collect();
        t.sort_by(f64::total_cmp);
        2.0 * (4 * n) as f64 / (t[2] * 1e-3) / 1e9
    }

    /// Starts timing every kernel launch by class (CUDA events; graphs are off meanwhile),
    /// or stops it.
    pub fn set_profiling(&self, on: bool) {
        self.profile_by(on.then_some(ProfileKeys::Class));
    }

    /// Starts timing every kernel launch, grouped by `keys`, or stops it (`None`).
    pub fn profile_by(&self, keys: Option<ProfileKeys>) {
        self.synchronize();
        *self.dev.profiler.lock().expect("profiler lock") = keys.map(Profiler::new);
    }

    /// GPU time per profile key since profiling was turned on (or last taken).
    pub fn take_profile(&self) -> Vec<KernelClassTime> {
        self.dev.bind();
        self.dev
            .profiler
            .lock()
            .expect("profiler lock")
            .as_mut()
            .map(Profiler::take)
            .unwrap_or_default()
    }

    /// How this backend's KV caches hold keys and values.
    pub fn kv_type(&self) -> KvType {
        self.dev.kv_type
    }

    /// The GPU's name, e.g. "NVIDIA H200".
    pub fn device_name(&self) -> &str {
        &self.dev.name
    }

    /// Launch names skipped by `DFLASH_CUDA_SKIP` (a profiling aid; results are wrong while
    /// any is).
    pub fn skipped_launches(&self) -> &[String] {
        &self.dev.skip
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.dev.compute_capability
    }

    /// What the kernels were compiled for, e.g. `sm_90`.
    pub fn kernel_target(&self) -> String {
        self.dev.target.arch_flag()
    }

    /// The prefill product path in use.
    pub fn prefill_gemm(&self) -> PrefillGemm {
        self.dev.prefill_gemm
    }

    /// Compiles and loads the matmul kernels of several weight formats at once (in parallel);
    /// otherwise each format's kernels are built when its first weight is uploaded.
    pub fn preload(&self, formats: &[DType]) -> Result<(), RuntimeError> {
        self.dev.bind();
        self.dev.preload(formats).map_err(RuntimeError::Device)
    }

    pub(crate) fn device(&self) -> &Device {
        &self.dev
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) {
        self.dev.bind();
        super::device::ck(self.dev.stream.synchronize(), "stream synchronisation");
    }

    pub(super) fn ptr<T>(&self, s: &cudarc::driver::CudaSlice<T>) -> u64 {
        self.dev.ptr(s)
    }

    pub(super) fn tptr(&self, t: &CudaTensor) -> u64 {
        self.dev.ptr(&t.buf)
    }

    /// The checks of a RoPE + KV write over q with `q_cols` columns: the layer, the rotary
    /// and head dimensions, and every token's KV slot reserved.
    pub(super) fn check_rope_kv(
        q_cols: usize,
        kv: &CudaKv,
        layer: usize,
        meta: &CudaMeta,
        half: usize,
        head_dim: usize,
    ) {
        let dim = kv.kv_dim;
        assert!(layer < kv.layers, "KV layer {layer} out of range");
        assert!(
            half <= ROPE_MAX_HALF,
            "rotary dimension above 512 is not supported"
        );
        assert!(head_dim > 0 && q_cols.is_multiple_of(head_dim) && dim.is_multiple_of(head_dim));
        assert!(2 * half <= head_dim);
        Self::check_kv_slots(kv, meta);
    }

    /// Every token's KV slot (its row's position `pos`) is reserved.
    fn check_kv_slots(kv: &CudaKv, meta: &CudaMeta) {
        for m in &meta.host {
            assert!(
                (m.row as usize) < kv.rows.len(),
                "KV row {} was never reserved",
                m.row
            );
            assert!(
                (m.pos as usize) < kv.capacity(m.row as usize),
                "KV write past the row's reserved capacity"
            );
        }
    }

    pub(super) fn meta_ptr(&self, m: &CudaMeta) -> u64 {
        self.ptr(
            m.buf
                .as_ref()
                .expect("metadata of a non-empty step has a buffer"),
        )
    }

    /// Copies `ids` into the shared index scratch and runs `f` with its address, holding the
    /// scratch lock so that no other op can overwrite the indices before the launch.
    fn with_indices(&self, ids: &[u32], f: impl FnOnce(u64)) {
        let mut s = self.dev.scratch.lock().expect("scratch lock");
        let p = ensure(&self.dev.stream, &self.dev.epoch, &mut s.idx, ids.len());
        self.dev.htod(ids, p);
        f(p);
    }

    fn elementwise(&self, f: &cudarc::driver::CudaFunction, name: &str, n: usize, args: &[Arg]) {
        if n == 0 {
            return;
        }
        self.dev.launch(
            f,
            name,
            (grid_1d(n, EW_THREADS), 1, 1),
            (EW_THREADS, 1, 1),
            0,
            args,
        );
    }

    /// The products `prods` of one x and format in one launch, each output already shaped
    /// `[M, N]` (`MM_SEGS` products at most; SwiGLU products carry their up weight).
    fn mm_launch(&self, x: &CudaTensor, prods: &[Product<'_>], epi: Epilogue) {
        self.mm_rows(x, prods, epi, 0..x.rows, false);
    }

    /// [`Self::mm_launch`] over the runs of a step's rows, each on its path.
    fn mm_runs(
        &self,
        x: &CudaTensor,
        prods: &[Product<'_>],
        epi: Epilogue,
        runs: &[(Range<usize>, bool)],
    ) {
        for (rows, tensor) in runs {
            self.mm_rows(x, prods, epi, rows.clone(), *tensor);
        }
    }

    /// Rows `rows` of the products of [`Self::mm_launch`] (x and outputs addressed from the
    /// range's first row), on the tensor-core kernels when `tensor`, else on the CUDA-core
    /// kernel. Neither makes a row's result depend on the range.
    fn mm_rows(
        &self,
        x: &CudaTensor,
        prods: &[Product<'_>],
        epi: Epilogue,
        rows: Range<usize>,
        tensor: bool,
    ) {
        let m = rows.len();
        let Some(first) = prods.first() else { return };
        if m == 0 {
            return;
        }
        assert!(rows.end <= x.rows, "product rows outside x");
        assert!(prods.len() <= MM_SEGS);
        let k = first.w.cols;
        let x_ptr = self.tptr(x) + (4 * rows.start * k) as u64;
        if tensor {
            return self.mm_tensor(x_ptr, m, k, prods, epi, rows.start);
        }
        self.mm_core(x_ptr, m, k, prods, epi, rows.start, RopeEpi::default());
    }

    /// The CUDA-core tile (index into `MM_TILES`) for `m` rows of x: the smallest tile
    /// holding all of x up to 8 rows; 9..=16 rows as two tiles of 8 (twice the blocks: a
    /// 576-row product at M = 16 takes 3.7 us this way against 12.0 with one tile of 16 on
    /// the H200); prefill (M > 16) as tiles of 16. DFLASH_CUDA_MM_TILE fixes one. The tile
    /// never changes a row's result.
    pub(super) fn mm_tile(&self, m: usize) -> usize {
        let want = self.dev.fixed_mt.unwrap_or(match m {
            0..=8 => m,
            9..=16 => 8,
            _ => 16,
        });
        MM_TILES
            .iter()
            .position(|t| t.mt >= want)
            .expect("tiles cover 1..=16")
    }

    /// The products of `m` rows of x at `x_ptr` (row `row0` of the outputs) on the CUDA-core
    /// kernels, or for int8 weights and at least `int8_mma_min_m` rows on the integer
    /// tensor-core kernels (same bits); int8 weights quantize x first (`quantize_x`). `rope`
    /// holds the rope epilogue's fields.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mm_core(
        &self,
        x_ptr: u64,
        m: usize,
        k: usize,
        prods: &[Product<'_>],
        epi: Epilogue,
        row0: usize,
        rope: RopeEpi,
    ) {
        let first = &prods[0];
        let kernels = self.dev.loaded(first.w.dtype);
        if let Some(f) = self.float_mma_kernel(first.w, epi, m) {
            let (p, blocks) = self.mm_params(x_ptr, m, k, prods, row0, X2_WARPS * X2_NT * 16);
            if blocks > 0 {
                self.dev.launch_with(
                    f,
                    &format!("matmul[{}]", first.w.name),
                    (blocks as u32, m.div_ceil(X2_BM) as u32, 1),
                    ((X2_WARPS * 32) as u32, 1, 1),
                    &p,
                );
            }
            return;
        }
        let ti = self.mm_tile(m);
        let mma = first.w.int8 && m >= self.dev.int8_mma_min_m;
        // An int8 SwiGLU product on the dp4a kernels also writes the int8 copy of its output
        // for the down projection, when its blocks can own whole 32-value blocks and there
        // are no more of those blocks than SMs: the kernel's blocks are 4x the product's usual
        // ones, and where they queue for SMs (Qwen3-4B's 9,728 outputs: 304 blocks) the
        // product lost more than the quantizer launch it saves (H200: decode 1.91 -> 2.09
        // ms a step), where they do not (the default model's 1,536: 48 blocks) the step
        // gained 2% (docs/benchmarks/2026-12-04-h200-swiglu-q8.md).
        let n = first.w.rows;
        let out_copy = (epi == Epilogue::Swiglu
            && first.w.int8
            && !mma
            && self.dev.swiglu_q8
            && prods.len() == 1
            && n.is_multiple_of(GROUP)
            && n / GROUP <= self.dev.sm_count
            && ti < kernels.mmqs.len()
            && self.wants_int8_copy(m, n))
        .then(|| self.int8_out_buffer(m, n, self.x8_form(m)));
        // The int8 tensor-core kernels' width (index into QT_WIDTHS): as forced, else
        // `qt_width`'s; a forced width they are not built for takes the widest.
        let width = match self.dev.int8_mma_width {
            Some(t) => t,
            None if mma => self.qt_width(prods, epi),
            None => QT_NT,
        };
        let qt = QT_WIDTHS.iter().position(|&w| w == width).unwrap_or(0);
        let per_block = if mma {
            epi.qt_outputs(QT_WIDTHS[qt])
        } else if out_copy.is_some() {
            SQ_WARPS * SQ_R
        } else {
            MM_WARPS * MM_TILES[ti].r_of(epi)
        };
        let (mut p, blocks) = self.mm_params(x_ptr, m, k, prods, row0, per_block);
        if blocks == 0 {
            return;
        }
        p.rope = rope;
        // The int8 copy of x the kernel before wrote (the RMS norm, the attention merge), else
        // the quantizer's.
        // (The tensor-core kernels read it tiled, the rest by rows: `x8_form`.)
        let form = self.x8_form(m);
        debug_assert!(
            !first.w.int8 || form.tiled == mma,
            "x8_form follows the kernel"
        );
        let fresh = self.dev.fresh_x.get();
        let handed = fresh.and_then(|q| q.rows_at(p.x, m, k, form));
        if first.w.int8 {
            (p.x, p.xs) = match handed {
                Some(c) => c,
                None => self.quantize_x(p.x, m, k, form),
            };
        }
        if let Some((oc, os)) = out_copy {
            (p.oc, p.os) = (oc, os);
        }
        let (f, rows_per_block, threads) = if mma {
            (
                &kernels.mmqt[qt][epi as usize],
                QT_BM / self.dev.int8.terms(),
                QT_WARPS * 32,
            )
        } else if out_copy.is_some() {
            (&kernels.mmqs[ti], MM_TILES[ti].mt, SQ_WARPS * 32)
        } else if first.w.int8 {
            (
                &kernels.mmq[ti][epi as usize],
                MM_TILES[ti].mt,
                MM_WARPS * 32,
            )
        } else {
            (
                &kernels.mm[ti][epi as usize],
                MM_TILES[ti].mt,
                MM_WARPS * 32,
            )
        };
        self.dev.launch_with(
            f,
            &format!("matmul[{}]", first.w.name),
            (blocks as u32, m.div_ceil(rows_per_block) as u32, 1),
            (threads as u32, 1, 1),
            &p,
        );
        // x is unchanged unless an output overlaps it: the copy serves the next product too.
        // (The outputs written are the segments' rows, from row `row0` of each product.)
        if let Some(q) = fresh.filter(|_| handed.is_some()) {
            let writes_x = p
                .seg
                .iter()
                .zip(prods)
                .any(|(sg, pr)| q.overlaps(sg.out, (4 * m * pr.w.rows) as u64));
            if !writes_x {
                self.dev.fresh_x.note(q);
            }
        }
        if let Some((codes, pairs)) = out_copy {
            self.dev.fresh_x.note(QuantizedX {
                x: p.seg[0].out,
                rows: m,
                k: n,
                form: self.x8_form(m),
                codes,
                pairs,
            });
        }
    }

    /// The TF32 tensor-core kernel (matmul_x2.cu) of `w`'s products of `m` rows with epilogue
    /// `epi`, when they take it: weights uploaded for it (`CudaWeight::float_mma`), store or
    /// add. Whether they take it does not depend on M, and the kernels for one and two column
    /// tiles give a row the same bits, so every M of a weight has one summation order.
    fn float_mma_kernel(
        &self,
        w: &CudaWeight,
        epi: Epilogue,
        m: usize,
    ) -> Option<&cudarc::driver::CudaFunction> {
        if !w.float_mma {
            return None;
        }
        let i = Epilogue::FLOAT_MMA.iter().position(|&e| e == epi)?;
        let tiles = if m > 8 { 2 } else { 1 };
        self.dev.loaded(w.dtype).mmx2.get(tiles - 1)?.get(i)
    }

    /// The width (column tiles of 8 per block) of the int8 tensor-core kernels for `prods`
    /// with epilogue `epi`. SwiGLU products take the wide blocks (the ring kernel, two column
    /// tiles of gate/up pairs) where they leave no SM idle; the others the middle width where
    /// its blocks make at least 1.5 an SM, else the narrow blocks. On an H100 at 8 and 16 rows,
    /// the middle blocks took Qwen3-4B's q (4096 outputs: 256 of them) from 10.3 (narrow) and
    /// 9.9 us (wide) to 8.8 and its output head from 217 and 265 us to 203, but lost to the
    /// narrow ones on o and down (2560 outputs: 160 blocks, 10.2 against 8.7 us and 17.0
    /// against 15.2), and the wide blocks lost to one or the other on every product but the
    /// SwiGLU ones (docs/benchmarks/2026-12-07-h100-qt-padding-rows.md).
    fn qt_width(&self, prods: &[Product<'_>], epi: Epilogue) -> usize {
        let sms = self.dev.sm_count;
        if epi == Epilogue::Swiglu {
            if self.qt_blocks(prods, epi, QT_NT) >= sms {
                QT_NT
            } else {
                QT_NT_NARROW
            }
        } else if 2 * self.qt_blocks(prods, epi, QT_NT_MID) >= 3 * sms {
            QT_NT_MID
        } else {
            QT_NT_NARROW
        }
    }

    /// Blocks per row tile of x of the int8 tensor-core kernels `tiles` column tiles wide.
    fn qt_blocks(&self, prods: &[Product<'_>], epi: Epilogue, tiles: usize) -> usize {
        let per_block = epi.qt_outputs(tiles);
        prods.iter().map(|p| p.w.rows.div_ceil(per_block)).sum()
    }

    /// Quantizes `m` rows of `k` values at `x` to int8 per 32-value block (`quant_q8_f32`) in
    /// form `form` into the scratch buffer; returns the addresses of the codes and of the
    /// (d, ds) pairs.
    fn quantize_x(&self, x: u64, m: usize, k: usize, form: X8Form) -> (u64, u64) {
        debug_assert!(
            k.is_multiple_of(GROUP),
            "int8 x rows are whole 32-value blocks"
        );
        let blocks = m * k / GROUP;
        let (base, pairs) = self.int8_x_buffer(m, k, form);
        let warps = (QUANT_THREADS / 32) as usize;
        self.dev.launch(
            &self.dev.k.quant_q8,
            "quant_q8",
            (blocks.div_ceil(warps).clamp(1, 4096) as u32, 1, 1),
            (QUANT_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(x),
                long(blocks),
                Arg::Ptr(base),
                Arg::Ptr(pairs),
                int(k),
                Arg::I32(form.word()),
            ],
        );
        (base, pairs)
    }

    /// The form of the int8 copy of `rows` rows of x that an int8 product of `rows` rows
    /// reads: tiled for the tensor-core kernels (from `int8_mma_min_m` rows), else by rows;
    /// in the device's terms per row.
    pub(super) fn x8_form(&self, rows: usize) -> X8Form {
        X8Form {
            terms: self.dev.int8.terms(),
            tiled: rows >= self.dev.int8_mma_min_m,
        }
    }

    /// The scratch buffer for an int8 copy of `m` rows of `k` values in form `form`
    /// (cuda/int8_x.rs): the addresses of its codes and of its (d, ds) pairs.
    fn int8_x_buffer(&self, m: usize, k: usize, form: X8Form) -> (u64, u64) {
        self.int8_scratch(m, k, form, |s| &mut s.xq)
    }

    /// The scratch buffer for the int8 copy a SwiGLU product writes of its `m` rows of `k`
    /// outputs (apart from [`Self::int8_x_buffer`], which holds its x): codes, pairs.
    fn int8_out_buffer(&self, m: usize, k: usize, form: X8Form) -> (u64, u64) {
        self.int8_scratch(m, k, form, |s| &mut s.xq_out)
    }

    /// An int8 copy of `m` rows of `k` values in form `form` in the scratch slot `slot`
    /// picks: codes, pairs.
    fn int8_scratch(
        &self,
        m: usize,
        k: usize,
        form: X8Form,
        slot: impl FnOnce(&mut Scratch) -> &mut Option<cudarc::driver::CudaSlice<u8>>,
    ) -> (u64, u64) {
        let (pairs, bytes) = form.bytes(m, k);
        let mut s = self.dev.scratch.lock().expect("scratch lock");
        let base = ensure(&self.dev.stream, &self.dev.epoch, slot(&mut s), bytes);
        (base, base + pairs as u64)
    }

    /// The int8 copy a kernel writing `rows` rows of `k` values at `x` should also write
    /// (where and in which form), when an int8 product of that width may read them next.
    pub(super) fn int8_copy_for(&self, x: u64, rows: usize, k: usize) -> Option<QuantizedX> {
        self.wants_int8_copy(rows, k).then(|| {
            let form = self.x8_form(rows);
            let (codes, pairs) = self.int8_x_buffer(rows, k, form);
            QuantizedX {
                x,
                rows,
                k,
                form,
                codes,
                pairs,
            }
        })
    }

    /// Whether an int8 product may read an int8 copy of `rows` rows of `k` values next.
    fn wants_int8_copy(&self, rows: usize, k: usize) -> bool {
        self.dev.int8_handoff && rows > 0 && k.is_multiple_of(GROUP) && self.dev.int8_k(k)
    }

    /// The launch parameters of products over `m` rows of x at `x_ptr` (row `row0` of the
    /// outputs), `per_block` weight rows a block; and the blocks.
    pub(super) fn mm_params(
        &self,
        x_ptr: u64,
        m: usize,
        k: usize,
        prods: &[Product<'_>],
        row0: usize,
        per_block: usize,
    ) -> (MmParams, usize) {
        let first = &prods[0];
        let mut p = MmParams {
            x: x_ptr,
            nseg: prods.len() as i32,
            k: int_of(k),
            m: int_of(m),
            ahead: self.dev.ahead.take(self.dev.l2_ahead),
            ..Default::default()
        };
        let mut blocks = 0usize;
        for (seg, pr) in p.seg.iter_mut().zip(prods) {
            assert_eq!(pr.w.kernels(), first.w.kernels(), "one launch, one kernel");
            assert_eq!(pr.w.cols, k, "one launch, one K");
            *seg = MmSeg {
                w: self.ptr(&pr.w.buf),
                w2: pr.w2.map_or(0, |w2| self.ptr(&w2.buf)),
                out: pr.out + (4 * row0 * pr.w.rows) as u64,
                row_bytes: pr.w.row_bytes as i64,
                n: int_of(pr.w.rows),
                block0: int_of(blocks),
            };
            blocks += pr.w.rows.div_ceil(per_block);
        }
        (p, blocks)
    }

    /// The tensor-core kernels (matmul_tc.cu) over `m` rows of x at `x_ptr`.
    fn mm_tensor(
        &self,
        x_ptr: u64,
        m: usize,
        k: usize,
        prods: &[Product<'_>],
        epi: Epilogue,
        row0: usize,
    ) {
        let (p, blocks) = self.mm_params(x_ptr, m, k, prods, row0, TC_BN);
        if blocks == 0 {
            return;
        }
        let first = &prods[0];
        let kernels = self.dev.loaded(first.w.dtype);
        self.dev.launch_with(
            &kernels.mmtc[epi as usize],
            &format!("matmul_tc[{}]", first.w.name),
            (blocks as u32, m.div_ceil(TC_BM) as u32, 1),
            (TC_THREADS, 1, 1),
            &p,
        );
    }

    /// The runs of rows `0..rows` of a step laid out by `spans` that take one product path,
    /// in order: `true` for prompt rows when the tensor-core path is on.
    pub(super) fn row_runs(&self, rows: usize, spans: &[RowSpan]) -> Vec<(Range<usize>, bool)> {
        if self.dev.prefill_gemm == PrefillGemm::Tensor {
            prompt_runs(rows, spans)
        } else if rows > 0 {
            vec![(0..rows, false)]
        } else {
            Vec::new()
        }
    }

    /// `out = x · wᵀ`, out already shaped `[M, N]`.
    fn matmul_launch(&self, x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) {
        let (m, n) = (x.rows, w.rows);
        if m == 0 || n == 0 {
            return;
        }
        if let PrefillGemm::Cublas { min_rows } = self.dev.prefill_gemm {
            if m > 16 && m >= min_rows {
                return self.matmul_cublas(x, w, out);
            }
        }
        self.mm_launch(
            x,
            &[Product {
                w,
                w2: None,
                out: self.tptr(out),
            }],
            Epilogue::Store,
        );
    }

    /// The products `x · wᵀ` into `outs` (checked, each output shaped `[M, N]`), bound to the
    /// device, for one launch.
    pub(super) fn store_products<'a>(
        &self,
        x: &CudaTensor,
        ws: &[&'a CudaWeight],
        outs: &mut [&mut CudaTensor],
    ) -> Vec<Product<'a>> {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            Self::check_product(x, w);
            self.reshape(out, x.rows, w.rows);
        }
        self.dev.bind();
        ws.iter()
            .zip(outs.iter())
            .map(|(w, out)| Product {
                w,
                w2: None,
                out: self.tptr(out),
            })
            .collect()
    }

    /// The residual-add product `out += x · wᵀ` (checked: out is `[M, N]`), bound to the device.
    fn add_product<'a>(&self, x: &CudaTensor, w: &'a CudaWeight, out: &CudaTensor) -> Product<'a> {
        Self::check_product(x, w);
        assert_eq!(
            (out.rows, out.cols),
            (x.rows, w.rows),
            "matmul_add {}: the output has the wrong shape",
            w.name
        );
        self.dev.bind();
        Product {
            w,
            w2: None,
            out: self.tptr(out),
        }
    }

    /// The SwiGLU product `out = silu(x · gateᵀ) * (x · upᵀ)` (checked, out shaped `[M, N]`),
    /// bound to the device.
    fn swiglu_product<'a>(
        &self,
        x: &CudaTensor,
        gate: &'a CudaWeight,
        up: &'a CudaWeight,
        out: &mut CudaTensor,
    ) -> Product<'a> {
        Self::check_product(x, gate);
        Self::check_product(x, up);
        self.reshape(out, x.rows, gate.rows);
        self.dev.bind();
        Product {
            w: gate,
            w2: Some(up),
            out: self.tptr(out),
        }
    }

    fn check_product(x: &CudaTensor, w: &CudaWeight) {
        assert_eq!(x.cols, w.cols, "matmul {}: inner dimensions differ", w.name);
        assert!(
            w.cols.is_multiple_of(32),
            "matmul {}: needs whole 32-value groups",
            w.name
        );
    }

    /// Dequantizes rows `row0..row0+count` of `w` (or the rows `ids` when given) into the
    /// f32 buffer at `out`.
    fn dequant(&self, w: &CudaWeight, ids: Option<u64>, row0: usize, count: usize, out: u64) {
        if count == 0 || w.cols == 0 {
            return;
        }
        let ids_arg = Arg::Ptr(ids.unwrap_or(0));
        if w.cols.is_multiple_of(32) {
            let threads = (w.cols / 32).clamp(32, 256).next_multiple_of(32) as u32;
            self.dev.launch(
                &self.dev.loaded(w.dtype).dequant,
                "dequantize",
                (count as u32, 1, 1),
                (threads, 1, 1),
                0,
                &[
                    Arg::Ptr(self.ptr(&w.buf)),
                    long(w.row_bytes),
                    int(w.cols),
                    ids_arg,
                    int(row0),
                    int(count),
                    Arg::Ptr(out),
                ],
            );
        } else {
            assert!(
                !w.dtype.is_quantized(),
                "{} rows must be whole blocks",
                w.dtype
            );
            self.dev.launch(
                &self.dev.k.dequant_float_any,
                "dequantize",
                (count as u32, 1, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(self.ptr(&w.buf)),
                    long(w.row_bytes),
                    int(w.cols),
                    int(w.dtype.index()),
                    ids_arg,
                    int(row0),
                    int(count),
                    Arg::Ptr(out),
                ],
            );
        }
    }

    /// The cuBLAS prefill path: dequantize panels of weight rows to f32, SGEMM each.
    fn matmul_cublas(&self, x: &CudaTensor, w: &CudaWeight, out: &CudaTensor) {
        use cudarc::cublas::sys as bs;
        let blas = self
            .dev
            .blas
            .as_ref()
            .expect("cuBLAS started for this path");
        let (m, n, k) = (x.rows, w.rows, w.cols);
        let panel = (DEQ_PANEL_MAX / k.max(1)).clamp(1, n);
        let mut s = self.dev.scratch.lock().expect("scratch lock");
        let deq = ensure(&self.dev.stream, &self.dev.epoch, &mut s.deq, panel * k);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut n0 = 0;
        while n0 < n {
            let nc = panel.min(n - n0);
            self.dequant(w, None, n0, nc, deq);
            // Column-major view: C (nc x m, ldc = n) = A^T (nc x k) · B (k x m), with
            // A = the dequantized panel (k x nc, lda = k) and B = x (k x m, ldb = k).
            // SAFETY: every pointer is a live device buffer of the sizes given.
            let r = unsafe {
                bs::cublasSgemm_v2(
                    *blas.handle(),
                    bs::cublasOperation_t::CUBLAS_OP_T,
                    bs::cublasOperation_t::CUBLAS_OP_N,
                    nc as i32,
                    m as i32,
                    k as i32,
                    &alpha,
                    deq as *const f32,
                    k as i32,
                    self.tptr(x) as *const f32,
                    k as i32,
                    &beta,
                    (self.tptr(out) + 4 * n0 as u64) as *mut f32,
                    n as i32,
                )
            };
            assert!(
                r == bs::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
                "cuBLAS SGEMM failed: {r:?}"
            );
            n0 += nc;
        }
    }

    fn kv_relayout(
        &self,
        kv: &CudaKv,
        src: u64,
        src_cap: usize,
        dst: u64,
        dst_cap: usize,
        len: usize,
    ) {
        let words = kv.part_words(len);
        if words == 0 || kv.layers == 0 {
            return;
        }
        self.dev.launch(
            &self.dev.k.kv_copy,
            "kv copy",
            (
                grid_1d(words, EW_THREADS).min(1024),
                (2 * kv.layers) as u32,
                1,
            ),
            (EW_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(src),
                long(kv.part_words(src_cap)),
                Arg::Ptr(dst),
                long(kv.part_words(dst_cap)),
                long(words),
            ],
        );
    }

    /// Uploads the host mirror of the KV row table.
    fn kv_sync_table(&self, kv: &mut CudaKv) {
        let need = kv.table_host.len();
        if kv.table.as_ref().is_none_or(|t| t.len() < need) {
            kv.table = Some(
                self.dev
                    .zeros::<u64>(need.next_power_of_two().max(2 * KV_TABLE_ROWS)),
            );
            self.dev.moved();
        }
        let p = self.ptr(kv.table.as_ref().expect("just set"));
        self.dev.htod(&kv.table_host, p);
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type Meta = CudaMeta;
    type Gdn = CudaGdn;
    type Step = CudaStep;

    fn name(&self) -> &'static str {
        "cuda"
    }

    /// Runs `f` on the calling thread with the context current. All work goes to one
    /// stream, so there is nothing else to set up.
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.dev.bind();
        f()
    }

    /// The target's projections in Q4_0, Q4_1 or Q8_0 with at least `PANEL` rows take int8
    /// activations as the [`Int8Policy`](super::device::Int8Policy) says; every other weight
    /// f32 activations. Every weight of those formats is stored packed (cuda/pack.rs), the
    /// only layout their kernels read; the others as read.
    fn upload_weight(&self, w: &HostWeight, role: WeightRole) -> Result<CudaWeight, RuntimeError> {
        self.dev.bind();
        self.dev.format(w.dtype).map_err(RuntimeError::Device)?;
        let packed = if int8_format(w.dtype) {
            let layout = pack::pack(w).zip(pack::row_bytes(w.dtype, w.cols));
            Some(layout.ok_or_else(|| {
                RuntimeError::Device(format!(
                    "{}: {} columns of {} are not whole {GROUP}-value groups",
                    w.name, w.cols, w.dtype
                ))
            })?)
        } else {
            None
        };
        // The CPU's rule (cpu::policy::select), so both backends take one numeric path.
        let int8 = self.dev.int8.takes()
            && role == WeightRole::Projection
            && packed.is_some()
            && w.rows >= PANEL;
        if int8 {
            self.dev.note_int8_k(w.cols);
        }
        // The vocabulary projection of a packed format on TF32 tensor cores (matmul_x2.cu).
        let float_mma = self.dev.float_mma && role == WeightRole::Vocab && packed.is_some();
        let row_bytes = packed.as_ref().map_or(w.row_bytes(), |p| p.1);
        let bytes = packed
            .as_ref()
            .map_or(w.bytes.as_slice(), |p| p.0.as_slice());
        let buf = self.dev.uninit::<u8>(bytes.len());
        self.dev.htod(bytes, self.ptr(&buf));
        Ok(CudaWeight {
            name: w.name.clone(),
            dtype: w.dtype,
            rows: w.rows,
            cols: w.cols,
            row_bytes,
            buf,
            int8,
            float_mma,
        })
    }

    fn weight_path(&self, w: &CudaWeight) -> WeightPath {
        if w.int8 {
            WeightPath {
                format: w.dtype,
                activations: if self.dev.int8.terms() == 2 {
                    Activations::Int8x2
                } else {
                    Activations::Int8
                },
                kernel: match self.dev.int8_mma_min_m {
                    usize::MAX => "cuda dp4a".into(),
                    m => format!("cuda dp4a; int8 mma from M = {m}"),
                },
                greedy_screen: None,
            }
        } else {
            let tf32 = self.float_mma_kernel(w, Epilogue::Store, 1).is_some();
            WeightPath {
                format: w.dtype,
                activations: Activations::F32,
                kernel: if tf32 { "cuda tf32x2 mma" } else { "cuda" }.into(),
                greedy_screen: None,
            }
        }
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        self.dev.bind();
        CudaTensor {
            buf: self.dev.zeros::<f32>(rows * cols),
            rows,
            cols,
        }
    }

    /// Keeps the buffer when it holds `rows * cols` values; otherwise allocates a new one
    /// (zeroed). Contents are undefined after a reshape, as the trait says.
    fn reshape(&self, t: &mut CudaTensor, rows: usize, cols: usize) {
        if rows * cols > t.buf.len() {
            self.dev.bind();
            t.buf = self.dev.zeros::<f32>(rows * cols);
            self.dev.moved();
        }
        t.rows = rows;
        t.cols = cols;
    }

    fn shape(&self, t: &CudaTensor) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> CudaTensor {
        assert_eq!(data.len(), rows * cols);
        self.dev.bind();
        let buf = self.dev.uninit::<f32>(data.len());
        self.dev.htod(data, self.ptr(&buf));
        CudaTensor { buf, rows, cols }
    }

    fn to_host(&self, t: &CudaTensor) -> Vec<f32> {
        let mut out = Vec::new();
        self.copy_to_host(t, &mut out);
        out
    }

    fn copy_to_host(&self, t: &CudaTensor, out: &mut Vec<f32>) {
        self.dev.bind();
        out.clear();
        out.resize(t.len(), 0.0);
        self.dev.dtoh(self.tptr(t), &mut out[..]);
    }

    fn upload_meta(&self, meta: &[TokenMeta]) -> CudaMeta {
        self.dev.bind();
        let pool = self.dev.meta_pool.clone();
        if meta.is_empty() {
            return CudaMeta {
                host: Vec::new(),
                buf: None,
                pool,
            };
        }
        let flat: Vec<u32> = meta
            .iter()
            .flat_map(|m| [m.row, m.pos, m.kv_start, m.kv_end])
            .collect();
        let reuse = {
            let mut p = pool.lock().expect("meta pool lock");
            p.iter()
                .position(|b| b.len() >= flat.len())
                .map(|i| p.swap_remove(i))
        };
        let buf = reuse.unwrap_or_else(|| self.dev.uninit::<u32>(flat.len().next_power_of_two()));
        self.dev.htod(&flat, self.ptr(&buf));
        CudaMeta {
            host: meta.to_vec(),
            buf: Some(buf),
            pool,
        }
    }

    // Gated DeltaNet state and ops: cuda/gdn.rs.
    fn gdn_new(&self, layers: usize, shape: GdnShape, history: usize) -> CudaGdn {
        self.cuda_gdn_new(layers, shape, history)
    }
    fn gdn_open_row(&self, st: &mut CudaGdn, row: usize) {
        self.cuda_gdn_open_row(st, row)
    }
    fn gdn_release_row(&self, st: &mut CudaGdn, row: usize) {
        self.cuda_gdn_release_row(st, row)
    }
    fn gdn_copy_row(&self, st: &mut CudaGdn, src: usize, dst: usize) {
        self.cuda_gdn_copy_row(st, src, dst)
    }
    fn gdn_begin(&self, st: &mut CudaGdn, spans: &[RowSpan]) {
        self.cuda_gdn_begin(st, spans)
    }
    fn gdn_rollback(&self, st: &mut CudaGdn, row: usize, keep: usize) -> Result<(), RuntimeError> {
        self.cuda_gdn_rollback(st, row, keep)
    }
    fn causal_conv(
        &self,
        st: &mut CudaGdn,
        layer: usize,
        x: &CudaTensor,
        weight: &CudaTensor,
        spans: &[RowSpan],
        out: &mut CudaTensor,
    ) {
        self.cuda_causal_conv(st, layer, x, weight, spans, out)
    }
    fn gated_delta(
        &self,
        st: &mut CudaGdn,
        layer: usize,
        qkv: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spans: &[RowSpan],
        out: &mut CudaTensor,
    ) {
        self.cuda_gated_delta(st, layer, qkv, g, beta, spans, out)
    }
    fn gdn_gates(
        &self,
        a: &mut CudaTensor,
        b: &mut CudaTensor,
        a_neg: &CudaTensor,
        dt: &CudaTensor,
    ) {
        self.cuda_gdn_gates(a, b, a_neg, dt)
    }
    fn rms_norm_gated(&self, x: &mut CudaTensor, z: &CudaTensor, w: &CudaTensor, eps: f32) {
        self.cuda_rms_norm_gated(x, z, w, eps)
    }
    fn sigmoid_mul(&self, x: &mut CudaTensor, gate: &CudaTensor) {
        self.cuda_sigmoid_mul(x, gate)
    }

    fn kv_new(&self, layers: usize, kv_heads: usize, head_dim: usize) -> CudaKv {
        CudaKv::new(layers, kv_heads * head_dim, self.dev.kv_type)
    }

    fn kv_reserve(&self, kv: &mut CudaKv, row: usize, capacity: usize, keep: usize) {
        self.dev.bind();
        kv.ensure_row(row);
        let old_cap = kv.caps[row];
        if old_cap >= capacity {
            // The device table must cover every row the host knows, allocated or not.
            if kv
                .table
                .as_ref()
                .is_none_or(|t| t.len() < kv.table_host.len())
            {
                self.kv_sync_table(kv);
            }
            return;
        }
        let new = self
            .dev
            .zeros::<u16>(2 * kv.layers * kv.part_words(capacity));
        let keep = keep.min(old_cap);
        if let Some(old) = &kv.rows[row] {
            self.kv_relayout(kv, self.ptr(old), old_cap, self.ptr(&new), capacity, keep);
        }
        kv.table_host[2 * row] = self.ptr(&new);
        kv.table_host[2 * row + 1] = capacity as u64;
        // The old storage is freed in stream order, after the copy above.
        kv.rows[row] = Some(new);
        kv.caps[row] = capacity;
        self.kv_sync_table(kv);
    }

    fn kv_capacity(&self, kv: &CudaKv, row: usize) -> usize {
        kv.capacity(row)
    }

    fn kv_value_bytes(&self, kv: &CudaKv) -> usize {
        kv.ty.bytes()
    }

    fn kv_copy_row(&self, kv: &mut CudaKv, src: usize, dst: usize, len: usize) {
        let src_cap = kv.capacity(src);
        assert!(
            len <= src_cap,
            "kv_copy_row: {len} positions asked from row {src}, which holds {src_cap}"
        );
        self.kv_reserve(kv, dst, src_cap.max(len), 0);
        if src == dst || len == 0 {
            return;
        }
        let s = self.ptr(kv.rows[src].as_ref().expect("source row reserved"));
        let d = self.ptr(kv.rows[dst].as_ref().expect("reserved above"));
        self.kv_relayout(kv, s, src_cap, d, kv.caps[dst], len);
    }

    fn kv_release(&self, kv: &mut CudaKv, row: usize) {
        if row >= kv.rows.len() {
            return;
        }
        self.dev.bind();
        kv.rows[row] = None;
        kv.caps[row] = 0;
        kv.table_host[2 * row] = 0;
        kv.table_host[2 * row + 1] = 0;
        self.kv_sync_table(kv);
    }

    fn kv_write(
        &self,
        kv: &mut CudaKv,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        meta: &CudaMeta,
    ) {
        let dim = kv.kv_dim;
        assert_eq!(k.cols, dim);
        assert_eq!(v.cols, dim);
        assert!(layer < kv.layers, "KV layer {layer} out of range");
        let t = meta.host.len();
        assert!(k.rows >= t && v.rows >= t);
        Self::check_kv_slots(kv, meta);
        if t == 0 || dim == 0 {
            return;
        }
        self.dev.bind();
        let table = self.ptr(kv.table.as_ref().expect("rows reserved"));
        self.dev.launch(
            &self.dev.k.kv_write,
            "kv_write",
            (dim.div_ceil(EW_THREADS as usize) as u32, t as u32, 1),
            (EW_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(self.tptr(k)),
                Arg::Ptr(self.tptr(v)),
                Arg::Ptr(self.meta_ptr(meta)),
                int(t),
                int(dim),
                Arg::Ptr(table),
                int(layer),
                int(usize::from(kv.ty == KvType::F16)),
            ],
        );
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) {
        self.reshape(out, ids.len(), table.cols);
        for &id in ids {
            assert!(
                (id as usize) < table.rows,
                "token id {id} outside the embedding table"
            );
        }
        if ids.is_empty() || table.cols == 0 {
            return;
        }
        self.dev.bind();
        let o = self.tptr(out);
        self.with_indices(ids, |p| self.dequant(table, Some(p), 0, ids.len(), o));
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight, out: &mut CudaTensor) {
        Self::check_product(x, w);
        self.reshape(out, x.rows, w.rows);
        self.dev.bind();
        self.matmul_launch(x, w, out);
    }

    /// One launch for all products when they share a format (q/k/v, gate/up) and the
    /// kernel path is in use; otherwise one product at a time.
    fn matmul_many(&self, x: &CudaTensor, ws: &[&CudaWeight], outs: &mut [&mut CudaTensor]) {
        assert_eq!(ws.len(), outs.len());
        let same_format = ws.iter().all(|w| w.kernels() == ws[0].kernels());
        let cublas = matches!(self.dev.prefill_gemm, PrefillGemm::Cublas { min_rows }
            if x.rows > 16 && x.rows >= min_rows);
        if !same_format || cublas {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(x, w, out);
            }
            return;
        }
        // MM_SEGS products a launch (a DFlash drafter's context: every layer's k and v).
        for (ws, outs) in ws.chunks(MM_SEGS).zip(outs.chunks_mut(MM_SEGS)) {
            let prods = self.store_products(x, ws, outs);
            self.mm_launch(x, &prods, Epilogue::Store);
        }
    }

    fn add_bias(&self, x: &mut CudaTensor, bias: &CudaTensor) {
        assert_eq!(x.cols, bias.cols);
        self.dev.bind();
        self.elementwise(
            &self.dev.k.add_bias,
            "add_bias",
            x.len(),
            &[
                Arg::Ptr(self.tptr(x)),
                Arg::Ptr(self.tptr(bias)),
                long(x.len()),
                int(x.cols.max(1)),
            ],
        );
    }

    fn rms_norm(
        &self,
        x: &mut CudaTensor,
        weight: &CudaTensor,
        eps: f32,
        zero_centred: bool,
        out: Option<&mut CudaTensor>,
    ) {
        let dim = weight.len();
        assert!(dim > 0 && x.cols.is_multiple_of(dim));
        self.dev.bind();
        let src = self.tptr(x);
        let dst = match out {
            None => src,
            Some(o) => {
                self.reshape(o, x.rows, x.cols);
                self.tptr(o)
            }
        };
        let groups = x.len() / dim;
        if groups == 0 {
            return;
        }
        // Whole rows of up to NORM_STAGE values (ops.cu) can also be written as int8 x.
        let copy = (dim == x.cols && dim <= NORM_STAGE)
            .then(|| self.int8_copy_for(dst, groups, dim))
            .flatten();
        let (qc, qs, form) = copy.map_or((0, 0, 0), |q| (q.codes, q.pairs, q.form.word()));
        let args = [
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::Ptr(self.tptr(weight)),
            long(groups),
            int(dim),
            Arg::F32(eps),
            int(zero_centred as usize),
            Arg::Ptr(qc),
            Arg::Ptr(qs),
            Arg::I32(form),
        ];
        // A block per group (NORM_THREADS, NORM_Q_THREADS, NORM_Q_FEW_THREADS in ops.cu); the plain norm takes
        // the first seven arguments.
        let (f, name, threads, n) = match copy {
            Some(_) if groups <= NORM_Q_FEW_ROWS => (
                &self.dev.k.rms_norm_q8_few,
                "rms_norm q8",
                NORM_Q_FEW_THREADS,
                10,
            ),
            Some(_) => (&self.dev.k.rms_norm_q8, "rms_norm q8", NORM_Q_THREADS, 10),
            None => (&self.dev.k.rms_norm, "rms_norm", NORM_THREADS, 7),
        };
        let grid = (groups as u32, 1, 1);
        self.dev
            .launch(f, name, grid, (threads, 1, 1), 0, &args[..n]);
        if let Some(q) = copy {
            self.dev.fresh_x.note(q);
        }
    }

    fn rope(
        &self,
        x: &mut CudaTensor,
        meta: &CudaMeta,
        inv_freq: &CudaTensor,
        head_dim: usize,
        style: RopeStyle,
    ) {
        let t = meta.host.len();
        assert_eq!(x.rows, t);
        let half = inv_freq.len();
        assert!(
            half <= ROPE_MAX_HALF,
            "rotary dimension above 512 is not supported"
        );
        assert!(head_dim > 0 && x.cols.is_multiple_of(head_dim) && 2 * half <= head_dim);
        let pairs = (x.cols / head_dim) * half;
        if t == 0 || pairs == 0 {
            return;
        }
        self.dev.bind();
        self.dev.launch(
            &self.dev.k.rope,
            "rope",
            (pairs.div_ceil(128) as u32, t as u32, 1),
            (128, 1, 1),
            0,
            &[
                Arg::Ptr(self.tptr(x)),
                Arg::Ptr(self.meta_ptr(meta)),
                Arg::Ptr(self.tptr(inv_freq)),
                int(t),
                int(x.cols),
                int(head_dim),
                int(half),
                int(match style {
                    RopeStyle::Neox => 0,
                    RopeStyle::Interleaved => 1,
                }),
            ],
        );
    }

    fn weights_ahead(&self, weights: &[&CudaWeight]) {
        if self.dev.l2_ahead > 0 {
            let ranges = weights.iter().map(|w| (self.ptr(&w.buf), w.buf.len()));
            self.dev.ahead.name(ranges);
        }
    }

    fn attention(
        &self,
        q: &CudaTensor,
        kv: &CudaKv,
        layer: usize,
        meta: &CudaMeta,
        shape: AttnShape,
        out: &mut CudaTensor,
    ) {
        self.cuda_attention(q, kv, layer, meta, shape, out)
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) {
        assert_eq!(gate.len(), up.len());
        self.dev.bind();
        self.elementwise(
            &self.dev.k.silu_mul,
            "silu_mul",
            gate.len(),
            &[
                Arg::Ptr(self.tptr(gate)),
                Arg::Ptr(self.tptr(up)),
                long(gate.len()),
            ],
        );
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) {
        assert_eq!(x.len(), y.len());
        self.dev.bind();
        self.elementwise(
            &self.dev.k.add,
            "add",
            x.len(),
            &[
                Arg::Ptr(self.tptr(x)),
                Arg::Ptr(self.tptr(y)),
                long(x.len()),
            ],
        );
    }

    fn scale(&self, x: &mut CudaTensor, s: f32) {
        self.dev.bind();
        self.elementwise(
            &self.dev.k.scale,
            "scale",
            x.len(),
            &[Arg::Ptr(self.tptr(x)), Arg::F32(s), long(x.len())],
        );
    }

    fn grouped_conv(
        &self,
        x: &CudaTensor,
        base: &CudaTensor,
        dynamic: &CudaTensor,
        col: usize,
        group: usize,
        meta: &CudaMeta,
        out: &mut CudaTensor,
    ) {
        assert_eq!(
            x.rows,
            meta.tokens().len(),
            "grouped_conv: one metadata entry per token"
        );
        assert_eq!(base.cols, x.cols);
        assert!(group > 0 && x.cols.is_multiple_of(group));
        assert_eq!(dynamic.rows, x.rows);
        assert!(col + base.rows * (x.cols / group) <= dynamic.cols);
        self.reshape(out, x.rows, x.cols);
        if x.rows == 0 || x.cols == 0 {
            return;
        }
        self.dev.bind();
        self.dev.launch(
            &self.dev.k.grouped_conv,
            "grouped_conv",
            (x.cols.div_ceil(256).min(64) as u32, x.rows as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.tptr(x)),
                Arg::Ptr(self.tptr(base)),
                Arg::Ptr(self.tptr(dynamic)),
                Arg::Ptr(self.meta_ptr(meta)),
                int(x.rows),
                int(x.cols),
                int(base.rows),
                int(group),
                int(dynamic.cols),
                int(col),
                Arg::Ptr(self.tptr(out)),
            ],
        );
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[u32], out: &mut CudaTensor) {
        self.reshape(out, rows.len(), x.cols);
        self.gather_rows_at(x, rows, out, 0);
    }

    fn gather_rows_at(&self, x: &CudaTensor, rows: &[u32], out: &mut CudaTensor, at: usize) {
        for &r in rows {
            assert!((r as usize) < x.rows, "gather_rows: row {r} of {}", x.rows);
        }
        assert_eq!(out.cols, x.cols, "gather_rows_at: columns differ");
        assert!(
            at + rows.len() <= out.rows,
            "gather_rows_at: rows past the end of out"
        );
        if rows.is_empty() || x.cols == 0 {
            return;
        }
        self.dev.bind();
        let (src, dst) = (self.tptr(x), self.tptr(out) + (4 * at * x.cols) as u64);
        self.with_indices(rows, |p| {
            self.dev.launch(
                &self.dev.k.gather_rows,
                "gather_rows",
                (x.cols.div_ceil(256).min(64) as u32, rows.len() as u32, 1),
                (256, 1, 1),
                0,
                &[
                    Arg::Ptr(src),
                    Arg::Ptr(p),
                    int(rows.len()),
                    int(x.cols),
                    Arg::Ptr(dst),
                ],
            )
        });
    }

    fn copy_columns(&self, src: &CudaTensor, dst: &mut CudaTensor, col: usize) {
        assert_eq!(src.rows, dst.rows);
        assert!(col + src.cols <= dst.cols);
        if src.rows == 0 || src.cols == 0 {
            return;
        }
        self.dev.bind();
        self.dev.launch(
            &self.dev.k.copy_columns,
            "copy_columns",
            (src.cols.div_ceil(256).min(64) as u32, src.rows as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.tptr(src)),
                int(src.rows),
                int(src.cols),
                Arg::Ptr(self.tptr(dst)),
                int(dst.cols),
                int(col),
            ],
        );
    }

    fn step_new(&self) -> CudaStep {
        CudaStep {
            meta: CudaMeta {
                host: Vec::new(),
                buf: None,
                pool: self.dev.meta_pool.clone(),
            },
            pinned: None,
            copied: None,
            tokens: 0,
            sel: 0,
            cap: 0,
        }
    }

    fn step_upload(&self, step: &mut CudaStep, meta: &[TokenMeta], ids: &[u32], sel: &[u32]) {
        assert_eq!(meta.len(), ids.len(), "one id per token");
        self.dev.bind();
        let need = 5 * meta.len() + sel.len();
        if need > step.cap {
            let cap = need.next_power_of_two().max(64);
            step.meta.buf = Some(self.dev.uninit::<u32>(cap));
            // SAFETY: written before every copy out of it (below).
            step.pinned = Some(ck(
                unsafe { self.dev.ctx.alloc_pinned::<u32>(cap) },
                "pinned allocation",
            ));
            step.copied = None;
            step.cap = cap;
            self.dev.moved();
        }
        if let Some(e) = &step.copied {
            // The previous step's copy must have left the staging buffer.
            ck(e.synchronize(), "event wait");
        }
        let pinned = step.pinned.as_mut().expect("allocated above");
        let host = ck(pinned.as_mut_slice(), "pinned buffer");
        for (i, m) in meta.iter().enumerate() {
            host[4 * i..4 * i + 4].copy_from_slice(&[m.row, m.pos, m.kv_start, m.kv_end]);
        }
        let t = meta.len();
        host[4 * t..5 * t].copy_from_slice(ids);
        host[5 * t..need].copy_from_slice(sel);
        let dst = self.ptr(step.meta.buf.as_ref().expect("allocated above"));
        self.dev.fresh_x.forget();
        // SAFETY: the device buffer holds `cap >= need` values; the staging buffer is pinned
        // and not written again before `copied` completes.
        ck(
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dst,
                    &host[..need],
                    self.dev.stream.cu_stream(),
                )
            },
            "step input copy",
        );
        let ev = step
            .copied
            .get_or_insert_with(|| ck(self.dev.ctx.new_event(None), "event creation"));
        ck(ev.record(&self.dev.stream), "event record");
        step.meta.host.clear();
        step.meta.host.extend_from_slice(meta);
        step.tokens = t;
        step.sel = sel.len();
    }

    fn step_meta<'a>(&self, step: &'a CudaStep) -> &'a CudaMeta {
        &step.meta
    }

    fn embed_step(&self, table: &CudaWeight, step: &CudaStep, out: &mut CudaTensor) {
        let t = step.tokens;
        self.reshape(out, t, table.cols);
        if t == 0 || table.cols == 0 {
            return;
        }
        self.dev.bind();
        let base = self.meta_ptr(&step.meta);
        let ids = base + 4 * step.ids_offset() as u64;
        self.dequant(table, Some(ids), 0, t, self.tptr(out));
    }

    fn gather_step(&self, x: &CudaTensor, step: &CudaStep, out: &mut CudaTensor) {
        let n = step.sel;
        self.reshape(out, n, x.cols);
        if n == 0 || x.cols == 0 {
            return;
        }
        self.dev.bind();
        let sel = self.meta_ptr(&step.meta) + 4 * step.sel_offset() as u64;
        self.dev.launch(
            &self.dev.k.gather_rows,
            "gather_rows",
            (x.cols.div_ceil(256).min(64) as u32, n as u32, 1),
            (256, 1, 1),
            0,
            &[
                Arg::Ptr(self.tptr(x)),
                Arg::Ptr(sel),
                int(n),
                int(x.cols),
                Arg::Ptr(self.tptr(out)),
            ],
        );
    }

    fn matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaTensor,
        scratch: &mut CudaTensor,
    ) {
        let prod = self.add_product(x, w, out);
        if x.rows > 16 && matches!(self.dev.prefill_gemm, PrefillGemm::Cublas { .. }) {
            self.matmul(x, w, scratch);
            return self.add(out, scratch);
        }
        self.mm_launch(x, &[prod], Epilogue::Add);
    }

    fn matmul_swiglu(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        out: &mut CudaTensor,
        scratch: &mut CudaTensor,
    ) {
        let fusable = gate.kernels() == up.kernels() && gate.rows == up.rows;
        if !fusable || (x.rows > 16 && matches!(self.dev.prefill_gemm, PrefillGemm::Cublas { .. }))
        {
            self.matmul_many(x, &[gate, up], &mut [&mut *out, &mut *scratch]);
            return self.silu_mul(out, scratch);
        }
        let prod = self.swiglu_product(x, gate, up, out);
        self.mm_launch(x, &[prod], Epilogue::Swiglu);
    }

    /// Prompt rows on the tensor-core kernels (when that path is on), the other rows as
    /// `matmul_many`; one launch per run of rows for products that share a format.
    fn step_matmul_many(
        &self,
        x: &CudaTensor,
        ws: &[&CudaWeight],
        outs: &mut [&mut CudaTensor],
        spans: &[RowSpan],
    ) {
        let runs = self.row_runs(x.rows, spans);
        if !runs.iter().any(|(_, tensor)| *tensor) {
            return self.matmul_many(x, ws, outs);
        }
        assert_eq!(ws.len(), outs.len());
        let prods = self.store_products(x, ws, outs);
        if ws.len() <= MM_SEGS && ws.iter().all(|w| w.kernels() == ws[0].kernels()) {
            self.mm_runs(x, &prods, Epilogue::Store, &runs);
        } else {
            for p in prods.chunks(1) {
                self.mm_runs(x, p, Epilogue::Store, &runs);
            }
        }
    }

    fn step_matmul_add(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        out: &mut CudaTensor,
        scratch: &mut CudaTensor,
        spans: &[RowSpan],
    ) {
        let runs = self.row_runs(x.rows, spans);
        if !runs.iter().any(|(_, tensor)| *tensor) {
            return self.matmul_add(x, w, out, scratch);
        }
        let prod = self.add_product(x, w, out);
        self.mm_runs(x, &[prod], Epilogue::Add, &runs);
    }

    fn step_matmul_swiglu(
        &self,
        x: &CudaTensor,
        gate: &CudaWeight,
        up: &CudaWeight,
        out: &mut CudaTensor,
        scratch: &mut CudaTensor,
        spans: &[RowSpan],
    ) {
        let runs = self.row_runs(x.rows, spans);
        if !runs.iter().any(|(_, tensor)| *tensor) {
            return self.matmul_swiglu(x, gate, up, out, scratch);
        }
        if gate.kernels() != up.kernels() || gate.rows != up.rows {
            self.step_matmul_many(x, &[gate, up], &mut [&mut *out, &mut *scratch], spans);
            return self.silu_mul(out, scratch);
        }
        let prod = self.swiglu_product(x, gate, up, out);
        self.mm_runs(x, &[prod], Epilogue::Swiglu, &runs);
    }

    fn rope_kv_write(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        rope: Rope<'_, CudaTensor>,
    ) {
        self.rope_kv_launch(Some(q), k, v, kv, layer, meta, None, rope);
    }

    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_write(
        &self,
        q: &mut CudaTensor,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        norm: QkNorm<'_, CudaTensor>,
        rope: Rope<'_, CudaTensor>,
    ) {
        if Self::qk_norm_fusable(norm.into(), &rope) {
            self.rope_kv_launch(Some(q), k, v, kv, layer, meta, Some(norm.into()), rope);
        } else {
            qk_norm_then_rope_kv(self, q, k, v, kv, layer, meta, norm, rope);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn k_norm_rope_kv_write(
        &self,
        k: &mut CudaTensor,
        v: &CudaTensor,
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        (k_norm, eps): (&CudaTensor, f32),
        rope: Rope<'_, CudaTensor>,
    ) {
        let norm = HeadNorms {
            q: None,
            k: k_norm,
            eps,
        };
        if Self::qk_norm_fusable(norm, &rope) {
            self.rope_kv_launch(None, k, v, kv, layer, meta, Some(norm), rope);
        } else {
            k_norm_then_rope_kv(self, k, v, kv, layer, meta, (k_norm, eps), rope);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step_qkv_rope_kv(
        &self,
        x: &CudaTensor,
        ws: [&CudaWeight; 3],
        outs: [&mut CudaTensor; 3],
        kv: &mut CudaKv,
        layer: usize,
        meta: &CudaMeta,
        rope: Rope<'_, CudaTensor>,
        spans: &[RowSpan],
    ) {
        if self.qkv_rope_fusable(x, ws, kv, meta, &rope, spans) {
            return self.qkv_rope_fused(x, ws, outs, kv, layer, meta, rope);
        }
        qkv_then_rope_kv(self, x, ws, outs, kv, layer, meta, rope, spans)
    }

    fn graph_owner(&self) -> u64 {
        self.owners.fetch_add(1, Ordering::Relaxed)
    }

    fn graph(&self, key: GraphKey, f: &mut dyn FnMut()) {
        if !self.graphs_enabled() {
            return f();
        }
        self.dev.bind();
        let mut g = self.graphs.lock().expect("graph lock");
        g.run(&self.dev, key, f);
    }

    fn argmax_rows(&self, x: &CudaTensor) -> Vec<u32> {
        super::sample::argmax_rows(&self.dev, x)
    }

    fn sample_rows(&self, logits: &CudaTensor, rows: &[SampleRow<'_>]) -> Option<Vec<u32>> {
        Some(super::sample::sample_rows(&self.dev, logits, rows))
    }

    fn draft_rows(
        &self,
        logits: &CudaTensor,
        slots: usize,
        rows: &[DraftRow<'_>],
    ) -> Option<Vec<u32>> {
        Some(super::sample::draft_rows(&self.dev, logits, slots, rows))
    }

    fn top_k_rows(&self, x: &CudaTensor, k: usize) -> Option<(Vec<u32>, Vec<f32>)> {
        Some(super::sample::top_k_rows(&self.dev, x, k))
    }

    fn verify_rows(
        &self,
        target: &CudaTensor,
        draft: &CudaTensor,
        block: usize,
        rows: &[VerifyRow<'_>],
    ) -> Option<Vec<Verdict>> {
        Some(super::sample::verify_rows(
            &self.dev, target, draft, block, rows,
        ))
    }
}

/// The kernels' code for a rotary style (`style` in ops.cu and matmul.cu).
pub(super) fn rope_style_code(style: RopeStyle) -> i32 {
    match style {
        RopeStyle::Neox => 0,
        RopeStyle::Interleaved => 1,
    }
}
