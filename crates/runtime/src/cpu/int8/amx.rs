//! AMX int8 kernels (Intel Advanced Matrix Extensions) for products of several x rows.
//!
//! One `tdpbsud` multiplies a tile of up to 16 rows' activation codes for one 32-value block
//! (signed bytes, `rows x 32`) with that block of a packed panel (unsigned weight codes,
//! 8 rows of 64 bytes: the panel's chunk layout as it is) and yields the exact integer dots
//! of every x row with the panel's 16 weight rows. Q8_0 blocks are loaded straight from the
//! panel; Q4 blocks are first split into nibbles (the VNNI kernel's operands) in a ring of
//! 512-byte buffers, a few blocks ahead. Two blocks are in flight on separate tiles. The
//! dots are stored and each row's enter its f32 accumulator through the VNNI kernel's own
//! float step (`avx512::accumulate`), so the bits are the VNNI kernel's and the reference's
//! for every M. Fewer than [`MIN_ROWS`] rows run the VNNI kernel, which is faster there: a
//! tile product costs about as much whatever its rows, so few rows do not pay for it.
//!
//! The tiles need the OS's consent: on Linux the process asks once for the tile data state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); where that is refused the family is not offered.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512::{accumulate, operands, q4_1_mins, scales, store_rows, x_rows_at};
use super::pack::{Int8Format, PANEL};
use super::Job;

/// Fewer x rows than this run the AVX-512-VNNI kernel. Measured on a 2.6 GHz Xeon with AMX
/// (576 x 49,152 Q4_1, one thread, weights streamed from L3; cost against one row): tiles
/// 1.20x, 1.34x at 2 and 4 rows against VNNI's 1.03x, 1.25x; at 8 rows 1.76x-2.17x against
/// 1.91x-1.94x depending on the run, at 16 rows 2.84x-3.32x against 3.77x
/// (docs/benchmarks/2026-12-02-cpu-verify-rows.md).
pub const MIN_ROWS: usize = 8;

/// Most x rows per tile product (an AMX tile has 16 rows).
const TILE_ROWS: usize = 16;

/// True when the CPU has AMX-TILE and AMX-INT8 and the OS lets this process use the tiles
/// (checked and asked once per process).
pub fn usable() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx_int8() && os_grants_tiles())
}

fn cpu_has_amx_int8() -> bool {
    // CPUID leaf 7, sub-leaf 0, EDX: bit 24 AMX-TILE, bit 25 AMX-INT8.
    let top = __cpuid(0).eax;
    if top < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 25) != 0
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: the system call only grants this process the tile data state; it reads and
    // writes no memory of ours.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        )
    };
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// A tile configuration (palette 1) for `rows` x rows and two blocks in flight: tmm0/tmm3
/// the dots (`rows x 16` i32), tmm1/tmm4 one block's activation codes (`rows x 32` i8),
/// tmm2/tmm5 one block's weight operands (8 rows of 64 bytes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn for_rows(rows: usize) -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        for set in [0usize, 3] {
            for (t, r, bytes) in [(set, rows, 64u16), (set + 1, rows, 32), (set + 2, 8, 64)] {
                c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
                c[48 + t] = r as u8;
            }
        }
        TileConfig(c)
    }
}

/// Blocks whose Q4 operands are written ahead of their tile product: a tile load of bytes
/// still in the store buffer waits until they reach the cache (about 20 ns a block here).
const AHEAD: usize = 4;
/// Operand buffers in the ring (more than `AHEAD` plus the two blocks in flight).
const RING: usize = 8;

/// Per-thread buffers of a product: a ring of unpacked Q4 operands, and two blocks' dots.
#[repr(C, align(64))]
struct Scratch {
    operands: [[u8; 512]; RING],
    dots: [[i32; TILE_ROWS * PANEL]; 2],
}

/// Writes the operands of block `g` (if any) to its ring slot.
#[inline(always)]
unsafe fn unpack<const F: u8>(blk0: *const u8, g: usize, kb: usize, scratch: &mut Scratch) {
    if g < kb {
        let blk = blk0.add(g * super::format_of(F).block_bytes());
        let slot = scratch.operands[g % RING].as_mut_ptr();
        for (t, w) in operands::<F>(blk).into_iter().enumerate() {
            _mm512_store_si512(slot.add(64 * t) as *mut __m512i, w);
        }
    }
}

#[inline(always)]
unsafe fn tile<const F: u8, const MR: usize>(
    job: &Job,
    blk0: *const u8,
    i0: usize,
    col: usize,
    scratch: &mut Scratch,
) {
    let format = super::format_of(F);
    let q4 = format != Int8Format::Q8_0;
    let bb = format.block_bytes();
    let x = job.x;
    let kb = x.blocks();
    debug_assert!((i0 + MR) * kb <= x.d.len() && (i0 + MR) * x.k <= x.q.len());
    let (q0, d0, sum0, ds0) = x_rows_at(x, i0);
    // Where the tile of block `g` loads its weight operands from.
    let b_of = |s: &Scratch, g: usize| -> *const u8 {
        if q4 {
            s.operands[g % RING].as_ptr()
        } else {
            blk0.add(g * bb)
        }
    };
    let mut acc = [_mm512_setzero_ps(); MR];
    // Block `g`'s dots (stored at `dots`) enter every row's accumulator, in block order.
    // A macro, not a closure: closures do not get the caller's target features.
    macro_rules! epilogue {
        ($g:expr, $dots:expr) => {{
            let (g, dots) = ($g, $dots);
            let blk = blk0.add(g * bb);
            let (dw, mw) = (scales::<F>(blk), q4_1_mins::<F>(blk));
            for (r, a) in acc.iter_mut().enumerate() {
                let bi = r * kb + g;
                let dot = _mm512_load_si512(dots.add(PANEL * r) as *const __m512i);
                *a = accumulate::<F>(*a, dot, dw, mw, *d0.add(bi), *sum0.add(bi), *ds0.add(bi));
            }
        }};
    }
    if q4 {
        for g in 0..AHEAD {
            unpack::<F>(blk0, g, kb, scratch);
        }
    }
    let (dots0, dots1) = (scratch.dots[0].as_mut_ptr(), scratch.dots[1].as_mut_ptr());
    let mut g = 0;
    while g < kb {
        if q4 {
            unpack::<F>(blk0, g + AHEAD, kb, scratch);
            unpack::<F>(blk0, g + AHEAD + 1, kb, scratch);
        }
        if g + 1 < kb {
            // Two blocks in flight on separate tiles: exact i32 dots, stored row by row.
            asm!(
                "tilezero tmm0",
                "tilezero tmm3",
                "tileloadd tmm1, [{a0} + {a_stride} * 1]",
                "tileloadd tmm2, [{b0} + {b_stride} * 1]",
                "tileloadd tmm4, [{a1} + {a_stride} * 1]",
                "tileloadd tmm5, [{b1} + {b_stride} * 1]",
                "tdpbsud tmm0, tmm1, tmm2",
                "tdpbsud tmm3, tmm4, tmm5",
                "tilestored [{c0} + {c_stride} * 1], tmm0",
                "tilestored [{c1} + {c_stride} * 1], tmm3",
                a0 = in(reg) q0.add(g * 32),
                a1 = in(reg) q0.add(g * 32 + 32),
                a_stride = in(reg) x.k,
                b0 = in(reg) b_of(scratch, g),
                b1 = in(reg) b_of(scratch, g + 1),
                b_stride = in(reg) 64usize,
                c0 = in(reg) dots0,
                c1 = in(reg) dots1,
                c_stride = in(reg) 4 * PANEL,
                options(nostack),
            );
            epilogue!(g, dots0);
            epilogue!(g + 1, dots1);
            g += 2;
        } else {
            asm!(
                "tilezero tmm0",
                "tileloadd tmm1, [{a0} + {a_stride} * 1]",
                "tileloadd tmm2, [{b0} + {b_stride} * 1]",
                "tdpbsud tmm0, tmm1, tmm2",
                "tilestored [{c0} + {c_stride} * 1], tmm0",
                a0 = in(reg) q0.add(g * 32),
                a_stride = in(reg) x.k,
                b0 = in(reg) b_of(scratch, g),
                b_stride = in(reg) 64usize,
                c0 = in(reg) dots0,
                c_stride = in(reg) 4 * PANEL,
                options(nostack),
            );
            epilogue!(g, dots0);
            g += 1;
        }
    }
    store_rows(job, &acc, i0, col);
}

#[inline(always)]
unsafe fn run_format<const F: u8>(job: &Job) {
    let m = job.x.m;
    let mut scratch = Scratch {
        operands: [[0; 512]; RING],
        dots: [[0; TILE_ROWS * PANEL]; 2],
    };
    let mut configured = 0;
    let mut i0 = 0;
    while i0 < m {
        let mr = (m - i0).min(TILE_ROWS);
        if mr != configured {
            let config = TileConfig::for_rows(mr);
            asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
            configured = mr;
        }
        for p in job.panels.clone() {
            let (blk0, col) = (job.w.panel_ptr(p), p * PANEL);
            macro_rules! go {
                ($($mr:literal),*) => {
                    match mr {
                        $($mr => tile::<F, $mr>(job, blk0, i0, col, &mut scratch),)*
                        _ => unreachable!("tiles have 1 to 16 rows"),
                    }
                };
            }
            go!(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16);
        }
        i0 += mr;
    }
    asm!("tilerelease", options(nostack, nomem));
}

/// Runs `job` on tile products whatever its row count (the tests' way to reach every M).
///
/// # Safety
/// [`usable`] must hold, the CPU must support AVX-512F/BW/VNNI and F16C, and `job` must
/// describe valid buffers.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn run_tiles(job: &Job) {
    match job.w.format {
        Int8Format::Q4_0 => run_format::<0>(job),
        Int8Format::Q4_1 => run_format::<1>(job),
        Int8Format::Q8_0 => run_format::<2>(job),
    }
}

/// Runs `job` (see [`Job`]): tile products from [`MIN_ROWS`] x rows, the VNNI kernel below.
///
/// # Safety
/// As [`run_tiles`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
pub unsafe fn run(job: &Job) {
    if job.x.m < MIN_ROWS {
        super::avx512::run(job)
    } else {
        run_tiles(job)
    }
}
