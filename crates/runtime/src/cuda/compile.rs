//! Kernel sources and their compilation with NVRTC, cached on disk.
//!
//! The kernels are the `.cu` files of `crates/runtime/kernels`, embedded in the binary. At
//! first use each module is compiled by NVRTC for the GPU's compute capability, to a CUBIN
//! (machine code, `sm_XY`) when NVRTC can target that chip, so nothing depends on the
//! driver's PTX JIT; otherwise to PTX for the newest virtual architecture NVRTC knows (which
//! the driver compiles at load). The result is cached under the dflash cache directory, keyed
//! by a hash of the source, the target, the NVRTC version and the compile options.
//!
//! Environment:
//! - `DFLASH_CUDA_INCLUDE`: extra include directories for NVRTC (`:`-separated). The kernels
//!   include no CUDA header today, so none is required; the known locations below are passed
//!   when they exist so that future kernels can use the toolkit headers.
//! - `CUDA_HOME`, `CUDA_PATH`: `<dir>/include` is searched, then `/usr/local/cuda/include`,
//!   `/opt/cuda/include` and `/usr/local/cuda-*/include`.
//! - `DFLASH_CUDA_KERNEL_DIR`: a directory whose `<file>.cu` files replace the embedded
//!   sources of the same name (kernel work on a GPU machine that has no Rust toolchain: edit a
//!   kernel there and rerun the same binary). Each replaced file is named in a warning; the
//!   kernel parameter structs must still match the Rust side.
//! - `DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else `~/.cache/dflash`: the cache
//!   root (kernels go to `<root>/cuda-kernels`). `DFLASH_CUDA_NO_CACHE=1` turns the cache off.

use std::borrow::Cow;
use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nv;

use crate::dtype::{DType, FORMATS};
use crate::kv_type::KvType;

const COMMON: &str = include_str!("../../kernels/common.cu");
const INCLUDE_COMMON: &str = "#include \"common.cu\"";
/// Parts of matmul.cu kept in their own files, pasted where it includes them: the
/// tensor-core products of prompt rows, the f32-activation products of packed weights on TF32
/// tensor cores, and the int8 products of verify rows on integer tensor cores.
const MATMUL_PARTS: [(&str, &str); 3] = [
    ("matmul_tc.cu", include_str!("../../kernels/matmul_tc.cu")),
    ("matmul_x2.cu", include_str!("../../kernels/matmul_x2.cu")),
    ("matmul_qtc.cu", include_str!("../../kernels/matmul_qtc.cu")),
];

/// The `#include` line of a pasted part.
fn include_line(file: &str) -> String {
    format!("#include \"{file}\"")
}

/// A compiled unit: `ops.cu`, `attention.cu`, `sample.cu`, or `matmul.cu` for one format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Ops,
    /// attention.cu for a KV cache of the given type (`DF_KV_HALF`).
    Attention(KvType),
    /// The Gated DeltaNet kernels (gdn.cu), built when a model with GDN layers first runs.
    Gdn,
    Sample,
    Matmul(DType),
    /// matmul.cu for a format with int8 kernels, its int8 products reading two-term int8
    /// activations (`DF_X_TERMS` 2; `Int8Policy::TwoTerms`).
    MatmulInt8x2(DType),
}

impl Module {
    /// Every unit: the shared modules, then matmul for each format.
    pub fn all() -> Vec<Module> {
        let mut v = vec![
            Module::Ops,
            Module::Attention(KvType::F32),
            Module::Attention(KvType::F16),
            Module::Sample,
            Module::Gdn,
        ];
        v.extend(DType::ALL.into_iter().map(Module::Matmul));
        v.extend(
            DType::ALL
                .into_iter()
                .filter(|&d| super::int8::int8_format(d))
                .map(Module::MatmulInt8x2),
        );
        v
    }

    /// The matmul module of format `d` whose int8 products read `terms` int8 rows per row of
    /// x (1 or 2; formats without int8 kernels have one module).
    pub fn matmul(d: DType, terms: usize) -> Module {
        if terms == 2 && super::int8::int8_format(d) {
            Module::MatmulInt8x2(d)
        } else {
            Module::Matmul(d)
        }
    }

    /// The format of a matmul module.
    pub fn format(self) -> Option<DType> {
        match self {
            Module::Matmul(d) | Module::MatmulInt8x2(d) => Some(d),
            _ => None,
        }
    }

    pub fn name(self) -> String {
        match self {
            Module::Ops => "ops".into(),
            Module::Attention(KvType::F32) => "attention".into(),
            Module::Attention(KvType::F16) => "attention_f16".into(),
            Module::Gdn => "gdn".into(),
            Module::Sample => "sample".into(),
            Module::Matmul(d) => format!("matmul_{}", d.info().kernel_name),
            Module::MatmulInt8x2(d) => format!("matmul_{}_int8x2", d.info().kernel_name),
        }
    }

    /// The file's text: `$DFLASH_CUDA_KERNEL_DIR/<file>.cu` when that exists, else embedded.
    fn text(self) -> Cow<'static, str> {
        let file = match self {
            Module::Matmul(_) | Module::MatmulInt8x2(_) => "matmul.cu",
            Module::Ops => "ops.cu",
            Module::Attention(_) => "attention.cu",
            Module::Gdn => "gdn.cu",
            Module::Sample => "sample.cu",
        };
        kernel_file(file, self.raw_source())
    }

    fn raw_source(self) -> &'static str {
        match self {
            Module::Matmul(_) | Module::MatmulInt8x2(_) => include_str!("../../kernels/matmul.cu"),
            Module::Ops => include_str!("../../kernels/ops.cu"),
            Module::Attention(_) => include_str!("../../kernels/attention.cu"),
            Module::Gdn => include_str!("../../kernels/gdn.cu"),
            Module::Sample => include_str!("../../kernels/sample.cu"),
        }
    }

    /// The complete source handed to NVRTC: the format constants of the table
    /// ([`format_defines`]) and the launch constants the host shares with the kernels
    /// ([`shared_defines`]), then the file with `common.cu` (and, in matmul.cu, its
    /// `MATMUL_PARTS`) pasted in (and, for matmul, the format to instantiate defined first).
    pub fn source(self) -> String {
        let raw = self.text();
        let common = kernel_file("common.cu", COMMON);
        assert!(
            raw.lines().any(|l| l.trim() == INCLUDE_COMMON),
            "{}.cu must include common.cu",
            self.name()
        );
        let mut body = format_defines();
        body.push_str(&shared_defines());
        if let Some(d) = self.format() {
            body.push_str(&format!(
                "#define DF_MM_DTYPE {}\n#define DF_MM_SUFFIX {}\n#define DF_MM_INT8 {}\n\
                 #define DF_X_TERMS {}\n",
                d.index(),
                d.info().kernel_name,
                u8::from(super::int8::int8_format(d)),
                1 + u8::from(matches!(self, Module::MatmulInt8x2(_)))
            ));
        }
        if let Module::Attention(kv) = self {
            body.push_str(&format!(
                "#define DF_KV_HALF {}\n",
                u8::from(kv == KvType::F16)
            ));
        }
        for line in raw.lines() {
            let part = MATMUL_PARTS
                .iter()
                .find(|(file, _)| line.trim() == include_line(file));
            if line.trim() == INCLUDE_COMMON {
                body.push_str(&common);
            } else if let Some(&(file, text)) = part {
                body.push_str(&kernel_file(file, text));
            } else {
                body.push_str(line);
            }
            body.push('\n');
        }
        body
    }
}

/// `file` from `$DFLASH_CUDA_KERNEL_DIR` when it is set and holds a readable copy, else the
/// embedded text.
fn kernel_file(file: &str, embedded: &'static str) -> Cow<'static, str> {
    let Some(dir) = std::env::var_os("DFLASH_CUDA_KERNEL_DIR").filter(|d| !d.is_empty()) else {
        return Cow::Borrowed(embedded);
    };
    if !Path::new(&dir).is_dir() {
        tracing::warn!(
            "DFLASH_CUDA_KERNEL_DIR={} is not a directory: the embedded {file} is used",
            Path::new(&dir).display()
        );
        return Cow::Borrowed(embedded);
    }
    let path = Path::new(&dir).join(file);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            tracing::warn!("CUDA kernel source {file} read from {}", path.display());
            Cow::Owned(text)
        }
        Err(_) => Cow::Borrowed(embedded),
    }
}

/// `#define DT_<NAME> <number>` and `#define DT_<NAME>_BYTES <bytes per block>` for every
/// row of the format table: the kernels' only source of format numbers and block sizes.
pub fn format_defines() -> String {
    let mut s = String::new();
    for f in FORMATS.iter() {
        let name = f.kernel_name.to_uppercase();
        s.push_str(&format!(
            "#define DT_{name} {}\n#define DT_{name}_BYTES {}\n",
            f.dtype.index(),
            f.block_bytes
        ));
    }
    // Format numbers of the packed layouts (DT_<NAME> + DT_PACKED: the GPU layout of every
    // weight of a format with int8 kernels).
    s.push_str(&format!("#define DT_PACKED {}\n", super::pack::DT_PACKED));
    s
}

/// The launch shapes and limits the host and the kernels both use, by their kernel names, from
/// the host's constants: each is stated once, on the host, and pasted ahead of every kernel
/// file as `#define NAME value` ([`shared_defines`]); the .cu files never restate them.
fn shared_constants() -> [(&'static str, usize); 39] {
    use super::device::{
        Epilogue, ATT_MAX_GHD, ATT_MAX_SPLITS, ATT_SLOTS, MM_SEGS, MM_WARPS, NORM_Q_FEW_THREADS,
        NORM_Q_THREADS, NORM_STAGE, NORM_THREADS, QT_BM, QT_NT, QT_NT_MID, QT_NT_NARROW, QT_WARPS,
        SQ_R, SQ_WARPS, TC_BM, TC_BN, TC_THREADS, X2_BM, X2_NT, X2_WARPS,
    };
    use super::{attention, gdn, rope_kv, sample};
    [
        // common.cu
        ("L2A_RANGES", super::l2_ahead::L2A_RANGES),
        ("L2A_CHUNK", super::l2_ahead::L2A_CHUNK),
        // matmul.cu, matmul_qtc.cu, matmul_tc.cu, matmul_x2.cu
        ("MM_WARPS", MM_WARPS),
        ("MM_SEGS", MM_SEGS),
        ("EPI_STORE", Epilogue::Store as usize),
        ("EPI_ADD", Epilogue::Add as usize),
        ("EPI_SWIGLU", Epilogue::Swiglu as usize),
        ("EPI_ROPE", Epilogue::Rope as usize),
        ("SQ_WARPS", SQ_WARPS),
        ("SQ_R", SQ_R),
        ("QT_WARPS", QT_WARPS),
        ("QT_BM", QT_BM),
        ("QT_NT", QT_NT),
        ("QT_NT_MID", QT_NT_MID),
        ("QT_NT_NARROW", QT_NT_NARROW),
        ("X8_TILED", super::int8_x::X8_TILED),
        ("TC_BM", TC_BM),
        ("TC_BN", TC_BN),
        ("TC_THREADS", TC_THREADS as usize),
        ("X2_WARPS", X2_WARPS),
        ("X2_NT", X2_NT),
        ("X2_BM", X2_BM),
        // ops.cu
        ("NORM_STAGE", NORM_STAGE),
        ("NORM_THREADS", NORM_THREADS as usize),
        ("NORM_Q_THREADS", NORM_Q_THREADS as usize),
        ("NORM_Q_FEW_THREADS", NORM_Q_FEW_THREADS as usize),
        ("QKN_WARPS", rope_kv::QKN_WARPS),
        ("QKN_MAX_DIM", rope_kv::QKN_MAX_DIM),
        // attention.cu
        ("ATT_SLOTS", ATT_SLOTS),
        ("ATT_MAX_SPLITS", ATT_MAX_SPLITS),
        ("ATT_MAX_GHD", ATT_MAX_GHD),
        (
            "ATT_PREFETCH_MAX_TOKENS",
            attention::ATT_PREFETCH_MAX_TOKENS,
        ),
        // gdn.cu
        ("GDN_MAX_K", gdn::MAX_CONV_K),
        ("GDN_CHUNK", crate::cpu::ops::gdn::CHUNK),
        ("GDN_CT", gdn::CHUNK_COLS),
        ("GDN_CTHREADS", gdn::CHUNK_THREADS as usize),
        // sample.cu
        ("CH_THREADS", sample::CH_THREADS as usize),
        ("ARGMAX_CHUNK", sample::ARGMAX_CHUNK),
        ("ARGMAX_THREADS", sample::ARGMAX_THREADS as usize),
    ]
}

/// `#define NAME value` for every launch constant of [`shared_constants`].
pub fn shared_defines() -> String {
    shared_constants()
        .iter()
        .map(|(name, v)| format!("#define {name} {v}\n"))
        .collect()
}

/// What a compilation produced.
#[derive(Clone, Debug)]
pub enum Image {
    /// Machine code for one chip (`sm_XY`).
    Cubin(Vec<u8>),
    /// PTX text for a virtual architecture (`compute_XY`), compiled by the driver at load.
    Ptx(String),
}

impl Image {
    pub fn len(&self) -> usize {
        match self {
            Image::Cubin(b) => b.len(),
            Image::Ptx(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The code NVRTC is asked for: machine code for `sm_<arch>` or PTX for `compute_<arch>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    /// Compute capability as major*10 + minor (90 for Hopper).
    pub arch: u32,
    pub cubin: bool,
}

impl Target {
    pub fn arch_flag(self) -> String {
        if self.cubin {
            format!("sm_{}", self.arch)
        } else {
            format!("compute_{}", self.arch)
        }
    }
}

/// True when the NVRTC library can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { nv::is_culib_present() }
}

/// How to make NVRTC loadable, for error messages.
pub const NVRTC_HINT: &str = "NVRTC (libnvrtc.so.13) was not found. Install the CUDA toolkit \
(and add its lib64 folder to LD_LIBRARY_PATH if it is not on the loader path), or install the \
wheel `nvidia-cuda-nvrtc==13.0.*` with pip and add its `nvidia/cu13/lib` folder to LD_LIBRARY_PATH";

fn check(r: nv::nvrtcResult, what: &str) -> Result<(), String> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("NVRTC {what} failed: {r:?}"))
    }
}

/// NVRTC's (major, minor) version.
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    if !nvrtc_available() {
        return Err(NVRTC_HINT.to_string());
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: plain out-parameters.
    check(
        unsafe { nv::nvrtcVersion(&mut major, &mut minor) },
        "version",
    )?;
    Ok((major, minor))
}

/// The real architectures (`sm_XY`) this NVRTC can compile for, as XY numbers.
pub fn supported_archs() -> Result<Vec<u32>, String> {
    if !nvrtc_available() {
        return Err(NVRTC_HINT.to_string());
    }
    let mut n: c_int = 0;
    // SAFETY: out-parameter, then a buffer of the announced size.
    unsafe {
        check(nv::nvrtcGetNumSupportedArchs(&mut n), "arch count")?;
        let mut archs = vec![0 as c_int; n.max(0) as usize];
        check(nv::nvrtcGetSupportedArchs(archs.as_mut_ptr()), "arch list")?;
        Ok(archs.into_iter().map(|a| a as u32).collect())
    }
}

/// Picks what to compile for a device of compute capability `arch` (e.g. 90): its own
/// machine code when NVRTC supports it, else PTX for the newest older virtual architecture.
pub fn target_for(arch: u32) -> Result<Target, String> {
    let archs = supported_archs()?;
    if archs.contains(&arch) {
        return Ok(Target { arch, cubin: true });
    }
    match archs.iter().copied().filter(|&a| a <= arch).max() {
        Some(a) => Ok(Target {
            arch: a,
            cubin: false,
        }),
        None => Err(format!(
            "this NVRTC cannot compile for compute capability {}.{} (it knows {archs:?}); use an \
             NVRTC of the CUDA version the driver supports",
            arch / 10,
            arch % 10
        )),
    }
}

/// Include directories passed to NVRTC (those that exist), in search order.
pub fn include_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(extra) = std::env::var("DFLASH_CUDA_INCLUDE") {
        dirs.extend(
            extra
                .split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from),
        );
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = std::env::var(var) {
            if !home.is_empty() {
                dirs.push(Path::new(&home).join("include"));
            }
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs.push(PathBuf::from("/opt/cuda/include"));
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("cuda-"))
            .map(|e| e.path().join("include"))
            .collect();
        versioned.sort();
        versioned.reverse();
        dirs.extend(versioned);
    }
    let mut seen = std::collections::HashSet::new();
    dirs.into_iter()
        .filter(|d| d.is_dir() && seen.insert(d.clone()))
        .collect()
}

/// The options every module is compiled with (besides include paths).
///
/// `--fmad=false`: no multiply-add is fused unless the source says so (`__fmaf_rn`), so the
/// arithmetic is the one written, as in the CPU reference; IEEE division and square root;
/// denormals kept.
fn options(target: Target) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.arch_flag()),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
        "--std=c++17".into(),
    ]
}

/// Compiles `module` for `target` with NVRTC (no cache).
pub fn compile(module: Module, target: Target) -> Result<Image, String> {
    compile_logged(module, target, &[]).map(|(img, _)| img)
}

/// [`compile`] with `extra` options after the usual ones, returning NVRTC's log beside the
/// image (e.g. `--ptxas-options=-v` puts each kernel's registers and spills in the log).
pub fn compile_logged(
    module: Module,
    target: Target,
    extra: &[&str],
) -> Result<(Image, String), String> {
    if !nvrtc_available() {
        return Err(NVRTC_HINT.to_string());
    }
    let src = CString::new(module.source()).map_err(|e| e.to_string())?;
    let name = CString::new(format!("{}.cu", module.name())).map_err(|e| e.to_string())?;
    let mut opts = options(target);
    opts.extend(extra.iter().map(|o| o.to_string()));
    for dir in include_dirs() {
        opts.push(format!("--include-path={}", dir.display()));
    }
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();

    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the source, name and option strings outlive the program; the program is
    // destroyed on every path below.
    unsafe {
        check(
            nv::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "create program",
        )?;
        let result = (|| {
            let r = nv::nvrtcCompileProgram(prog, ptrs.len() as c_int, ptrs.as_ptr());
            if r != nv::nvrtcResult::NVRTC_SUCCESS {
                let log = program_log(prog);
                return Err(format!(
                    "NVRTC could not compile {}.cu for {} ({r:?}), options {opts:?}:\n{log}",
                    module.name(),
                    target.arch_flag()
                ));
            }
            let mut size = 0usize;
            if target.cubin {
                check(nv::nvrtcGetCUBINSize(prog, &mut size), "cubin size")?;
                let mut bin = vec![0u8; size];
                check(
                    nv::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char),
                    "get cubin",
                )?;
                Ok((Image::Cubin(bin), program_log(prog)))
            } else {
                check(nv::nvrtcGetPTXSize(prog, &mut size), "ptx size")?;
                let mut buf = vec![0u8; size];
                check(
                    nv::nvrtcGetPTX(prog, buf.as_mut_ptr() as *mut c_char),
                    "get ptx",
                )?;
                let text = CStr::from_bytes_until_nul(&buf)
                    .map_err(|e| e.to_string())?
                    .to_string_lossy()
                    .into_owned();
                Ok((Image::Ptx(text), program_log(prog)))
            }
        })();
        nv::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// The compile log of `prog` (empty when it cannot be read).
unsafe fn program_log(prog: nv::nvrtcProgram) -> String {
    let mut size = 0usize;
    if nv::nvrtcGetProgramLogSize(prog, &mut size) != nv::nvrtcResult::NVRTC_SUCCESS {
        return String::new();
    }
    let mut buf = vec![0u8; size.max(1)];
    if nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char)
        != nv::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The dflash cache root: `$DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash`, else
/// `~/.cache/dflash`.
pub fn cache_root() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("DFLASH_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = var("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("dflash"));
    }
    var("HOME").map(|h| PathBuf::from(h).join(".cache").join("dflash"))
}

/// 64-bit FNV-1a over several byte strings (each followed by a zero byte).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(std::iter::once(&0u8)) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// Where the compiled `module` for `target` is cached (None when caching is off).
pub fn cache_path(module: Module, target: Target) -> Result<Option<PathBuf>, String> {
    if std::env::var("DFLASH_CUDA_NO_CACHE").is_ok_and(|v| v != "0" && !v.is_empty()) {
        return Ok(None);
    }
    let Some(root) = cache_root() else {
        return Ok(None);
    };
    let (major, minor) = nvrtc_version()?;
    let version = format!("nvrtc {major}.{minor}");
    let opts = options(target).join(" ");
    let src = module.source();
    let key = fnv1a(&[
        src.as_bytes(),
        target.arch_flag().as_bytes(),
        version.as_bytes(),
        opts.as_bytes(),
    ]);
    let ext = if target.cubin { "cubin" } else { "ptx" };
    Ok(Some(root.join("cuda-kernels").join(format!(
        "{}-{}-{key:016x}.{ext}",
        module.name(),
        target.arch_flag()
    ))))
}

/// The compiled `module` for `target`: from the cache when there, else compiled with NVRTC
/// and stored (a cache that cannot be written is skipped, not an error).
pub fn load_or_compile(module: Module, target: Target) -> Result<Image, String> {
    let path = cache_path(module, target)?;
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok(if target.cubin {
                    Image::Cubin(bytes)
                } else {
                    Image::Ptx(String::from_utf8_lossy(&bytes).into_owned())
                });
            }
        }
    }
    let started = std::time::Instant::now();
    let image = compile(module, target)?;
    tracing::debug!(
        "compiled CUDA module {} for {} in {:.1} s",
        module.name(),
        target.arch_flag(),
        started.elapsed().as_secs_f64()
    );
    if let Some(p) = &path {
        let bytes: &[u8] = match &image {
            Image::Cubin(b) => b,
            Image::Ptx(s) => s.as_bytes(),
        };
        if let Err(e) = write_atomic(p, bytes) {
            tracing::warn!("could not cache CUDA kernels at {}: {e}", p.display());
        }
    }
    Ok(image)
}

/// Writes `bytes` to `path` through a temporary file and a rename, so that a reader never
/// sees a partial file (several processes may compile at once).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Compiles every unit for `sm_<arch>` (no GPU needed, only NVRTC), in parallel, returning
/// each unit's name and CUBIN size. Used to check the kernel sources.
pub fn compile_all(arch: u32) -> Result<Vec<(String, usize)>, String> {
    compile_many(&Module::all(), Target { arch, cubin: true }, false).map(|v| {
        v.into_iter()
            .map(|(m, img)| (m.name(), img.len()))
            .collect()
    })
}

/// Compiles (or, with `cached`, reads from the cache) several units at once, one thread each.
pub fn compile_many(
    modules: &[Module],
    target: Target,
    cached: bool,
) -> Result<Vec<(Module, Image)>, String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = modules
            .iter()
            .map(|&m| {
                s.spawn(move || {
                    let r = if cached {
                        load_or_compile(m, target)
                    } else {
                        compile(m, target)
                    };
                    r.map(|img| (m, img))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("NVRTC compilation panicked".into()))
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_paste_common() {
        for m in Module::all() {
            let s = m.source();
            assert!(!s.lines().any(|l| l.trim() == INCLUDE_COMMON));
            assert_eq!(s.matches("#define DT_Q6K 7\n").count(), 1);
            assert_eq!(s.matches("#define DT_Q4_1_BYTES 20\n").count(), 1);
            assert!(s.contains("decode_group"));
            for (file, _) in MATMUL_PARTS {
                assert!(!s.lines().any(|l| l.trim() == include_line(file)));
            }
            if let Some(d) = m.format() {
                assert!(s.contains("mmtc_body"));
                assert!(s.contains("mmqt_body"));
                let int8 = matches!(d, DType::Q4_0 | DType::Q4_1 | DType::Q8_0);
                let terms = if matches!(m, Module::MatmulInt8x2(_)) {
                    assert!(int8, "{d}: two-term modules only for the int8 formats");
                    2
                } else {
                    1
                };
                assert_eq!(Module::matmul(d, terms), m);
                assert!(s.contains(&format!(
                    "#define DF_MM_DTYPE {}\n#define DF_MM_SUFFIX {}\n#define DF_MM_INT8 {}\n\
                     #define DF_X_TERMS {terms}\n",
                    d.index(),
                    d.info().kernel_name,
                    u8::from(int8)
                )));
            }
        }
    }

    /// Every launch constant the host shares is defined once in every module's source, by the
    /// host, and no kernel file defines it again.
    #[test]
    fn launch_constants_are_defined_once_by_the_host() {
        let files: Vec<&str> = Module::all()
            .into_iter()
            .map(Module::raw_source)
            .chain(MATMUL_PARTS.iter().map(|(_, text)| *text))
            .chain([COMMON])
            .collect();
        for (name, value) in shared_constants() {
            let define = format!("#define {name} ");
            for m in Module::all() {
                let s = m.source();
                assert_eq!(s.matches(&define).count(), 1, "{name} in {}.cu", m.name());
                assert!(s.contains(&format!("{define}{value}\n")), "{name}");
            }
            for text in &files {
                assert!(
                    !text.contains(&define),
                    "a kernel file defines {name} itself"
                );
            }
        }
    }

    /// Kernels are launched with programmatic stream serialization (`Device::pdl`), which is
    /// only safe when every kernel waits for the one before it before it reads anything a
    /// kernel writes, or leaves: `df_kernel_begin()` must be the first statement of every
    /// kernel body. The exceptions are the matmul kernels (`mm_body`), whose warps first
    /// read what only the host writes (parameters, weights, the step's token metadata and the
    /// KV row table, copied before the step; every product kernel may first request the
    /// weights the host named into L2, `df_l2_ahead`) and then wait: `mm_body` waits on both of its
    /// paths (a warp without rows, and `mm_warp` / `mmq_warp` before its first read of x),
    /// `mmqs_body` through `mmq_warp`, which every one of its warps reaches (it has no early
    /// exit), and so do `mmqt_body` and `mmqt_pipe_body` (matmul_qtc.cu, through `mmqt_kernel_body`), which
    /// have no early exit (the pipelined one requests its first weight stages before it waits),
    /// and `mmx2_body` (matmul_x2.cu: weight stages requested first; a warp without rows waits
    /// before it leaves);
    /// and the attention split
    /// and merge kernels and the q/k norm, which read the metadata, the row table and (the
    /// norm) its weights, and (the split) prefetch keys and values and the named weights into
    /// L2, never into registers, before they wait.
    #[test]
    fn every_kernel_begins_by_waiting_for_the_previous_one() {
        let mut kernels = 0;
        for m in [
            Module::Ops,
            Module::Attention(KvType::F32),
            Module::Gdn,
            Module::Sample,
        ]
        .into_iter()
        .chain([Module::Matmul(DType::Q4_1)])
        {
            let src = m.raw_source();
            for (at, _) in src.match_indices("__global__") {
                let body = &src[at..];
                let open = body.find('{').expect("kernel body");
                let mut statements = body[open + 1..]
                    .split(';')
                    .map(|st| st.trim_matches(|c: char| c.is_whitespace() || c == '\\'));
                // The products may first request named weights into L2 (df_l2_ahead: the
                // host's parameters and weights only, no register of them kept).
                let mut first = statements.next().unwrap_or("");
                if matches!(m, Module::Matmul(_)) && first == "df_l2_ahead(p.ahead)" {
                    first = statements.next().unwrap_or("");
                }
                let waits_in_body = (matches!(m, Module::Matmul(_))
                    && (first.starts_with("mm_body<")
                        || first.starts_with("mmqs_body<")
                        || first.starts_with("mmqt_kernel_body<")
                        || first.starts_with("mmx2_body<")))
                    || (matches!(m, Module::Attention(_))
                        && (first.starts_with("attention_split_body<")
                            || first.starts_with("attention_merge_body<")))
                    || (m == Module::Ops && first.starts_with("qk_norm_rope_kv_body("));
                assert!(
                    first == "df_kernel_begin()" || waits_in_body,
                    "{}.cu: a kernel does not start with df_kernel_begin(): {}",
                    m.name(),
                    &body[..open.min(120)]
                );
                kernels += 1;
            }
        }
        assert!(kernels >= 28, "found only {kernels} kernels");
        // mm_body's two paths: the early return of a warp without rows, and mm_warp, which
        // waits before its products (the first read of x).
        let mm = Module::Matmul(DType::Q4_1).raw_source();
        let warp = &mm[mm.find("void mm_warp(").expect("mm_warp")..];
        let wait = warp.find("df_kernel_begin();").expect("mm_warp waits");
        let first_x = warp.find("mm_load_x<").expect("mm_warp reads x");
        assert!(wait < first_x, "mm_warp reads x before it waits");
        let body = &mm[mm.find("void mm_body(").expect("mm_body")..];
        let body = &body[..body.find("\n}").expect("end of mm_body")];
        assert!(
            body.contains("df_kernel_begin();\n        return;"),
            "a warp without rows leaves mm_body without waiting"
        );
        // mmqs_body: every warp goes straight into mmq_warp (which waits before its first read
        // of x), with no way out before it.
        let qs = &mm[mm.find("void mmqs_body(").expect("mmqs_body")..];
        let qs = &qs[..qs.find("mmq_warp<").expect("mmqs_body runs mmq_warp")];
        assert!(
            !qs.contains("return"),
            "mmqs_body may leave before it waits"
        );
        let warp = &mm[mm.find("void mmq_warp(").expect("mmq_warp")..];
        let wait = warp.find("df_kernel_begin();").expect("mmq_warp waits");
        assert!(
            wait < warp.find("__ldg(x4)").expect("mmq_warp reads x"),
            "mmq_warp reads x before it waits"
        );
        // Both int8 tensor-core bodies read x through qt_load_x, after their wait, and never
        // leave before it (the pipelined one requests weights, the host's, before it).
        let part = |file: &str| {
            MATMUL_PARTS
                .iter()
                .find(|(f, _)| *f == file)
                .expect("a matmul part")
                .1
        };
        let qtc = part("matmul_qtc.cu");
        let load_x = qtc.find("void qt_load_x(").expect("qt_load_x");
        let load_x = &qtc[load_x..load_x + qtc[load_x..].find("\n}").expect("end of qt_load_x")];
        // x's codes and (d, ds) pairs, in the fragment tiles (`X8Form`).
        let (codes, pairs) = ("__ldg((const uint4*)p.x", "__ldg((const float4*)p.xs");
        assert!(
            load_x.contains(codes) && load_x.contains(pairs),
            "qt_load_x reads x"
        );
        for name in ["mmqt_body", "mmqt_pipe_body"] {
            let at = qtc.find(&format!("void {name}(")).expect(name);
            let body = &qtc[at..at + qtc[at..].find("\n}").expect("end of body")];
            let wait = body.find("df_kernel_begin();").expect("waits");
            let first_x = body.find("qt_load_x(").expect("reads x");
            assert!(wait < first_x, "{name} reads x before it waits");
            assert!(
                !body[..wait].contains("return"),
                "{name} leaves without waiting"
            );
            assert!(
                !body[..wait].contains(codes) && !body[..wait].contains(pairs),
                "{name} reads x before it waits"
            );
        }
        // The head's TF32 body requests weight stages (the host's) before its wait, reads x
        // after it, and its one early exit (a warp without rows) waits first.
        let x2 = part("matmul_x2.cu");
        let at = x2.find("void mmx2_body(").expect("mmx2_body");
        let body = &x2[at..at + x2[at..].find("\n}").expect("end of mmx2_body")];
        let wait = body.rfind("df_kernel_begin();").expect("mmx2_body waits");
        assert!(
            wait < body.find("__ldg(").expect("mmx2_body reads x"),
            "mmx2_body reads x before it waits"
        );
        assert_eq!(body[..wait].matches("return").count(), 1);
        assert!(
            body.contains("df_kernel_begin();\n        return;"),
            "a warp without rows leaves mmx2_body without waiting"
        );
        // The attention split and merge bodies and the q/k norm read the host's metadata and
        // row table (the split also prefetches into L2) first, then wait before they read
        // what a kernel writes (q, k, v, the split states) or leave.
        for (m, body, written) in [
            (
                Module::Attention(KvType::F32),
                "void attention_split_body(",
                ["p.q", "p.part"],
            ),
            (
                Module::Attention(KvType::F32),
                "void attention_merge_body(",
                ["p.q", "att_part("],
            ),
            (Module::Ops, "void qk_norm_rope_kv_body(", ["p.q ", "p.k "]),
        ] {
            let src = m.raw_source();
            let b = &src[src.find(body).expect(body)..];
            let wait = b.find("df_kernel_begin();").expect("the body waits");
            assert!(
                !b[..wait].contains("return") && written.iter().all(|w| !b[..wait].contains(w)),
                "{body} reads what a kernel writes or leaves before it waits"
            );
        }
    }

    #[test]
    fn hash_depends_on_every_part() {
        let a = fnv1a(&[b"x", b"sm_90"]);
        assert_ne!(a, fnv1a(&[b"x", b"sm_89"]));
        assert_ne!(a, fnv1a(&[b"xs", b"m_90"]));
        assert_eq!(a, fnv1a(&[b"x", b"sm_90"]));
    }
}
