//! Int8-activation matmul kernels for Q4_0, Q4_1 and Q8_0 weights.
//!
//! Once per product the activations are quantized to int8 per row and 32-value block
//! (`quantize`), the weights having been repacked once at load (`pack`); the kernels then
//! multiply int8 activation codes with 4- or 8-bit weight codes in integer dot-product
//! instructions: AVX-512-VNNI, AVX-VNNI, AVX2 (`vpmaddubsw`), NEON `sdot`. The arithmetic is
//! fixed by `reference` (exact integer block dots, then one f32 accumulator per output in
//! block order), so every kernel, every M and every tiling gives the same bits: verify rows
//! equal decode rows, and the kernels equal the portable reference on every machine.
//!
//! Before first use each kernel family this CPU has runs a self-check against the reference;
//! one that fails is disabled with a warning, and products fall back to the next family, or
//! to the f32 kernels when none is left.

pub mod contract;
pub mod pack;
pub mod quantize;
pub mod reference;
pub mod synthetic;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

use std::cell::RefCell;
use std::fmt;
use std::ops::Range;
use std::sync::OnceLock;

use crate::cpu::pool::{CpuPool, SyncPtr};
use crate::dtype::DType;
use pack::{Int8Format, PackedWeight, PANEL};
use quantize::{QuantRows, Terms};

/// One kernel call: panels `panels` of `w` against all rows of `x`, written to
/// `out[i · out_stride + j]` for the panels' output rows `j` (`j < w.rows`).
pub struct Job<'a> {
    pub w: &'a PackedWeight,
    pub panels: Range<usize>,
    pub x: &'a QuantRows,
    pub out: *mut f32,
    pub out_stride: usize,
}

/// The format a kernel's const parameter stands for (const generics take no enums).
#[inline(always)]
const fn format_of(f: u8) -> Int8Format {
    match f {
        0 => Int8Format::Q4_0,
        1 => Int8Format::Q4_1,
        _ => Int8Format::Q8_0,
    }
}

/// A tuned int8 kernel family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Int8Kernel {
    /// AMX tile products from `amx::MIN_ROWS` x rows, AVX-512-VNNI for fewer.
    Amx,
    Avx512Vnni,
    AvxVnni,
    Avx2,
    NeonDot,
}

impl fmt::Display for Int8Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Int8Kernel::Amx => "amx-int8",
            Int8Kernel::Avx512Vnni => "avx512-vnni",
            Int8Kernel::AvxVnni => "avx-vnni",
            Int8Kernel::Avx2 => "avx2-int8",
            Int8Kernel::NeonDot => "neon-dot",
        })
    }
}

impl Int8Kernel {
    /// Every family, most preferred first.
    pub const ALL: [Int8Kernel; 5] = [
        Int8Kernel::Amx,
        Int8Kernel::Avx512Vnni,
        Int8Kernel::AvxVnni,
        Int8Kernel::Avx2,
        Int8Kernel::NeonDot,
    ];

    /// True when this CPU has the instructions.
    pub fn cpu_has(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => Int8Kernel::Avx512Vnni.cpu_has() && amx::usable(),
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::AvxVnni => {
                is_x86_feature_detected!("avxvnni") && Int8Kernel::Avx2.cpu_has()
            }
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Int8Kernel::NeonDot => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Runs one job.
    ///
    /// # Safety
    /// `self.cpu_has()` must hold and `job.out` must have room for every output it names.
    pub unsafe fn run(self, job: &Job) {
        debug_assert!(job.panels.end <= job.w.panels() && job.x.k == job.w.cols);
        match self {
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Amx => amx::run(job),
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx512Vnni => avx512::run(job),
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::AvxVnni => avx2::run_vnni(job),
            #[cfg(target_arch = "x86_64")]
            Int8Kernel::Avx2 => avx2::run(job),
            #[cfg(target_arch = "aarch64")]
            Int8Kernel::NeonDot => neon::run(job),
            #[allow(unreachable_patterns)]
            _ => unreachable!("{self} kernels are not built for this architecture"),
        }
    }

    /// The families this CPU has that passed their self-check, most preferred first
    /// (checked once per process; failures are logged as warnings).
    pub fn usable() -> &'static [Int8Kernel] {
        static USABLE: OnceLock<Vec<Int8Kernel>> = OnceLock::new();
        USABLE.get_or_init(|| {
            let have: Vec<Int8Kernel> = Int8Kernel::ALL
                .into_iter()
                .filter(|k| k.cpu_has())
                .collect();
            // SAFETY: only families this CPU has are run.
            passing(&have, |k| self_check(|job| unsafe { k.run(job) }))
        })
    }

    /// The preferred usable family, if any.
    pub fn best() -> Option<Int8Kernel> {
        Int8Kernel::usable().first().copied()
    }
}

/// The candidates whose `check` passes, in order; each failure is logged as a warning and
/// the kernel left out.
pub fn passing(
    candidates: &[Int8Kernel],
    check: impl Fn(Int8Kernel) -> Result<(), String>,
) -> Vec<Int8Kernel> {
    candidates
        .iter()
        .copied()
        .filter(|&k| match check(k) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("int8 kernel {k} failed its self-check and is disabled: {e}");
                false
            }
        })
        .collect()
}

/// Runs `kernel` on fixed synthetic problems (every format, a partial panel, M = 1..16) and
/// compares it with the reference bit for bit.
pub fn self_check(kernel: impl Fn(&Job)) -> Result<(), String> {
    for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
        let (n, k) = (37, 96);
        let w = synthetic::weight(dtype, n, k, 0.02, 17);
        let packed = PackedWeight::pack(&w).expect("int8 formats pack");
        for m in [1usize, 3, 4, 8, 9, 16] {
            let mut x = QuantRows::default();
            x.quantize(&synthetic::activations(m, k, m as u64), m, k);
            let mut want = vec![0f32; m * n];
            reference::matmul(&w, &x, &mut want);
            let mut got = vec![f32::NAN; m * n];
            kernel(&Job {
                w: &packed,
                panels: 0..packed.panels(),
                x: &x,
                out: got.as_mut_ptr(),
                out_stride: n,
            });
            if let Some(at) = (0..m * n).find(|&i| got[i].to_bits() != want[i].to_bits()) {
                return Err(format!(
                    "{dtype} m={m}: output {at} is {} where the reference gives {}",
                    got[at], want[at]
                ));
            }
        }
    }
    Ok(())
}

/// Packed blocks ahead of the one a kernel is at that it asks the cache for. Without it a
/// verify of 2 rows cost 1.29–1.30 decode steps on a 2-vCPU AMD EPYC, with it 1.13–1.17
/// (2 to 8 blocks ahead alike; 4 also best at 8 rows, 2.19x against 2.36–2.47x;
/// docs/benchmarks/2026-12-04-cpu-argmax-screen.md).
const PREFETCH_BLOCKS: usize = 4;

/// Asks the cache for the packed block `PREFETCH_BLOCKS` after the one at `blk` (`bb` bytes a
/// block; blocks, and panels after one another, are contiguous, so this runs into the next
/// panel at a panel's end). The x86 kernels call it once per block; on other architectures
/// it does nothing.
#[inline(always)]
pub(crate) fn prefetch_ahead(blk: *const u8, bb: usize) {
    let ahead = blk.wrapping_add(PREFETCH_BLOCKS * bb);
    let mut off = 0;
    while off < bb {
        // SAFETY: prefetching never faults, whatever the address.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                ahead.wrapping_add(off) as *const i8,
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = ahead;
        off += 64;
    }
}

/// Per-thread buffers of the products (reused across calls).
#[derive(Default)]
struct Scratch {
    /// The quantized activations of the current product.
    xq: QuantRows,
    /// The residuals of [`Terms::Two`].
    resid: Vec<f32>,
    /// Both terms' outputs of every job (`2m x n` each) under [`Terms::Two`].
    wide: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `out = x · wᵀ` for every `(w, out)` of `jobs` with the same `x` (`m` rows of `k = w.cols`):
/// `x` is quantized once (into `terms`), then the weights' panels are spread over the pool's
/// workers. With [`Terms::Two`] each task multiplies both int8 rows of every x row and writes
/// `out = first + second` for its panels' outputs, so every output is one fixed sum whatever M.
pub fn matmul_many(
    pool: &CpuPool,
    kernel: Int8Kernel,
    terms: Terms,
    x: &[f32],
    m: usize,
    jobs: &mut [(&PackedWeight, &mut [f32])],
) {
    assert!(kernel.cpu_has(), "{kernel} kernels are not supported here");
    let Some(k) = jobs.first().map(|j| j.0.cols) else {
        return;
    };
    let mut first = Vec::with_capacity(jobs.len() + 1);
    let mut wide_at = Vec::with_capacity(jobs.len() + 1);
    let (mut units, mut wide_len) = (0, 0);
    for (w, out) in jobs.iter() {
        assert_eq!(w.cols, k, "matmul_many needs one inner dimension");
        assert!(out.len() >= m * w.rows);
        first.push(units);
        wide_at.push(wide_len);
        units += w.panels();
        wide_len += terms.count() * m * w.rows;
    }
    first.push(units);
    let outs: Vec<SyncPtr<f32>> = jobs
        .iter_mut()
        .map(|(_, o)| SyncPtr(o.as_mut_ptr()))
        .collect();
    SCRATCH.with(|cell| {
        let scratch = &mut *cell.borrow_mut();
        scratch
            .xq
            .quantize_terms(x, m, k, terms, &mut scratch.resid);
        if terms == Terms::Two {
            scratch.wide.resize(wide_len, 0.0);
        }
        let wide = SyncPtr(scratch.wide.as_mut_ptr());
        let xq = &scratch.xq;
        let tasks = units.min(pool.threads() * 8).max(1);
        pool.for_each(tasks, |t| {
            let (lo, hi) = (units * t / tasks, units * (t + 1) / tasks);
            for (j, (w, _)) in jobs.iter().enumerate() {
                let a = lo.max(first[j]) - first[j];
                let b = hi.min(first[j + 1]).saturating_sub(first[j]);
                if a >= b {
                    continue;
                }
                let n = w.rows;
                let out = match terms {
                    Terms::One => outs[j].get(),
                    // SAFETY: job j's share of `wide` holds 2m x n values.
                    Terms::Two => unsafe { wide.get().add(wide_at[j]) },
                };
                let job = Job {
                    w,
                    panels: a..b,
                    x: xq,
                    out,
                    out_stride: n,
                };
                // SAFETY: tasks write disjoint panels' columns; shapes checked above.
                unsafe { kernel.run(&job) };
                if terms == Terms::Two {
                    let cols = a * PANEL..(b * PANEL).min(n);
                    for i in 0..m {
                        // SAFETY: rows i and m + i of this job's share, this task's columns;
                        // `out` has m x n values (checked above).
                        unsafe {
                            let (x1, x2) = (out.add(i * n), out.add((m + i) * n));
                            let y = outs[j].get().add(i * n);
                            for c in cols.clone() {
                                *y.add(c) = *x1.add(c) + *x2.add(c);
                            }
                        }
                    }
                }
            }
        });
    });
}

#[cfg(test)]
mod tests;
