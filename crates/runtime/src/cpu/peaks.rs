//! The machine's measured limits, for the microbench to compare kernels against: streaming
//! read bandwidth, the f32 FMA peak and the int8 dot-product peak, over all pool workers.

use std::hint::black_box;
use std::time::Instant;

use super::int8::Int8Kernel;
use super::matmul::Isa;
use super::pool::CpuPool;

/// Measured peaks (`None` where this CPU has no instruction for it).
#[derive(Clone, Copy, Debug)]
pub struct Peaks {
    /// Streaming read bandwidth, GB/s (10⁹ bytes), of a buffer far larger than the caches.
    pub read_gb_s: f64,
    /// f32 fused multiply-adds, GFLOP/s (2 per lane per FMA).
    pub fma_gflop_s: f64,
    /// int8 multiply-accumulates in the int8 kernels' dot instruction, GOP/s (2 per byte pair);
    /// for the AMX family that of its one-row kernel, `vpdpbusd` (tile products go past it).
    pub int8_gop_s: Option<f64>,
}

/// Best of `reps` timings of `f`, in seconds.
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Measures the peaks with `pool`'s workers (`mib` MiB for the bandwidth test).
pub fn measure(pool: &CpuPool, isa: Isa, int8: Option<Int8Kernel>, mib: usize) -> Peaks {
    let words = mib * (1 << 20) / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let threads = pool.threads();
    let read = || {
        pool.for_each(threads, |t| {
            let chunk = &buf[words * t / threads..words * (t + 1) / threads];
            // Eight independent sums: the loop vectorizes and is bound by the loads.
            let mut acc = [0u64; 8];
            for c in chunk.chunks_exact(8) {
                for (a, v) in acc.iter_mut().zip(c) {
                    *a = a.wrapping_add(*v);
                }
            }
            black_box(acc);
        })
    };
    read();
    let read_s = best_of(5, read);
    const ITERS: usize = 1 << 22;
    let fma = || {
        pool.for_each(threads, |_| {
            black_box(fma_loop(isa, ITERS));
        })
    };
    fma();
    let fma_s = best_of(5, fma);
    let fma_flops = (threads * ITERS * ACCS * 2 * isa.lanes()) as f64;
    let int8_gop_s = int8.map(|k| {
        let dot = || {
            pool.for_each(threads, |_| {
                black_box(dot_loop(k, ITERS));
            })
        };
        dot();
        let s = best_of(5, dot);
        (threads * ITERS * ACCS * 2 * dot_bytes(k)) as f64 / s / 1e9
    });
    Peaks {
        read_gb_s: (words * 8) as f64 / read_s / 1e9,
        fma_gflop_s: fma_flops / fma_s / 1e9,
        int8_gop_s,
    }
}

/// Independent accumulators per loop (enough to cover the instructions' latency).
const ACCS: usize = 8;

/// Byte pairs one dot instruction multiplies.
fn dot_bytes(k: Int8Kernel) -> usize {
    match k {
        Int8Kernel::Amx | Int8Kernel::Avx512Vnni => 64,
        Int8Kernel::AvxVnni | Int8Kernel::Avx2 => 32,
        Int8Kernel::NeonDot => 16,
    }
}

/// `iters` rounds of `ACCS` independent FMAs of `isa`'s width; returns a value to keep.
fn fma_loop(isa: Isa, iters: usize) -> f32 {
    match isa {
        // SAFETY: the instruction set is the pool's, which the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::fma512(iters) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::fma256(iters) },
        _ => {
            let mut acc = [1f32; ACCS];
            for _ in 0..iters {
                for a in acc.iter_mut() {
                    *a = a.mul_add(0.999_999, 1e-7);
                }
            }
            acc.iter().sum::<f32>() * (isa.lanes() as f32)
        }
    }
}

/// `iters` rounds of `ACCS` independent dot instructions of `k`; returns a value to keep.
fn dot_loop(k: Int8Kernel, iters: usize) -> i32 {
    // SAFETY: `k` is usable, so the CPU has its instructions.
    match k {
        #[cfg(target_arch = "x86_64")]
        Int8Kernel::Amx | Int8Kernel::Avx512Vnni => unsafe { x86::vnni512(iters) },
        #[cfg(target_arch = "x86_64")]
        Int8Kernel::AvxVnni => unsafe { x86::vnni256(iters) },
        #[cfg(target_arch = "x86_64")]
        Int8Kernel::Avx2 => unsafe { x86::maddubs(iters) },
        #[cfg(target_arch = "aarch64")]
        Int8Kernel::NeonDot => unsafe { arm::sdot(iters) },
        #[allow(unreachable_patterns)]
        _ => 0,
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::ACCS;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: usize) -> f32 {
        let mut acc = [_mm512_set1_ps(1.0); ACCS];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); ACCS];
        let (a, b) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut out = [0f32; 8];
        let mut s = 0.0;
        for v in acc {
            _mm256_storeu_ps(out.as_mut_ptr(), v);
            s += out.iter().sum::<f32>();
        }
        s
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn vnni512(iters: usize) -> i32 {
        let mut acc = [_mm512_setzero_si512(); ACCS];
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm512_dpbusd_epi32(*v, a, b);
            }
        }
        acc.iter().map(|v| _mm512_reduce_add_epi32(*v)).sum()
    }

    #[target_feature(enable = "avxvnni,avx2")]
    pub unsafe fn vnni256(iters: usize) -> i32 {
        let mut acc = [_mm256_setzero_si256(); ACCS];
        let (a, b) = (_mm256_set1_epi8(3), _mm256_set1_epi8(-2));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = _mm256_dpbusd_avx_epi32(*v, a, b);
            }
        }
        acc.iter().map(|v| _mm256_extract_epi32::<0>(*v)).sum()
    }

    /// `vpmaddubsw` + `vpmaddwd` + add: the AVX2 kernels' 32-pair dot.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs(iters: usize) -> i32 {
        let mut acc = [_mm256_setzero_si256(); ACCS];
        let (a, b, ones) = (
            _mm256_set1_epi8(3),
            _mm256_set1_epi8(-2),
            _mm256_set1_epi16(1),
        );
        for _ in 0..iters {
            for v in acc.iter_mut() {
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones);
                *v = _mm256_add_epi32(*v, p);
            }
        }
        acc.iter().map(|v| _mm256_extract_epi32::<0>(*v)).sum()
    }
}

#[cfg(target_arch = "aarch64")]
mod arm {
    use super::ACCS;
    use std::arch::aarch64::*;

    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn sdot(iters: usize) -> i32 {
        let mut acc = [vdupq_n_s32(0); ACCS];
        let (a, b) = (vdupq_n_s8(3), vdupq_n_s8(-2));
        for _ in 0..iters {
            for v in acc.iter_mut() {
                let mut x = *v;
                std::arch::asm!(
                    ".arch_extension dotprod",
                    "sdot {x:v}.4s, {a:v}.16b, {b:v}.16b",
                    x = inout(vreg) x,
                    a = in(vreg) a,
                    b = in(vreg) b,
                    options(pure, nomem, nostack, preserves_flags),
                );
                *v = x;
            }
        }
        acc.iter().map(|v| vaddvq_s32(*v)).sum()
    }
}
