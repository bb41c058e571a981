//! Matrix products `y = x · Wᵀ` with weights read in their stored format.
//!
//! One kernel family per instruction set (AVX-512, AVX2, NEON, portable), chosen at run time.
//! All of them compute each output with the same summation order for any number of rows of
//! `x`, so decode (M = 1), verify blocks (M = 2..16) and prefill (large M) agree bit for bit on
//! every row; the portable kernel with the same lane count is the reference they must match.

pub mod portable;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

use std::fmt;

use crate::cpu::pool::{CpuPool, SyncPtr};
use crate::dtype::DType;
use crate::quant::GROUP;
use crate::weight::HostWeight;

/// An instruction set with matmul kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    Avx512,
    Avx2,
    Neon,
    /// Plain Rust, emulating the given number of lanes.
    Portable(usize),
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Isa::Avx512 => f.write_str("avx512"),
            Isa::Avx2 => f.write_str("avx2"),
            Isa::Neon => f.write_str("neon"),
            Isa::Portable(l) => write!(f, "portable{l}"),
        }
    }
}

impl Isa {
    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Isa::Neon;
            }
        }
        Isa::Portable(8)
    }

    /// Parses a user override (`avx512`, `avx2`, `neon`, `portable`), refusing one the CPU lacks.
    pub fn parse(name: &str) -> Result<Isa, String> {
        let wanted = match name {
            "avx512" => Isa::Avx512,
            "avx2" => Isa::Avx2,
            "neon" => Isa::Neon,
            "portable" => Isa::Portable(8),
            other => {
                return Err(format!(
                    "unknown instruction set `{other}` (expected avx512, avx2, neon or portable)"
                ))
            }
        };
        if wanted.is_supported() {
            Ok(wanted)
        } else {
            Err(format!("this CPU does not support {wanted}"))
        }
    }

    /// True when this CPU can run the kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable(l) => matches!(l, 4 | 8 | 16),
            Isa::Avx512 => Isa::detect() == Isa::Avx512,
            Isa::Avx2 => matches!(Isa::detect(), Isa::Avx512 | Isa::Avx2),
            Isa::Neon => Isa::detect() == Isa::Neon,
        }
    }

    /// The lane count of the accumulators, which fixes the summation order.
    pub fn lanes(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 => 8,
            Isa::Neon => 4,
            Isa::Portable(l) => l,
        }
    }

    /// Computes `n` outputs for each of `m` rows on the calling thread (no parallelism).
    ///
    /// # Safety
    /// The pointers must describe valid buffers as in [`portable::matmul`], and `self` must be
    /// supported by this CPU.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kernel(
        self,
        dtype: DType,
        x: *const f32,
        x_stride: usize,
        m: usize,
        w: *const u8,
        row_bytes: usize,
        n: usize,
        k_groups: usize,
        out: *mut f32,
        out_stride: usize,
    ) {
        let a = (
            dtype, x, x_stride, m, w, row_bytes, n, k_groups, out, out_stride,
        );
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => avx512::matmul(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => avx2::matmul(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => neon::matmul(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9),
            Isa::Portable(4) => {
                portable::matmul::<4>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9)
            }
            Isa::Portable(16) => {
                portable::matmul::<16>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9)
            }
            _ => portable::matmul::<8>(a.0, a.1, a.2, a.3, a.4, a.5, a.6, a.7, a.8, a.9),
        }
    }
}

/// Asks the cache to fetch weight rows `first..first+count` (clipped to `n` rows).
///
/// Rows are short (a few cache lines), so the hardware prefetchers rarely lock on; kernels
/// prefetch the tile they will reach a couple of tiles from now.
#[inline(always)]
pub(crate) fn prefetch_rows(w: *const u8, row_bytes: usize, first: usize, count: usize, n: usize) {
    if first >= n {
        return;
    }
    let end = (first + count).min(n) * row_bytes;
    let mut off = first * row_bytes;
    while off < end {
        // SAFETY: prefetching never faults, and the address lies inside the weight buffer.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                w.add(off) as *const i8
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = w;
        off += 64;
    }
}

/// Weight rows per task unit; tasks are whole multiples of it so tiles stay full.
const ROW_UNIT: usize = 16;

/// `out[i][j] = Σ_k x[i][k] · W[j][k]` for `m` rows of `x` (row stride `w.cols`), in parallel
/// over weight rows. `out` is `m x w.rows`, row-major.
pub fn matmul(pool: &CpuPool, isa: Isa, x: &[f32], m: usize, w: &HostWeight, out: &mut [f32]) {
    matmul_many(pool, isa, x, m, &mut [(w, out)]);
}

/// Several products of the same `x` (e.g. the q, k and v projections) in one parallel region:
/// the weights' row units are spread over the workers together, so there is one join instead
/// of one per weight and the load balances across them.
pub fn matmul_many(
    pool: &CpuPool,
    isa: Isa,
    x: &[f32],
    m: usize,
    jobs: &mut [(&HostWeight, &mut [f32])],
) {
    let mut first_unit = Vec::with_capacity(jobs.len() + 1);
    let mut units = 0;
    for (w, out) in jobs.iter() {
        assert!(
            w.cols % GROUP == 0,
            "matmul needs whole {GROUP}-value groups"
        );
        assert!(x.len() >= m * w.cols && out.len() >= m * w.rows);
        assert_eq!(
            w.cols, jobs[0].0.cols,
            "matmul_many needs one inner dimension"
        );
        first_unit.push(units);
        units += w.rows.div_ceil(ROW_UNIT);
    }
    first_unit.push(units);
    let outs: Vec<SyncPtr<f32>> = jobs
        .iter_mut()
        .map(|(_, o)| SyncPtr(o.as_mut_ptr()))
        .collect();
    let tasks = units.min(pool.threads() * 8).max(1);
    pool.for_each(tasks, |t| {
        let (lo, hi) = (units * t / tasks, units * (t + 1) / tasks);
        for (j, (w, _)) in jobs.iter().enumerate() {
            // This task's units that fall inside weight j.
            let a = lo.max(first_unit[j]) - first_unit[j];
            let b = hi.min(first_unit[j + 1]).saturating_sub(first_unit[j]);
            if a >= b {
                continue;
            }
            let (n, k) = (w.rows, w.cols);
            let (start, end) = (a * ROW_UNIT, (b * ROW_UNIT).min(n));
            let row_bytes = w.row_bytes();
            // SAFETY: tasks write disjoint column ranges of each output; shapes checked above.
            unsafe {
                isa.kernel(
                    w.dtype,
                    x.as_ptr(),
                    k,
                    m,
                    w.bytes.as_slice().as_ptr().add(start * row_bytes),
                    row_bytes,
                    end - start,
                    k / GROUP,
                    outs[j].get().add(start),
                    n,
                );
            }
        }
    });
}

#[cfg(test)]
mod tests;
