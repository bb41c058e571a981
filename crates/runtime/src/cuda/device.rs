//! The CUDA device: context, the one stream, the loaded kernels, launches and copies.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::sys as cu;
use cudarc::driver::{result as drv, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr};

use super::attention::{
    att_wide_max_rows, fuse_merge_min_rows, ATT_WIDE_MAX_ROWS, FUSE_MERGE_MIN_ROWS,
};
use super::compile::{self, Image, Module, Target};
use super::int8::{int8_format, int8_mma_min_rows, int8_mma_width, Int8Policy};
use super::int8_x::FreshX;
use super::l2_ahead::{l2_ahead_setting, PendingAhead, L2A_AUTO_SHARE};
use super::profile::{skip_list, ProfileKeys, Profiler};
use crate::dtype::DType;
use crate::error::RuntimeError;
use crate::kv_type::KvType;
use crate::quant::GROUP;

/// How large products (prefill) are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillGemm {
    /// The same kernel as decode, over blocks of 16 rows of x: every row's result is
    /// bit-identical to what it gets alone (M = 1), for any M.
    Kernel,
    /// The default: rows the model marks as prompt tokens (`Backend::step_matmul_*` with
    /// `RowSpan::prompt`) run on tensor cores (TF32 MMA, f32 accumulation; matmul_tc.cu),
    /// every other row as `Kernel`. A prompt row's result depends on that row alone, so it is
    /// the same for any M and any cut of the prompt; it differs from the decode kernel's by
    /// TF32 rounding. Needs compute capability 8.0 or later; below that it acts as `Kernel`.
    Tensor,
    /// For `M >= min_rows` (and M > 16): dequantize the weight to f32 and call cuBLAS SGEMM
    /// (pedantic math: no TF32). Faster prefill, but a row's result then depends on M, so the
    /// prompt's KV is no longer bit-identical to a token-by-token run. Needs libcublas.
    Cublas { min_rows: usize },
}

/// Options of the CUDA backend.
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: usize,
    pub prefill_gemm: PrefillGemm,
    pub int8: Int8Policy,
    /// Fewest tokens of an attention launch whose split kernel merges its own splits
    /// (`Device::fuse_merge_min_rows`; `usize::MAX`: never).
    pub fuse_merge_min_rows: usize,
    /// Most tokens of an attention launch whose split blocks have a warp per slot
    /// (`Device::att_wide_max_rows`; 0: never).
    pub att_wide_max_rows: usize,
    /// Column tiles per block of the int8 tensor-core kernels, one of `QT_WIDTHS`; `None`
    /// (the default): by product (`CudaBackend::qt_width`). The bits are the same whatever the
    /// width.
    pub int8_mma_width: Option<usize>,
    /// Int8 SwiGLU products of at most four rows of x, whose outputs make at most one
    /// 32-value block per SM, write the int8 copy of their output for the down projection
    /// (`mmqs_*`, matmul.cu) instead of leaving it to the quantizer, unless
    /// `DFLASH_CUDA_SWIGLU_Q8=0`; the bits are the same either way.
    pub swiglu_q8: bool,
    /// How the KV cache holds keys and values (`DFLASH_KV_CACHE`; default [`CUDA_KV_TYPE`]).
    pub kv_type: KvType,
}

/// The CUDA backend's default KV cache type.
pub const CUDA_KV_TYPE: KvType = KvType::F32;

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            prefill_gemm: PrefillGemm::Tensor,
            int8: Int8Policy::All,
            fuse_merge_min_rows: FUSE_MERGE_MIN_ROWS,
            att_wide_max_rows: ATT_WIDE_MAX_ROWS,
            int8_mma_width: None,
            swiglu_q8: true,
            kv_type: CUDA_KV_TYPE,
        }
    }
}

impl CudaOptions {
    /// Defaults, overridden by `DFLASH_CUDA_DEVICE` (ordinal), `DFLASH_CUDA_GEMM` (`tensor`,
    /// the default; `kernel`; or `cublas` / `cublas:<min_rows>` for the cuBLAS prefill path)
    /// `DFLASH_CUDA_INT8` ([`Int8Policy`]), `DFLASH_CUDA_FUSE_MERGE` (when the split
    /// attention merges by itself: `auto`, `0` or the fewest tokens; cuda/attention.rs),
    /// `DFLASH_CUDA_ATT_WIDE` (the most tokens of an attention launch with a warp per slot:
    /// `auto`, `0` or a count; cuda/attention.rs) and
    /// `DFLASH_CUDA_INT8_MMA_WIDTH` (`auto`, or the column tiles per block of the int8
    /// tensor-core kernels: 4, 2 or 1), `DFLASH_CUDA_SWIGLU_Q8` (`0` or `1`) and
    /// `DFLASH_KV_CACHE` (`f16` or `f32`).
    pub fn from_env() -> Result<Self, RuntimeError> {
        let mut o = Self {
            kv_type: KvType::from_env_or(CUDA_KV_TYPE)?,
            fuse_merge_min_rows: fuse_merge_min_rows(
                std::env::var("DFLASH_CUDA_FUSE_MERGE").ok().as_deref(),
            )
            .map_err(RuntimeError::Device)?,
            att_wide_max_rows: att_wide_max_rows(
                std::env::var("DFLASH_CUDA_ATT_WIDE").ok().as_deref(),
            )
            .map_err(RuntimeError::Device)?,
            swiglu_q8: switch_on("DFLASH_CUDA_SWIGLU_Q8").map_err(RuntimeError::Device)?,
            ..Self::default()
        };
        if let Ok(v) = std::env::var("DFLASH_CUDA_INT8") {
            o.int8 = v.parse().map_err(RuntimeError::Device)?;
        }
        if let Ok(v) = std::env::var("DFLASH_CUDA_INT8_MMA_WIDTH") {
            o.int8_mma_width = int8_mma_width(&v).map_err(RuntimeError::Device)?;
        }
        if let Ok(v) = std::env::var("DFLASH_CUDA_DEVICE") {
            o.device = v.trim().parse().map_err(|_| {
                RuntimeError::Device(format!("DFLASH_CUDA_DEVICE={v:?} is not a device number"))
            })?;
        }
        if let Ok(v) = std::env::var("DFLASH_CUDA_GEMM") {
            let v = v.trim();
            o.prefill_gemm = match v.split_once(':') {
                _ if v.is_empty() || v == "tensor" => PrefillGemm::Tensor,
                None if v == "kernel" => PrefillGemm::Kernel,
                None if v == "cublas" => PrefillGemm::Cublas { min_rows: 64 },
                Some(("cublas", n)) => PrefillGemm::Cublas {
                    min_rows: n.parse().map_err(|_| {
                        RuntimeError::Device(format!("DFLASH_CUDA_GEMM={v:?}: bad row count"))
                    })?,
                },
                _ => {
                    return Err(RuntimeError::Device(format!(
                        "DFLASH_CUDA_GEMM={v:?}: expected `tensor`, `kernel`, `cublas` or \
                         `cublas:<rows>`"
                    )))
                }
            };
        }
        Ok(o)
    }
}

/// A matmul tile: MT rows of x per block; R weight rows per warp for the store/add epilogues
/// and R_SWIGLU (gate + up pairs) for SwiGLU. Must match MM_KERNELS in kernels/matmul.cu.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MmTile {
    pub mt: usize,
    pub r: usize,
    pub r_swiglu: usize,
}

pub(crate) const MM_TILES: [MmTile; 5] = [
    MmTile {
        mt: 1,
        r: 1,
        r_swiglu: 1,
    },
    MmTile {
        mt: 2,
        r: 1,
        r_swiglu: 1,
    },
    MmTile {
        mt: 4,
        r: 2,
        r_swiglu: 1,
    },
    MmTile {
        mt: 8,
        r: 4,
        r_swiglu: 2,
    },
    MmTile {
        mt: 16,
        r: 4,
        r_swiglu: 2,
    },
];
/// Rows of x and weight rows per block of the tensor-core kernels (TC_BM, TC_BN in
/// matmul_tc.cu), and threads per block (TC_THREADS).
pub(crate) const TC_BM: usize = 64;
pub(crate) const TC_BN: usize = 32;
pub(crate) const TC_THREADS: u32 = 128;
/// Warps per block, tiles of 16 weight rows per warp and rows of x per block of the
/// f32-activation TF32 tensor-core kernels (X2_WARPS, X2_NT, X2_BM in matmul_x2.cu).
pub(crate) const X2_WARPS: usize = 4;
pub(crate) const X2_NT: usize = 2;
pub(crate) const X2_BM: usize = 16;
/// The longest row the RMS norm holds in shared memory (NORM_STAGE in ops.cu): only such
/// rows can be written as int8 x by the norm too.
pub(crate) const NORM_STAGE: usize = 4096;
/// Threads per block of the RMS norm (NORM_THREADS in ops.cu) and of the norms that also
/// quantize their rows: for prompt rows (NORM_Q_THREADS) and for at most `NORM_Q_FEW_ROWS`
/// rows, a decode or verify step (NORM_Q_FEW_THREADS).
pub(crate) const NORM_THREADS: u32 = 128;
pub(crate) const NORM_Q_THREADS: u32 = 256;
pub(crate) const NORM_Q_FEW_THREADS: u32 = 1024;
pub(crate) const NORM_Q_FEW_ROWS: usize = 16;
/// Warps per block and gate/up row pairs per warp of the int8 SwiGLU kernels that also write
/// the int8 copy of their output (SQ_WARPS, SQ_R in matmul.cu): a block owns one 32-value
/// block of every row of x.
pub(crate) const SQ_WARPS: usize = 16;
pub(crate) const SQ_R: usize = GROUP / SQ_WARPS;
/// Those kernels exist for the dp4a tiles of `MM_TILES` up to this many rows of x.
pub(crate) const SQ_MAX_MT: usize = 4;
/// Warps per matmul block (MM_WARPS in matmul.cu).
pub(crate) const MM_WARPS: usize = 4;
/// Column tiles of 8 outputs, int8 rows (rows of x, or half as many rows' two terms) and warps
/// per block of the int8 tensor-core kernels (QT_NT, QT_BM, QT_WARPS in matmul_qtc.cu).
pub(crate) const QT_NT: usize = 4;
/// The middle width (QT_NT_MID) and the narrow blocks' column tiles (QT_NT_NARROW): for
/// products whose wider blocks would leave SMs idle.
pub(crate) const QT_NT_MID: usize = 2;
pub(crate) const QT_NT_NARROW: usize = 1;
/// The widths the int8 tensor-core kernels are built for (`mmqt[width index]`), widest first.
pub(crate) const QT_WIDTHS: [usize; 3] = [QT_NT, QT_NT_MID, QT_NT_NARROW];
pub(crate) const QT_BM: usize = 16;
pub(crate) const QT_WARPS: usize = 8;
/// Products one matmul launch can hold (MM_SEGS in matmul.cu).
pub(crate) const MM_SEGS: usize = 3;

/// What a matmul does with each output value (EPI_* in matmul.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Epilogue {
    /// `out = s`
    Store,
    /// `out = out + s` (a fused residual add)
    Add,
    /// `out = silu(s_gate) * s_up` (two weights per output)
    Swiglu,
    /// The q, k, v products of an attention layer with RoPE and the KV write (one rotary
    /// pair of rows per warp; CUDA-core kernels only).
    Rope,
}

impl Epilogue {
    pub const ALL: [Epilogue; 4] = [
        Epilogue::Store,
        Epilogue::Add,
        Epilogue::Swiglu,
        Epilogue::Rope,
    ];
    /// The epilogues of the tensor-core kernels (`mmtc[epilogue index]`).
    pub const TENSOR: [Epilogue; 3] = [Epilogue::Store, Epilogue::Add, Epilogue::Swiglu];
    /// The epilogues of the f32-activation TF32 kernels (`mmx2[epilogue index]`).
    pub const FLOAT_MMA: [Epilogue; 2] = [Epilogue::Store, Epilogue::Add];

    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Store => "store",
            Epilogue::Add => "add",
            Epilogue::Swiglu => "swiglu",
            Epilogue::Rope => "rope",
        }
    }
}

impl Epilogue {
    /// Outputs (weight rows; rope: two per rotary pair) per block of the int8 tensor-core
    /// kernels of `tiles` column tiles of 8: half as many tiles, at least one, for SwiGLU (two
    /// weights each).
    pub fn qt_outputs(self, tiles: usize) -> usize {
        match self {
            Epilogue::Swiglu => 8 * (tiles / 2).max(1),
            _ => 8 * tiles,
        }
    }
}

impl MmTile {
    /// Weight rows per warp of this tile's kernel for `epi` (a rotary pair for the rope
    /// epilogue).
    pub fn r_of(self, epi: Epilogue) -> usize {
        match epi {
            Epilogue::Store | Epilogue::Add => self.r,
            Epilogue::Swiglu => self.r_swiglu,
            Epilogue::Rope => 2,
        }
    }
}

/// Query-head dimensions per lane (head_dim <= 32 * PER) and query heads per KV head (exactly
/// GM) of the split attention kernels (`attention_split_<PER>_<GM>` in attention.cu).
pub(crate) const ATT_PER: [usize; 4] = [1, 2, 4, 8];
pub(crate) const ATT_GM: [usize; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
/// Largest GM * 32 * PER (ATT_MAX_GHD in attention.cu).
pub(crate) const ATT_MAX_GHD: usize = 1024;
/// Splits of a token's keys (ATT_MAX_SPLITS in attention.cu).
pub(crate) const ATT_MAX_SPLITS: usize = 16;
/// Slots a split's tiles are dealt into (ATT_SLOTS in attention.cu): slot s takes tiles s,
/// s + ATT_SLOTS, ...; slots s and s + ATT_SLOTS / 2 merge, then the pairs in order, whatever
/// the block's warps (ATT_SLOTS or [`ATT_NARROW_WARPS`]).
pub(crate) const ATT_SLOTS: usize = 8;
/// Warps of an attention_split block in launches of more tokens than
/// [`Device::att_wide_max_rows`] (two slots a warp, so more blocks fit an SM).
pub(crate) const ATT_NARROW_WARPS: usize = 4;

/// Function handles of the kernels every model needs (ops.cu, attention.cu).
pub(crate) struct Kernels {
    pub dequant_float_any: CudaFunction,
    pub add: CudaFunction,
    pub add_bias: CudaFunction,
    pub silu_mul: CudaFunction,
    pub quant_q8: CudaFunction,
    pub scale: CudaFunction,
    pub grouped_conv: CudaFunction,
    pub gather_rows: CudaFunction,
    pub copy_columns: CudaFunction,
    pub rms_norm: CudaFunction,
    pub rms_norm_q8: CudaFunction,
    pub rms_norm_q8_few: CudaFunction,
    pub rope: CudaFunction,
    pub rope_kv: CudaFunction,
    pub qk_norm_rope_kv: CudaFunction,
    pub kv_write: CudaFunction,
    pub kv_copy: CudaFunction,
    /// `attention_split[per index][gm index]` (None where GM * 32 * PER > ATT_MAX_GHD): the
    /// plain kernel, then the one with early loads (`attention_split_early_*`).
    pub attention_split: Vec<Vec<Option<[CudaFunction; 2]>>>,
    pub attention_merge: CudaFunction,
    pub attention_merge_q8: CudaFunction,
    pub sample: super::sample::SampleKernels,
}

/// The kernels of one weight format (matmul.cu compiled for it), loaded on first use.
pub(crate) struct FormatKernels {
    /// `mm[tile index][epilogue index]` for the tiles of `MM_TILES`. These, `mmtc` and
    /// `dequant` read the format's GPU layout: packed for the formats with int8 kernels
    /// (cuda/pack.rs), else as stored.
    pub mm: Vec<Vec<CudaFunction>>,
    /// `mmq[tile index][epilogue index]`: the int8-activation kernels, on the packed layout
    /// (empty for formats without them, see [`int8_format`]).
    pub mmq: Vec<Vec<CudaFunction>>,
    /// `mmqs[tile index]` for the tiles of `MM_TILES` up to `SQ_MAX_MT` rows: the int8 SwiGLU
    /// kernels that also write the int8 copy of their output (empty as `mmq` is).
    pub mmqs: Vec<CudaFunction>,
    /// `mmqt[width index][epilogue index]` for the widths of `QT_WIDTHS`: the int8-activation
    /// kernels of several rows on integer tensor cores, with the bits of `mmq` (matmul_qtc.cu;
    /// empty as `mmq` is).
    pub mmqt: Vec<Vec<CudaFunction>>,
    /// `mmtc[epilogue index]`: the tensor-core kernels of prompt rows (matmul_tc.cu).
    pub mmtc: Vec<CudaFunction>,
    /// `mmx2[column tiles - 1][epilogue index]` for 1 and 2 column tiles of 8 rows of x and
    /// the epilogues of [`Epilogue::FLOAT_MMA`]: the output head on TF32 tensor cores
    /// (matmul_x2.cu; empty as `mmq` is).
    pub mmx2: Vec<Vec<CudaFunction>>,
    pub dequant: CudaFunction,
}

/// A kernel argument. Every argument is passed through an 8-byte slot; the kernel reads as
/// many bytes as its parameter has (little-endian, so 4-byte values sit in the low half).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device pointer (`T*` in the kernel).
    Ptr(u64),
    /// `int`.
    I32(i32),
    /// `long long` (`i64`).
    I64(i64),
    /// `float`.
    F32(f32),
}

/// `usize` as an `int` kernel argument; panics when it does not fit.
pub(crate) fn int(v: usize) -> Arg {
    Arg::I32(
        i32::try_from(v).unwrap_or_else(|_| panic!("{v} does not fit a 32-bit kernel argument")),
    )
}

/// `usize` as a `long long` kernel argument.
pub(crate) fn long(v: usize) -> Arg {
    Arg::I64(i64::try_from(v).expect("size fits i64"))
}

/// Panics with the CUDA error (ops have no error channel in the `Backend` trait).
pub(crate) fn ck<T>(r: Result<T, drv::DriverError>, what: &str) -> T {
    r.unwrap_or_else(|e| panic!("CUDA {what} failed: {e}"))
}

/// Scratch buffers reused across ops (no allocation in a steady decode loop).
#[derive(Default)]
pub(crate) struct Scratch {
    /// Token ids (embed) and row indices (gather_rows).
    pub idx: Option<CudaSlice<u32>>,
    /// Dequantized weight panels for the cuBLAS path.
    pub deq: Option<CudaSlice<f32>>,
    /// Partial softmax states of the split attention.
    pub att_part: Option<CudaSlice<f32>>,
    /// Arrival counts of the split blocks per (token, KV head), zero between launches.
    pub att_count: Option<CudaSlice<u32>>,
    /// x of an int8 product, quantized: codes, then (d, ds) per 32-value block.
    pub xq: Option<CudaSlice<u8>>,
    /// The int8 copy a SwiGLU product writes of its output (as `xq`), apart from `xq`, which
    /// holds that product's own x.
    pub xq_out: Option<CudaSlice<u8>>,
}

/// Returns `slot`'s buffer, reallocated (zeroed) when shorter than `n`; kept contents are the last user's. A
/// reallocation moves the buffer, so it bumps `epoch` (captured graphs must be rebuilt).
pub(crate) fn ensure<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    epoch: &AtomicU64,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> u64 {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(ck(stream.alloc_zeros::<T>(n.max(1)), "allocation"));
        epoch.fetch_add(1, Ordering::Relaxed);
    }
    dptr(stream, slot.as_ref().expect("just set"))
}

/// A switch that is on unless the environment variable `name` is `0` (unset, empty or `1`:
/// on; anything else is an error naming the variable).
fn switch_on(name: &str) -> Result<bool, String> {
    match std::env::var(name).as_deref().map(str::trim) {
        Err(_) | Ok("1") | Ok("") => Ok(true),
        Ok("0") => Ok(false),
        Ok(v) => Err(format!("{name}={v:?}: expected 0 or 1")),
    }
}

/// A row-count setting from environment variable `name`'s value `v`: unset, empty or `auto`
/// gives `auto`; `0` or `off` never (`usize::MAX`); anything else must be a count.
pub(crate) fn rows_setting(name: &str, v: Option<&str>, auto: usize) -> Result<usize, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(auto),
        Some("0") | Some("off") => Ok(usize::MAX),
        Some(s) => s
            .parse::<usize>()
            .map_err(|_| format!("{name}={s:?}: expected auto, 0 or the fewest rows (1, 2, ...)")),
    }
}

/// The raw device address of a buffer.
pub(crate) fn dptr<T>(stream: &CudaStream, s: &CudaSlice<T>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// The device and everything the ops share.
pub(crate) struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub k: Kernels,
    /// Per-format kernels, by `dtype_index`, loaded by `format`.
    formats: [OnceLock<FormatKernels>; 8],
    format_lock: Mutex<()>,
    /// A tile forced by `DFLASH_CUDA_MM_TILE` (1, 2, 4, 8 or 16 rows of x) for every
    /// product: a debugging aid (one kernel instance for every M).
    pub fixed_mt: Option<usize>,
    /// Launch names (digits written `N`, as [`ProfileKeys::Name`] keys them) that are not
    /// launched at all, from `DFLASH_CUDA_SKIP` (comma-separated): a profiling aid that
    /// measures what a kernel costs inside a captured step (the step time without it). The
    /// results are wrong while it is set, and opening the device says so.
    pub skip: Vec<String>,
    /// Kernels are launched with programmatic stream serialization (programmatic dependent
    /// launch: sm_90 and later, unless `DFLASH_CUDA_PDL=0`), so each kernel's blocks start
    /// while the one before finishes and wait for it in `df_kernel_begin` (common.cu).
    pub pdl: bool,
    /// The q/k/v products of attention layers rotate and write the KV cache in their
    /// epilogue (`EPI_ROPE`, matmul.cu) instead of a separate `rope_kv` launch, unless
    /// `DFLASH_CUDA_FUSE_ROPE=0`; the bits are the same either way.
    pub fuse_rope: bool,
    /// Attention launches of at least this many tokens merge their splits in the split kernel
    /// (the last split block of each token and KV head, `att_merge_last` in attention.cu)
    /// instead of a separate `attention_merge` launch ([`CudaOptions::fuse_merge_min_rows`]);
    /// the bits are the same.
    pub fuse_merge_min_rows: usize,
    /// Attention launches of at most this many tokens give each split block a warp per slot
    /// (ATT_SLOTS warps: every tile of a split in flight at once), larger ones
    /// [`ATT_NARROW_WARPS`] ([`CudaOptions::att_wide_max_rows`]); the bits are the same.
    pub att_wide_max_rows: usize,
    /// Which of the target's projections multiply int8-quantized activations (`DFLASH_CUDA_INT8`).
    pub int8: Int8Policy,
    /// How the KV cache holds keys and values ([`CudaOptions::kv_type`]): the attention kernels
    /// are compiled for it, the writers of the cache take it as an argument.
    pub kv_type: KvType,
    /// The RMS norm and the attention merge write the int8 copy of their output for the int8
    /// product after them (cuda/int8_x.rs), unless `DFLASH_CUDA_INT8_HANDOFF=0` (then every
    /// int8 product launches the quantizer; the bits are the same either way).
    pub int8_handoff: bool,
    /// [`CudaOptions::swiglu_q8`] (with the handoff on).
    pub swiglu_q8: bool,
    /// Int8-activation products of at least this many rows of x run on integer tensor cores
    /// (`mmqt_*`, same bits as `mmq_*`): `DFLASH_CUDA_INT8_MMA` = `auto` (`int8::INT8_MMA_MIN_M`),
    /// a number, or `0` (never; also below sm_80).
    pub int8_mma_min_m: usize,
    /// [`CudaOptions::int8_mma_width`].
    pub int8_mma_width: Option<usize>,
    /// The vocabulary projection (the output head) of packed Q4_0, Q4_1 and Q8_0 weights runs
    /// on TF32 tensor cores with x split in two terms (`mmx2_*`, matmul_x2.cu) for every M,
    /// unless `DFLASH_CUDA_FLOAT_MMA=0`; needs sm_80 in the chip and the target. Either way one
    /// kernel serves every M of a weight.
    pub float_mma: bool,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors: a product whose wide int8 tensor-core blocks are fewer takes
    /// the narrow ones.
    pub sm_count: usize,
    pub target: Target,
    pub blas: Option<CudaBlas>,
    pub prefill_gemm: PrefillGemm,
    pub scratch: Mutex<Scratch>,
    /// Device buffers of dropped metadata, reused by `upload_meta`.
    pub meta_pool: Arc<Mutex<Vec<CudaSlice<u32>>>>,
    /// Bumped whenever a buffer that kernels may have been captured with moves (a tensor,
    /// scratch or table reallocation): graphs captured before are stale.
    pub epoch: AtomicU64,
    /// Kernel timing by class (CUDA events around every launch), when turned on.
    pub profiler: Mutex<Option<Profiler>>,
    /// Buffers of the token-choice ops.
    pub sample: Mutex<super::sample::SampleScratch>,
    /// The int8 copy of x the last launch wrote for the product after it (cuda/int8_x.rs).
    pub fresh_x: FreshX,
    /// Bytes of named weights the next attention or product launch brings into L2 ahead of
    /// the launches that read them (`DFLASH_CUDA_L2_AHEAD`: by default a quarter of the L2
    /// cache; cuda/l2_ahead.rs).
    pub l2_ahead: usize,
    /// The weights named for it ([`Backend::weights_ahead`](crate::Backend::weights_ahead)).
    pub ahead: PendingAhead,
    /// Inner dimensions of the uploaded int8-activation weights: the RMS norm and the
    /// attention merge write an int8 copy of an output this wide.
    int8_k: Mutex<Vec<usize>>,
}

impl Device {
    /// Opens the device. Every missing piece (driver, GPU, NVRTC, cuBLAS when asked for)
    /// is an error that says what is missing and how to fix it.
    pub fn open(opts: &CudaOptions) -> Result<Device, RuntimeError> {
        // cudarc panics when a library or symbol cannot be loaded; check the libraries first
        // and keep any other panic from escaping as one.
        match std::panic::catch_unwind(|| Self::open_inner(opts)) {
            Ok(r) => r,
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                Err(RuntimeError::Device(format!(
                    "CUDA initialisation failed: {msg}"
                )))
            }
        }
    }

    fn open_inner(opts: &CudaOptions) -> Result<Device, RuntimeError> {
        let dev_err = RuntimeError::Device;
        // SAFETY: only tries to open the library.
        if !unsafe { cu::is_culib_present() } {
            return Err(dev_err(
                "the NVIDIA driver library (libcuda.so.1) was not found: install the NVIDIA \
                 driver, or add the folder holding libcuda.so.1 to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        if let Err(e) = drv::init() {
            return Err(dev_err(format!(
                "the CUDA driver did not initialise ({e}); is an NVIDIA GPU present and the \
                 driver loaded (does `nvidia-smi` work)?"
            )));
        }
        let count = CudaContext::device_count()
            .map_err(|e| dev_err(format!("could not count CUDA devices: {e}")))?;
        if count <= 0 {
            return Err(dev_err(
                "no CUDA GPU found (the driver reports 0 devices)".into(),
            ));
        }
        if opts.device >= count as usize {
            return Err(dev_err(format!(
                "CUDA device {} requested, but only {count} present",
                opts.device
            )));
        }
        if !compile::nvrtc_available() {
            return Err(dev_err(compile::NVRTC_HINT.into()));
        }
        if matches!(opts.prefill_gemm, PrefillGemm::Cublas { .. })
            // SAFETY: only tries to open the library.
            && !unsafe { cudarc::cublas::sys::is_culib_present() }
        {
            return Err(dev_err(
                "cuBLAS (libcublas.so.13) was not found, and DFLASH_CUDA_GEMM asks for the \
                 cuBLAS prefill path: install the CUDA toolkit or the `nvidia-cublas` wheel \
                 (and add its lib folder to LD_LIBRARY_PATH), or unset DFLASH_CUDA_GEMM"
                    .into(),
            ));
        }

        let ctx = CudaContext::new(opts.device)
            .map_err(|e| dev_err(format!("could not open CUDA device {}: {e}", opts.device)))?;
        // One stream only: cudarc's per-buffer event tracking (an event record per buffer use
        // and a wait per launch) buys nothing and costs per-launch overhead, so it is turned
        // off before any buffer is allocated. SAFETY: all work goes to `stream`, in order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| dev_err(format!("could not create a CUDA stream: {e}")))?;
        let cc = ctx
            .compute_capability()
            .map_err(|e| dev_err(format!("could not read the compute capability: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let sm_count = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| dev_err(format!("could not read the SM count: {e}")))?
            .max(1) as usize;
        keep_pool_memory(&ctx);

        let arch = match std::env::var("DFLASH_CUDA_ARCH") {
            Ok(v) => v
                .trim()
                .trim_start_matches("sm_")
                .parse::<u32>()
                .map_err(|_| dev_err(format!("DFLASH_CUDA_ARCH={v:?}: expected e.g. sm_90")))?,
            Err(_) => (cc.0 * 10 + cc.1) as u32,
        };
        let target = compile::target_for(arch).map_err(dev_err)?;
        let (k, target) = load_kernels(&ctx, target, opts.kv_type).map_err(dev_err)?;

        let fixed_mt = match std::env::var("DFLASH_CUDA_MM_TILE") {
            Ok(v) => match v.trim().parse::<usize>() {
                Ok(t) if MM_TILES.iter().any(|x| x.mt == t) => Some(t),
                _ => {
                    return Err(dev_err(format!(
                        "DFLASH_CUDA_MM_TILE={v:?}: expected one of 1, 2, 4, 8, 16"
                    )))
                }
            },
            Err(_) => None,
        };

        let skip = skip_list(std::env::var("DFLASH_CUDA_SKIP").ok().as_deref());
        if !skip.is_empty() {
            tracing::warn!(
                "DFLASH_CUDA_SKIP: launches of {skip:?} are skipped; every result is wrong \
                 (a profiling aid)"
            );
        }

        let pdl = match std::env::var("DFLASH_CUDA_PDL").as_deref() {
            Err(_) | Ok("1") | Ok("") => arch >= 90 && cc.0 >= 9,
            Ok("0") => false,
            Ok(v) => return Err(dev_err(format!("DFLASH_CUDA_PDL={v:?}: expected 0 or 1"))),
        };

        let fuse_rope = switch_on("DFLASH_CUDA_FUSE_ROPE").map_err(dev_err)?;
        let float_mma =
            switch_on("DFLASH_CUDA_FLOAT_MMA").map_err(dev_err)? && cc.0 >= 8 && target.arch >= 80;
        let int8_handoff = switch_on("DFLASH_CUDA_INT8_HANDOFF").map_err(dev_err)?;
        let l2_bytes = ctx
            .attribute(cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map_err(|e| dev_err(format!("could not read the L2 cache size: {e}")))?
            .max(0) as usize;
        let l2_ahead = l2_ahead_setting(std::env::var("DFLASH_CUDA_L2_AHEAD").ok().as_deref())
            .map_err(dev_err)?
            .unwrap_or(l2_bytes / L2A_AUTO_SHARE);

        let int8_mma_min_m =
            int8_mma_min_rows(std::env::var("DFLASH_CUDA_INT8_MMA").ok().as_deref())
                .map_err(dev_err)?;
        // Integer m16n8k32 MMA needs sm_80, in the chip and in the compiled target.
        let int8_mma_min_m = if cc.0 < 8 || arch < 80 {
            usize::MAX
        } else {
            int8_mma_min_m
        };

        let blas = match opts.prefill_gemm {
            PrefillGemm::Kernel | PrefillGemm::Tensor => None,
            PrefillGemm::Cublas { .. } => {
                let blas = CudaBlas::new(stream.clone())
                    .map_err(|e| dev_err(format!("could not start cuBLAS: {e}")))?;
                // SAFETY: a valid handle; pedantic math keeps SGEMM in full f32 (no TF32).
                let r = unsafe {
                    cudarc::cublas::sys::cublasSetMathMode(
                        *blas.handle(),
                        cudarc::cublas::sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
                    )
                };
                if r != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                    return Err(dev_err(format!("could not set cuBLAS math mode: {r:?}")));
                }
                Some(blas)
            }
        };

        Ok(Device {
            ctx,
            stream,
            k,
            formats: Default::default(),
            format_lock: Mutex::new(()),
            fixed_mt,
            skip,
            pdl,
            fuse_rope,
            fuse_merge_min_rows: opts.fuse_merge_min_rows,
            att_wide_max_rows: opts.att_wide_max_rows,
            int8: opts.int8,
            kv_type: opts.kv_type,
            int8_mma_min_m,
            int8_mma_width: opts.int8_mma_width,
            float_mma,
            int8_handoff,
            swiglu_q8: opts.swiglu_q8 && int8_handoff,
            name,
            compute_capability: cc,
            sm_count,
            target,
            blas,
            // The tensor-core kernels need TF32 MMA (sm_80), in the chip and in the target
            // the kernels were compiled for (they are empty below it).
            prefill_gemm: match opts.prefill_gemm {
                PrefillGemm::Tensor if cc.0 < 8 || target.arch < 80 => PrefillGemm::Kernel,
                g => g,
            },
            scratch: Mutex::new(Scratch::default()),
            meta_pool: Arc::new(Mutex::new(Vec::new())),
            epoch: AtomicU64::new(0),
            profiler: Mutex::new(None),
            sample: Mutex::new(Default::default()),
            fresh_x: FreshX::default(),
            l2_ahead,
            ahead: PendingAhead::default(),
            int8_k: Mutex::new(Vec::new()),
        })
    }

    /// The kernels of format `d`, compiled (or read from the cache) and loaded on first use.
    pub fn format(&self, d: DType) -> Result<&FormatKernels, String> {
        let i = d.index();
        if let Some(f) = self.formats[i].get() {
            return Ok(f);
        }
        let _one_at_a_time = self.format_lock.lock().map_err(|e| e.to_string())?;
        if let Some(f) = self.formats[i].get() {
            return Ok(f);
        }
        let m = Module::matmul(d, self.int8.terms());
        let image = compile::load_or_compile(m, self.target)?;
        let f = self.load_format(m, image)?;
        Ok(self.formats[i].get_or_init(|| f))
    }

    /// Compiles the kernels of several formats at once (one thread each) and loads them.
    pub fn preload(&self, formats: &[DType]) -> Result<(), String> {
        let _one_at_a_time = self.format_lock.lock().map_err(|e| e.to_string())?;
        let todo: Vec<Module> = formats
            .iter()
            .filter(|d| self.formats[d.index()].get().is_none())
            .map(|&d| Module::matmul(d, self.int8.terms()))
            .collect();
        for (m, image) in compile::compile_many(&todo, self.target, true)? {
            let d = m.format().expect("a matmul module");
            let f = self.load_format(m, image)?;
            let _ = self.formats[d.index()].set(f);
        }
        Ok(())
    }

    /// The kernels of a format whose weights were uploaded (which loaded them).
    pub fn loaded(&self, d: DType) -> &FormatKernels {
        self.formats[d.index()]
            .get()
            .expect("weights are uploaded through upload_weight, which loads their kernels")
    }

    fn load_format(&self, m: Module, image: Image) -> Result<FormatKernels, String> {
        let d = m.format().expect("a matmul module");
        let module = load_image(&self.ctx, m, image, self.target)?;
        let get = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| format!("kernel {name} missing from {}: {e}", m.name()))
        };
        let sfx = d.info().kernel_name;
        // `<family>_<format>_<MT>_<R>_<epilogue>` for every tile and epilogue.
        let tiles = |family: &str| -> Result<Vec<Vec<CudaFunction>>, String> {
            MM_TILES
                .iter()
                .map(|t| {
                    Epilogue::ALL
                        .iter()
                        .map(|&e| {
                            get(&format!(
                                "{family}_{sfx}_{}_{}_{}",
                                t.mt,
                                t.r_of(e),
                                e.name()
                            ))
                        })
                        .collect()
                })
                .collect()
        };
        let mm = tiles("mm")?;
        let mmq = if int8_format(d) {
            tiles("mmq")?
        } else {
            Vec::new()
        };
        let mmqs = if int8_format(d) {
            MM_TILES
                .iter()
                .filter(|t| t.mt <= SQ_MAX_MT)
                .map(|t| get(&format!("mmqs_{sfx}_{}", t.mt)))
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let mmqt = if int8_format(d) {
            QT_WIDTHS
                .iter()
                .map(|t| {
                    Epilogue::ALL
                        .iter()
                        .map(|e| get(&format!("mmqt_{sfx}_{}_{t}", e.name())))
                        .collect::<Result<_, _>>()
                })
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        let mmtc = Epilogue::TENSOR
            .iter()
            .map(|e| get(&format!("mmtc_{sfx}_{}", e.name())))
            .collect::<Result<_, _>>()?;
        let mmx2 = if int8_format(d) {
            (1..=2)
                .map(|mt| {
                    Epilogue::FLOAT_MMA
                        .iter()
                        .map(|e| get(&format!("mmx2_{sfx}_{}_{mt}", e.name())))
                        .collect::<Result<_, _>>()
                })
                .collect::<Result<_, _>>()?
        } else {
            Vec::new()
        };
        Ok(FormatKernels {
            mm,
            mmq,
            mmqs,
            mmqt,
            mmtc,
            mmx2,
            dequant: get(&format!("dequant_{sfx}"))?,
        })
    }

    /// Notes an uploaded int8-activation weight with `k` inputs.
    pub fn note_int8_k(&self, k: usize) {
        let mut ks = self.int8_k.lock().expect("int8 k lock");
        if !ks.contains(&k) {
            ks.push(k);
        }
    }

    /// Whether some int8-activation weight has `k` inputs (so an int8 copy of an output `k`
    /// wide may be read).
    pub fn int8_k(&self, k: usize) -> bool {
        self.int8_k.lock().expect("int8 k lock").contains(&k)
    }

    /// Makes the context current on the calling thread.
    pub fn bind(&self) {
        ck(
            self.ctx.bind_to_thread(),
            "binding the context to this thread",
        );
    }

    /// Launches `f` on the stream with `args` (one 8-byte slot each). `name` is for error
    /// messages and the profile's kernel classes.
    pub fn launch(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[Arg],
    ) {
        const MAX_ARGS: usize = 16;
        assert!(args.len() <= MAX_ARGS, "too many kernel arguments");
        let mut slots = [0u64; MAX_ARGS];
        for (s, a) in slots.iter_mut().zip(args) {
            *s = match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            };
        }
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, s) in params.iter_mut().zip(slots.iter_mut()) {
            *p = s as *mut u64 as *mut c_void;
        }
        // SAFETY: the argument list matches the kernel's parameters (each call site is
        // written against the kernel's signature) and the slots outlive the call, which
        // copies the parameters.
        unsafe { self.launch_raw(f, name, grid, block, smem, &mut params[..args.len()]) }
    }

    /// Launches a kernel whose one parameter is the `#[repr(C)]` struct `p` (mirroring the
    /// kernel's parameter struct field for field).
    pub fn launch_with<P: Copy>(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        p: &P,
    ) {
        self.launch_with_smem(f, name, grid, block, 0, p)
    }

    /// [`Device::launch_with`] with `smem` bytes of dynamic shared memory per block (beyond
    /// 48 KiB only for a function whose limit was raised when it was loaded).
    pub fn launch_with_smem<P: Copy>(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        p: &P,
    ) {
        let mut params = [p as *const P as *mut c_void];
        // SAFETY: the kernel takes one parameter of P's layout (both sides are C structs of
        // the same fields); the call copies it.
        unsafe { self.launch_raw(f, name, grid, block, smem, &mut params) }
    }

    unsafe fn launch_raw(
        &self,
        f: &CudaFunction,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        params: &mut [*mut c_void],
    ) {
        self.fresh_x.forget();
        assert!(
            grid.0 > 0 && grid.1 > 0 && grid.2 > 0,
            "empty grid for {name}"
        );
        assert!(
            grid.1 <= 65535 && grid.2 <= 65535,
            "grid too large for {name}: {grid:?}"
        );
        if !self.skip.is_empty() && self.skip.contains(&ProfileKeys::Name.key(name)) {
            return;
        }
        // A poisoned lock (a panic in an earlier launch) still guards a usable profiler.
        let mut prof = self.profiler.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = prof.as_mut() {
            p.before(&self.ctx, &self.stream, name);
        }
        let r = if self.pdl {
            let mut attr = cu::CUlaunchAttribute {
                id: cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: cu::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: 1,
                },
            };
            let config = cu::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: smem,
                hStream: self.stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as `launch_kernel` below (same function, parameters and stream); the
            // configuration and its one attribute live until the call returns.
            unsafe {
                cu::cuLaunchKernelEx(
                    &config,
                    f.cu_function(),
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
        } else {
            drv::launch_kernel(
                f.cu_function(),
                grid,
                block,
                smem,
                self.stream.cu_stream(),
                params,
            )
        };
        ck(r, name);
        if let Some(p) = prof.as_mut() {
            p.after(&self.stream);
        }
    }

    /// Bumps the epoch: a buffer kernels may have been captured with has moved.
    pub fn moved(&self) {
        self.epoch.fetch_add(1, Ordering::Relaxed);
    }

    /// Copies `src` to device address `dst` (stream-ordered; `src` may be reused at once).
    pub fn htod<T>(&self, src: &[T], dst: u64) {
        if src.is_empty() {
            return;
        }
        self.fresh_x.forget();
        // SAFETY: `dst` is a live buffer of at least `src.len()` elements (callers ensure it).
        ck(
            unsafe { drv::memcpy_htod_async(dst, src, self.stream.cu_stream()) },
            "host-to-device copy",
        );
    }

    /// Copies device address `src` into `dst` and waits for it.
    pub fn dtoh<T>(&self, src: u64, dst: &mut [T]) {
        if dst.is_empty() {
            return;
        }
        // SAFETY: `src` is a live buffer of at least `dst.len()` elements (callers ensure it).
        ck(
            unsafe { drv::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) },
            "device-to-host copy",
        );
        ck(self.stream.synchronize(), "stream synchronisation");
    }

    /// Allocates `n` zeroed elements (at least one, so that every buffer has an address).
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> CudaSlice<T> {
        self.fresh_x.forget();
        ck(self.stream.alloc_zeros::<T>(n.max(1)), "allocation")
    }

    /// Allocates `n` elements with undefined contents (at least one).
    pub fn uninit<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> CudaSlice<T> {
        // SAFETY: callers write before they read (or the contents are documented undefined).
        ck(unsafe { self.stream.alloc::<T>(n.max(1)) }, "allocation")
    }

    pub fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        dptr(&self.stream, s)
    }
}

/// Keeps freed memory in the device's default pool instead of returning it to the driver at
/// every synchronisation, so that stream-ordered allocations after a sync stay cheap.
fn keep_pool_memory(ctx: &CudaContext) {
    if !ctx.has_async_alloc() {
        return;
    }
    // SAFETY: plain driver queries on the current device; failures are ignored (this is
    // only a performance setting).
    unsafe {
        let mut pool: cu::CUmemoryPool = std::ptr::null_mut();
        if cu::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) == cu::CUresult::CUDA_SUCCESS {
            let mut threshold: u64 = u64::MAX;
            let _ = cu::cuMemPoolSetAttribute(
                pool,
                cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut threshold as *mut u64 as *mut c_void,
            );
        }
    }
}

/// Loads a compiled unit into the context.
pub(crate) fn load_image(
    ctx: &Arc<CudaContext>,
    m: Module,
    image: Image,
    target: Target,
) -> Result<Arc<cudarc::driver::CudaModule>, String> {
    let ptx = match image {
        Image::Cubin(bytes) => cudarc::nvrtc::Ptx::from_binary(bytes),
        Image::Ptx(text) => cudarc::nvrtc::Ptx::from_src(text),
    };
    ctx.load_module(ptx).map_err(|e| {
        format!(
            "the driver could not load the {} kernels built for {}: {e}",
            m.name(),
            target.arch_flag()
        )
    })
}

/// Compiles (or reads from the cache) and loads the shared kernels; falls back from machine
/// code to PTX when the driver refuses the machine code. Returns the target that worked.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    target: Target,
    kv: KvType,
) -> Result<(Kernels, Target), String> {
    match load_kernels_for(ctx, target, kv) {
        Ok(k) => Ok((k, target)),
        Err(e) if target.cubin => {
            let ptx = Target {
                arch: target.arch,
                cubin: false,
            };
            tracing::warn!(
                "loading {} kernels failed ({e}); trying PTX",
                target.arch_flag()
            );
            load_kernels_for(ctx, ptx, kv)
                .map(|k| (k, ptx))
                .map_err(|e2| format!("{e}; with PTX: {e2}"))
        }
        Err(e) => Err(e),
    }
}

fn load_kernels_for(ctx: &Arc<CudaContext>, target: Target, kv: KvType) -> Result<Kernels, String> {
    let mut modules = Vec::new();
    let attention = Module::Attention(kv);
    let shared = [Module::Ops, attention, Module::Sample];
    for (m, image) in compile::compile_many(&shared, target, true)? {
        modules.push((m, load_image(ctx, m, image, target)?));
    }
    let get = |m: Module, name: &str| -> Result<CudaFunction, String> {
        let module = &modules.iter().find(|(mm, _)| *mm == m).expect("loaded").1;
        module
            .load_function(name)
            .map_err(|e| format!("kernel {name} missing from {}: {e}", m.name()))
    };
    let mut attention_split = Vec::new();
    for per in ATT_PER {
        let mut row = Vec::new();
        for gm in ATT_GM {
            row.push(if gm * 32 * per <= ATT_MAX_GHD {
                Some([
                    get(attention, &format!("attention_split_{per}_{gm}"))?,
                    get(attention, &format!("attention_split_early_{per}_{gm}"))?,
                ])
            } else {
                None
            });
        }
        attention_split.push(row);
    }
    Ok(Kernels {
        dequant_float_any: get(Module::Ops, "dequant_float_any")?,
        add: get(Module::Ops, "add_f32")?,
        add_bias: get(Module::Ops, "add_bias_f32")?,
        silu_mul: get(Module::Ops, "silu_mul_f32")?,
        quant_q8: get(Module::Ops, "quant_q8_f32")?,
        scale: get(Module::Ops, "scale_f32")?,
        grouped_conv: get(Module::Ops, "grouped_conv_f32")?,
        gather_rows: get(Module::Ops, "gather_rows_f32")?,
        copy_columns: get(Module::Ops, "copy_columns_f32")?,
        rms_norm: get(Module::Ops, "rms_norm_f32")?,
        rms_norm_q8: get(Module::Ops, "rms_norm_q8_f32")?,
        rms_norm_q8_few: get(Module::Ops, "rms_norm_q8_few_f32")?,
        rope: get(Module::Ops, "rope_f32")?,
        rope_kv: get(Module::Ops, "rope_kv_f32")?,
        qk_norm_rope_kv: get(Module::Ops, "qk_norm_rope_kv_f32")?,
        kv_write: get(Module::Ops, "kv_write_f32")?,
        kv_copy: get(Module::Ops, "kv_copy")?,
        attention_split,
        attention_merge: get(attention, "attention_merge")?,
        attention_merge_q8: get(attention, "attention_merge_q8")?,
        sample: super::sample::SampleKernels::load(|name| get(Module::Sample, name))?,
    })
}
