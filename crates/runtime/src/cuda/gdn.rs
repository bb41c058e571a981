//! Gated DeltaNet ops on the GPU (`kernels/gdn.cu`) and the per-row recurrent state.
//!
//! A row's state is one device buffer holding, per layer, two conv windows and two recurrent
//! states (the checkpoint before the row's last step and the state after it, roles swapped
//! at every step, as on the CPU: see `cpu::gdn`) and the history of the step's first
//! `history` tokens (pre-conv qkv, post-conv qkv, g, β), from which a rollback replays the
//! recurrence with the step's own kernels. Ops describe each row's share of a step to the
//! kernels through a small array of `GdnSpan` records (row addresses + token range).
//!
//! The gated delta rule runs token by token for decode and verify spans: its summation orders
//! are fixed per (row, head, column), so a block equals the same tokens one at a time, bit for
//! bit. Spans marked [`RowSpan::chunked`] (prefill) run the chunked form instead, with the CPU
//! chunked form's formula and summation orders (`cpu::ops::gdn::delta_chunked`), so both
//! backends round alike up to exp; a rollback replays token by token as after any step.

use std::sync::OnceLock;

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaFunction, CudaSlice};

use super::backend::CudaBackend;
use super::compile::{self, Module};
use super::device::{ensure, int, long, Arg, Device};
use super::tensor::CudaTensor;
use crate::backend::{Backend, GdnShape, RowSpan};
use crate::cpu::ops::gdn::CHUNK;
use crate::error::RuntimeError;

/// Largest conv kernel width (GDN_MAX_K in gdn.cu).
pub(super) const MAX_CONV_K: usize = 8;
/// k_dim values the delta kernel is instantiated for.
const DELTA_DK: [usize; 5] = [16, 32, 64, 128, 256];
/// k_dim values the chunked kernel is instantiated for (its shared memory grows with k_dim,
/// 154 KiB at 128); chunked spans of wider heads run token by token.
const CHUNK_DK: [usize; 4] = [16, 32, 64, 128];
/// State columns per block of the chunked kernel (GDN_CT in gdn.cu).
pub(super) const CHUNK_COLS: usize = 32;
/// Threads per block of the chunked kernel (GDN_CTHREADS in gdn.cu).
pub(super) const CHUNK_THREADS: u32 = 256;
/// Words of one `GdnSpan` record.
const SPAN_WORDS: usize = 9;

/// Dynamic shared memory of the chunked kernel for `dk` (its layout in gdn.cu): q and k
/// (`CHUNK x (dk + 1)` each), W (`CHUNK x dk`), two `CHUNK x CHUNK` matrices, v
/// (`CHUNK x CHUNK_COLS`), the state's columns (`dk x CHUNK_COLS`) and four gate vectors.
fn chunk_smem_bytes(dk: usize) -> usize {
    let floats = 2 * CHUNK * (dk + 1)
        + CHUNK * dk
        + 2 * CHUNK * CHUNK
        + CHUNK * CHUNK_COLS
        + dk * CHUNK_COLS
        + 4 * CHUNK;
    4 * floats
}

/// `GdnChunkParams` in gdn.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct GdnChunkParams {
    spans: u64,
    k_heads: i32,
    v_heads: i32,
    dv: i32,
    tiled: i32,
}

/// The kernels of gdn.cu.
pub(crate) struct GdnKernels {
    conv: CudaFunction,
    delta: Vec<CudaFunction>,
    /// By [`CHUNK_DK`]; `None` where the device cannot give the kernel its shared memory.
    chunk: Vec<Option<CudaFunction>>,
    gates: CudaFunction,
    norm_gated: CudaFunction,
    sigmoid_mul: CudaFunction,
    copy: CudaFunction,
}

/// Compiled and loaded on first use (models without GDN layers never build them).
static KERNELS: OnceLock<Result<GdnKernels, String>> = OnceLock::new();

fn kernels(dev: &Device) -> &'static GdnKernels {
    KERNELS
        .get_or_init(|| {
            let image = compile::load_or_compile(Module::Gdn, dev.target)?;
            let module = super::device::load_image(&dev.ctx, Module::Gdn, image, dev.target)?;
            let get = |n: &str| {
                module
                    .load_function(n)
                    .map_err(|e| format!("kernel {n} missing from gdn.cu: {e}"))
            };
            let optin = dev
                .ctx
                .attribute(
                    cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                )
                .map_err(|e| format!("reading the shared memory limit: {e}"))?;
            let chunk = |dk: usize| -> Result<Option<CudaFunction>, String> {
                let bytes = chunk_smem_bytes(dk);
                if bytes > optin.max(0) as usize {
                    return Ok(None);
                }
                let f = get(&format!("gdn_chunk_{dk}"))?;
                f.set_attribute(
                    cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
                .map_err(|e| format!("gdn_chunk_{dk}: shared memory of {bytes} bytes: {e}"))?;
                Ok(Some(f))
            };
            Ok(GdnKernels {
                conv: get("gdn_conv_f32")?,
                delta: DELTA_DK
                    .iter()
                    .map(|dk| get(&format!("gdn_delta_{dk}")))
                    .collect::<Result<_, _>>()?,
                chunk: CHUNK_DK
                    .iter()
                    .map(|&dk| chunk(dk))
                    .collect::<Result<_, _>>()?,
                gates: get("gdn_gates_f32")?,
                norm_gated: get("gdn_rms_norm_gated_f32")?,
                sigmoid_mul: get("gdn_sigmoid_mul_f32")?,
                copy: get("gdn_copy_f32")?,
            })
        })
        .as_ref()
        .unwrap_or_else(|e| panic!("CUDA GDN kernels: {e}"))
}

/// Offsets (in floats) of one layer's parts inside a row's buffer.
#[derive(Clone, Copy, Debug)]
struct Layout {
    win: usize,
    state: usize,
    hist_rows: usize,
    conv_dim: usize,
    v_heads: usize,
}

impl Layout {
    fn new(shape: &GdnShape, history: usize) -> Self {
        Self {
            win: (shape.conv_kernel - 1) * shape.conv_dim(),
            state: shape.state_len(),
            hist_rows: history,
            conv_dim: shape.conv_dim(),
            v_heads: shape.v_heads,
        }
    }
    fn conv(&self, which: usize) -> usize {
        which * self.win
    }
    fn state(&self, which: usize) -> usize {
        2 * self.win + which * self.state
    }
    fn hist_x(&self) -> usize {
        2 * self.win + 2 * self.state
    }
    fn hist_qkv(&self) -> usize {
        self.hist_x() + self.hist_rows * self.conv_dim
    }
    fn hist_g(&self) -> usize {
        self.hist_qkv() + self.hist_rows * self.conv_dim
    }
    fn hist_beta(&self) -> usize {
        self.hist_g() + self.hist_rows * self.v_heads
    }
    fn layer_len(&self) -> usize {
        self.hist_beta() + self.hist_rows * self.v_heads
    }
}

struct GpuRow {
    buf: CudaSlice<f32>,
    cur: usize,
    /// Tokens of the last step still applied.
    last: usize,
    /// Tokens of the last step whose inputs were recorded.
    recorded: usize,
}

/// The GDN state of all rows on the GPU.
pub struct CudaGdn {
    shape: GdnShape,
    layers: usize,
    history: usize,
    layout: Layout,
    rows: Vec<Option<GpuRow>>,
    /// Span records and copy lists handed to the kernels.
    desc: Option<CudaSlice<i64>>,
}

impl CudaGdn {
    fn row(&self, row: usize) -> &GpuRow {
        self.rows
            .get(row)
            .and_then(Option::as_ref)
            .unwrap_or_else(|| panic!("GDN row {row} is not open"))
    }
}

fn ptr_arg(p: u64) -> Arg {
    Arg::Ptr(p)
}

impl CudaBackend {
    fn gdn_base(&self, st: &CudaGdn, row: usize, layer: usize) -> u64 {
        self.device().ptr(&st.row(row).buf) + 4 * (layer * st.layout.layer_len()) as u64
    }

    /// Uploads `words` to the descriptor buffer; returns its address.
    fn gdn_desc(&self, st: &mut CudaGdn, words: &[i64]) -> u64 {
        let dev = self.device();
        let p = ensure(&dev.stream, &dev.epoch, &mut st.desc, words.len());
        dev.htod(words, p);
        p
    }

    /// Copies `(src, dst, floats)` triples in one launch.
    fn gdn_copies(&self, st: &mut CudaGdn, copies: &[(u64, u64, usize)]) {
        let copies: Vec<(u64, u64, usize)> = copies.iter().copied().filter(|c| c.2 > 0).collect();
        if copies.is_empty() {
            return;
        }
        let words: Vec<i64> = copies
            .iter()
            .flat_map(|&(s, d, n)| [s as i64, d as i64, n as i64])
            .collect();
        let most = copies.iter().map(|c| c.2).max().unwrap_or(1);
        let d = self.gdn_desc(st, &words);
        let dev = self.device();
        dev.launch(
            &kernels(dev).copy,
            "gdn copy",
            (most.div_ceil(256).min(1024) as u32, copies.len() as u32, 1),
            (256, 1, 1),
            0,
            &[ptr_arg(d)],
        );
    }

    /// Launches the conv kernel over span records (9 words each).
    fn gdn_conv_launch(&self, st: &mut CudaGdn, records: &[i64], weight: u64) {
        let n = records.len() / SPAN_WORDS;
        if n == 0 {
            return;
        }
        let d = self.gdn_desc(st, records);
        let dev = self.device();
        let c = st.shape.conv_dim();
        dev.launch(
            &kernels(dev).conv,
            "gdn conv",
            (c.div_ceil(128) as u32, n as u32, 1),
            (128, 1, 1),
            0,
            &[
                ptr_arg(d),
                ptr_arg(weight),
                int(c),
                int(st.shape.conv_kernel),
            ],
        );
    }

    /// Launches the token-by-token delta kernel over span records (9 words each).
    fn gdn_delta_launch(&self, st: &mut CudaGdn, records: &[i64]) {
        let n = records.len() / SPAN_WORDS;
        if n == 0 {
            return;
        }
        let d = self.gdn_desc(st, records);
        self.gdn_delta_launch_at(st, d, n);
    }

    /// Launches the token-by-token delta kernel over `n` uploaded span records at `d`.
    fn gdn_delta_launch_at(&self, st: &CudaGdn, d: u64, n: usize) {
        if n == 0 {
            return;
        }
        let s = st.shape;
        let ki = DELTA_DK
            .iter()
            .position(|&d| d == s.k_dim)
            .expect("k_dim checked at gdn_new");
        let dev = self.device();
        let threads = s.v_dim.max(32).next_multiple_of(32);
        dev.launch(
            &kernels(dev).delta[ki],
            "gdn delta",
            (n as u32, s.v_heads as u32, 1),
            (threads as u32, 1, 1),
            0,
            &[
                ptr_arg(d),
                int(s.k_heads),
                int(s.v_heads),
                int(s.v_dim),
                int(s.tiled_heads as usize),
            ],
        );
    }

    /// The chunked-form kernel for this shape, if the device runs it.
    fn gdn_chunk_kernel(&self, st: &CudaGdn) -> Option<&'static CudaFunction> {
        let i = CHUNK_DK.iter().position(|&d| d == st.shape.k_dim)?;
        kernels(self.device()).chunk[i].as_ref()
    }

    /// Launches the chunked-form kernel over `n` uploaded span records at `d`.
    fn gdn_chunk_launch_at(&self, st: &CudaGdn, f: &CudaFunction, d: u64, n: usize) {
        if n == 0 {
            return;
        }
        let s = st.shape;
        let p = GdnChunkParams {
            spans: d,
            k_heads: s.k_heads as i32,
            v_heads: s.v_heads as i32,
            dv: s.v_dim as i32,
            tiled: s.tiled_heads as i32,
        };
        self.device().launch_with_smem(
            f,
            "gdn delta chunked",
            (
                n as u32,
                s.v_heads as u32,
                s.v_dim.div_ceil(CHUNK_COLS) as u32,
            ),
            (CHUNK_THREADS, 1, 1),
            chunk_smem_bytes(s.k_dim) as u32,
            &p,
        );
    }

    pub(crate) fn cuda_gdn_new(&self, layers: usize, shape: GdnShape, history: usize) -> CudaGdn {
        assert!(
            (1..=MAX_CONV_K).contains(&shape.conv_kernel),
            "conv kernel {} is not supported on CUDA (1..={MAX_CONV_K})",
            shape.conv_kernel
        );
        assert!(
            DELTA_DK.contains(&shape.k_dim) && shape.v_dim <= 1024,
            "GDN head dims k {} / v {} are not supported on CUDA (k in {DELTA_DK:?}, v <= 1024)",
            shape.k_dim,
            shape.v_dim
        );
        assert!(shape.k_heads > 0 && shape.v_heads.is_multiple_of(shape.k_heads));
        CudaGdn {
            shape,
            layers,
            history,
            layout: Layout::new(&shape, history),
            rows: Vec::new(),
            desc: None,
        }
    }

    pub(crate) fn cuda_gdn_open_row(&self, st: &mut CudaGdn, row: usize) {
        let dev = self.device();
        dev.bind();
        if st.rows.len() <= row {
            st.rows.resize_with(row + 1, || None);
        }
        st.rows[row] = Some(GpuRow {
            buf: dev.zeros::<f32>(st.layers * st.layout.layer_len()),
            cur: 0,
            last: 0,
            recorded: 0,
        });
    }

    pub(crate) fn cuda_gdn_release_row(&self, st: &mut CudaGdn, row: usize) {
        if let Some(r) = st.rows.get_mut(row) {
            *r = None;
        }
    }

    pub(crate) fn cuda_gdn_copy_row(&self, st: &mut CudaGdn, src: usize, dst: usize) {
        self.cuda_gdn_open_row(st, dst);
        let cur = st.row(src).cur;
        let l = st.layout;
        let mut copies = Vec::new();
        for layer in 0..st.layers {
            let (s, d) = (self.gdn_base(st, src, layer), self.gdn_base(st, dst, layer));
            for which in 0..2 {
                copies.push((
                    s + 4 * l.conv(cur) as u64,
                    d + 4 * l.conv(which) as u64,
                    l.win,
                ));
                copies.push((
                    s + 4 * l.state(cur) as u64,
                    d + 4 * l.state(which) as u64,
                    l.state,
                ));
            }
        }
        self.gdn_copies(st, &copies);
    }

    pub(crate) fn cuda_gdn_begin(&self, st: &mut CudaGdn, spans: &[RowSpan]) {
        let h = st.history;
        for s in spans {
            let r = st.rows[s.row as usize]
                .as_mut()
                .unwrap_or_else(|| panic!("GDN row {} is not open", s.row));
            r.cur ^= 1;
            r.last = s.count as usize;
            r.recorded = r.last.min(h);
        }
    }

    pub(crate) fn cuda_gdn_rollback(
        &self,
        st: &mut CudaGdn,
        row: usize,
        keep: usize,
    ) -> Result<(), RuntimeError> {
        let r = st
            .rows
            .get(row)
            .and_then(Option::as_ref)
            .ok_or_else(|| RuntimeError::State(format!("row {row} is not open")))?;
        if keep > r.last {
            return Err(RuntimeError::State(format!(
                "row {row} cannot keep {keep} tokens of a last step of {}",
                r.last
            )));
        }
        if keep == r.last {
            return Ok(());
        }
        if keep > r.recorded {
            return Err(RuntimeError::State(format!(
                "row {row} can be rolled back only into the first {} tokens of its last step, \
                 not to {keep}",
                r.recorded
            )));
        }
        let (cur, prev) = (r.cur, 1 - r.cur);
        let l = st.layout;
        self.device().bind();
        let mut records = Vec::new();
        let mut delta = Vec::new();
        for layer in 0..st.layers {
            let b = self.gdn_base(st, row, layer);
            let at = |off: usize| (b + 4 * off as u64) as i64;
            // Conv: window over the kept inputs, no outputs.
            records.extend([
                at(l.conv(prev)),
                at(l.conv(cur)),
                0,
                0,
                at(l.hist_x()),
                0,
                0,
                0,
                keep as i64,
            ]);
            // Recurrence replayed over the kept tokens from the checkpoint, no outputs.
            delta.extend([
                0,
                0,
                at(l.state(prev)),
                at(l.state(cur)),
                at(l.hist_qkv()),
                at(l.hist_g()),
                at(l.hist_beta()),
                0,
                keep as i64,
            ]);
        }
        // Every layer in one launch each; the conv kernel only moves the window when it writes
        // no outputs, so it needs no weights.
        self.gdn_conv_launch(st, &records, 0);
        self.gdn_delta_launch(st, &delta);
        let r = st.rows[row].as_mut().expect("checked above");
        r.last = keep;
        Ok(())
    }

    /// Span records for a step: the row addresses of `layer` and the token range.
    #[allow(clippy::too_many_arguments)]
    fn gdn_records(
        &self,
        st: &CudaGdn,
        layer: usize,
        spans: &[RowSpan],
        x: u64,
        x_cols: usize,
        g: u64,
        out: u64,
        out_cols: usize,
        conv: bool,
    ) -> Vec<i64> {
        let l = st.layout;
        let hv = st.shape.v_heads;
        let mut rec = Vec::with_capacity(SPAN_WORDS * spans.len());
        for s in spans {
            let r = st.row(s.row as usize);
            let (cur, prev) = (r.cur, 1 - r.cur);
            let b = self.gdn_base(st, s.row as usize, layer);
            let at = |off: usize| (b + 4 * off as u64) as i64;
            let first = s.first as u64;
            let xs = (x + 4 * first * x_cols as u64) as i64;
            let os = (out + 4 * first * out_cols as u64) as i64;
            if conv {
                rec.extend([
                    at(l.conv(prev)),
                    at(l.conv(cur)),
                    0,
                    0,
                    xs,
                    0,
                    0,
                    os,
                    s.count as i64,
                ]);
            } else {
                let gs = (g + 4 * first * hv as u64) as i64;
                // beta's address is filled in by gated_delta.
                rec.extend([
                    0,
                    0,
                    at(l.state(prev)),
                    at(l.state(cur)),
                    xs,
                    gs,
                    0,
                    os,
                    s.count as i64,
                ]);
            }
        }
        rec
    }

    pub(crate) fn cuda_causal_conv(
        &self,
        st: &mut CudaGdn,
        layer: usize,
        x: &CudaTensor,
        weight: &CudaTensor,
        spans: &[RowSpan],
        out: &mut CudaTensor,
    ) {
        let c = st.shape.conv_dim();
        assert_eq!(x.cols, c);
        assert_eq!((weight.rows, weight.cols), (c, st.shape.conv_kernel));
        let dev = self.device();
        dev.bind();
        self.reshape(out, x.rows, c);
        let (xp, op) = (dev.ptr(&x.buf), dev.ptr(&out.buf));
        let records = self.gdn_records(st, layer, spans, xp, c, 0, op, c, true);
        self.gdn_conv_launch(st, &records, dev.ptr(&weight.buf));
        // Record the step's first tokens' inputs for rollbacks.
        let l = st.layout;
        let copies: Vec<(u64, u64, usize)> = spans
            .iter()
            .map(|s| {
                let n = (s.count as usize).min(st.history);
                let b = self.gdn_base(st, s.row as usize, layer);
                (
                    xp + 4 * (s.first as u64) * c as u64,
                    b + 4 * l.hist_x() as u64,
                    n * c,
                )
            })
            .collect();
        self.gdn_copies(st, &copies);
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn cuda_gated_delta(
        &self,
        st: &mut CudaGdn,
        layer: usize,
        qkv: &CudaTensor,
        g: &CudaTensor,
        beta: &CudaTensor,
        spans: &[RowSpan],
        out: &mut CudaTensor,
    ) {
        let s = st.shape;
        let (c, hv, vd) = (s.conv_dim(), s.v_heads, s.value_dim());
        assert_eq!(qkv.cols, c);
        assert_eq!((g.cols, beta.cols), (hv, hv));
        let dev = self.device();
        dev.bind();
        self.reshape(out, qkv.rows, vd);
        let (qp, gp, bp, op) = (
            dev.ptr(&qkv.buf),
            dev.ptr(&g.buf),
            dev.ptr(&beta.buf),
            dev.ptr(&out.buf),
        );
        let mut records = self.gdn_records(st, layer, spans, qp, c, gp, op, vd, false);
        for (rec, sp) in records.chunks_exact_mut(SPAN_WORDS).zip(spans) {
            rec[6] = (bp + 4 * sp.first as u64 * hv as u64) as i64;
        }
        // Token-by-token records first, then the chunked ones (when this shape has the kernel).
        let chunk_kernel = self.gdn_chunk_kernel(st);
        let is_chunked = |sp: &RowSpan| sp.chunked && chunk_kernel.is_some();
        let mut ordered = Vec::with_capacity(records.len());
        for pass in [false, true] {
            for (rec, sp) in records.chunks_exact(SPAN_WORDS).zip(spans) {
                if is_chunked(sp) == pass {
                    ordered.extend_from_slice(rec);
                }
            }
        }
        let n_chunked = spans.iter().filter(|sp| is_chunked(sp)).count();
        let n_steps = spans.len() - n_chunked;
        let l = st.layout;
        let mut copies = Vec::new();
        for sp in spans {
            let n = (sp.count as usize).min(st.history);
            let b = self.gdn_base(st, sp.row as usize, layer);
            let f = sp.first as u64;
            copies.push((qp + 4 * f * c as u64, b + 4 * l.hist_qkv() as u64, n * c));
            copies.push((gp + 4 * f * hv as u64, b + 4 * l.hist_g() as u64, n * hv));
            copies.push((bp + 4 * f * hv as u64, b + 4 * l.hist_beta() as u64, n * hv));
        }
        if !spans.is_empty() {
            let d = self.gdn_desc(st, &ordered);
            self.gdn_delta_launch_at(st, d, n_steps);
            if let Some(f) = chunk_kernel {
                let at = d + (8 * SPAN_WORDS * n_steps) as u64;
                self.gdn_chunk_launch_at(st, f, at, n_chunked);
            }
        }
        self.gdn_copies(st, &copies);
    }

    pub(crate) fn cuda_gdn_gates(
        &self,
        a: &mut CudaTensor,
        b: &mut CudaTensor,
        a_neg: &CudaTensor,
        dt_bias: &CudaTensor,
    ) {
        let hv = a_neg.cols;
        assert_eq!((a.cols, b.cols, dt_bias.cols), (hv, hv, hv));
        assert_eq!(a.rows, b.rows);
        let n = a.rows * hv;
        if n == 0 {
            return;
        }
        let dev = self.device();
        dev.bind();
        dev.launch(
            &kernels(dev).gates,
            "gdn gates",
            (n.div_ceil(256).min(4096) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                ptr_arg(dev.ptr(&a.buf)),
                ptr_arg(dev.ptr(&b.buf)),
                ptr_arg(dev.ptr(&a_neg.buf)),
                ptr_arg(dev.ptr(&dt_bias.buf)),
                long(n),
                int(hv),
            ],
        );
    }

    pub(crate) fn cuda_rms_norm_gated(
        &self,
        x: &mut CudaTensor,
        z: &CudaTensor,
        weight: &CudaTensor,
        eps: f32,
    ) {
        assert_eq!((x.rows, x.cols), (z.rows, z.cols));
        let dim = weight.cols;
        assert!(dim > 0 && x.cols.is_multiple_of(dim));
        let groups = x.rows * x.cols / dim;
        if groups == 0 {
            return;
        }
        let dev = self.device();
        dev.bind();
        dev.launch(
            &kernels(dev).norm_gated,
            "gdn gated rms norm",
            ((groups * 32).div_ceil(256) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                ptr_arg(dev.ptr(&x.buf)),
                ptr_arg(dev.ptr(&z.buf)),
                ptr_arg(dev.ptr(&weight.buf)),
                long(groups),
                int(dim),
                Arg::F32(eps),
            ],
        );
    }

    pub(crate) fn cuda_sigmoid_mul(&self, x: &mut CudaTensor, gate: &CudaTensor) {
        let n = x.rows * x.cols;
        assert_eq!(n, gate.rows * gate.cols);
        if n == 0 {
            return;
        }
        let dev = self.device();
        dev.bind();
        dev.launch(
            &kernels(dev).sigmoid_mul,
            "sigmoid mul",
            (n.div_ceil(256).min(4096) as u32, 1, 1),
            (256, 1, 1),
            0,
            &[
                ptr_arg(dev.ptr(&x.buf)),
                ptr_arg(dev.ptr(&gate.buf)),
                long(n),
            ],
        );
    }
}
