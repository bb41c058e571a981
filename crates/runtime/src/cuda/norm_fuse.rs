//! The RMS norm of a few rows as the prologue of the int8 product that reads it
//! (`mmqn_*`, `mmqsn_*`; kernels/matmul_norm.cu), so a decode step launches no norm before
//! its q/k/v and gate/up products.
//!
//! `rms_norm` with an int8 copy of at most `SQ_MAX_MT` rows of at most
//! [`CudaOptions::norm_fuse_max_k`](super::CudaOptions) values into a separate output does not
//! launch: it leaves a [`PendingNorm`] with the device. The next int8 product on the dp4a
//! kernels whose x is exactly that output takes it ([`DeferredNorm::take_for`]) and normalises
//! x in its own prologue, with the norm kernel's arithmetic and order, so its results, the
//! normalised rows and their int8 copy have the norm launch's bits. Anything else the device
//! is asked to do first — any launch, copy, allocation, synchronisation, the end of a graph
//! step — launches the pending norm as it would have been ([`Device::flush_norm`]), so the
//! stream's order of effects never changes.

use std::sync::Mutex;

use super::device::{int, long, Arg, Device, NORM_Q_FEW_THREADS};
use super::int8_x::QuantizedX;
use crate::quant::GROUP;

/// The widest x normalised in a product's prologue by default: every product block makes the
/// whole norm of its rows (K / 16 dependent adds per row on its critical path), which pays
/// for the default model's 576 values a row and is not measured to pay for wider rows.
pub const NORM_FUSE_MAX_K: usize = 1024;

/// Dynamic shared memory of a fused product's block (mm_norm_regions in matmul_norm.cu): x
/// as f32 for `mt` rows, the weight, the codes and the (d, ds) pairs.
pub(crate) fn mm_norm_smem_bytes(mt: usize, k: usize) -> usize {
    4 * mt * k + 4 * k + mt * k + 8 * mt * (k / GROUP)
}

/// The most dynamic shared memory a fused product's block may ask for without raising the
/// kernel's limit.
pub(crate) const MM_NORM_SMEM_MAX: usize = 48 * 1024;

/// `DFLASH_CUDA_NORM_FUSE`: `auto` (or unset, empty) [`NORM_FUSE_MAX_K`], `0` / `off` never,
/// or the widest x.
pub fn norm_fuse_max_k(v: Option<&str>) -> Result<usize, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(NORM_FUSE_MAX_K),
        Some("off") => Ok(0),
        Some(s) => s.parse().map_err(|_| {
            format!("DFLASH_CUDA_NORM_FUSE={s:?}: expected `auto`, `0`/`off` or the widest row")
        }),
    }
}

/// A quantizing RMS norm (`rms_norm_q8_few_f32`) not launched yet: `rows` rows of `dim` values
/// at `x`, normalised into `out` (never `x`), its int8 copy into `codes` / `pairs`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PendingNorm {
    pub x: u64,
    pub out: u64,
    pub weight: u64,
    pub rows: usize,
    pub dim: usize,
    pub eps: f32,
    pub zero_centred: bool,
    pub codes: u64,
    pub pairs: u64,
}

impl PendingNorm {
    /// The int8 copy the norm writes.
    pub fn copy(&self) -> QuantizedX {
        QuantizedX {
            x: self.out,
            rows: self.rows,
            k: self.dim,
            codes: self.codes,
            pairs: self.pairs,
        }
    }
}

/// The device's one pending norm.
#[derive(Default)]
pub(crate) struct DeferredNorm(Mutex<Option<PendingNorm>>);

impl DeferredNorm {
    /// Leaves `n` pending (the caller flushed any earlier one).
    pub fn defer(&self, n: PendingNorm) {
        let mut slot = self.0.lock().expect("deferred norm lock");
        assert!(slot.is_none(), "a norm is already pending");
        *slot = Some(n);
    }

    /// The pending norm, taken, when its output is the `m` rows of `k` values at `x`.
    pub fn take_for(&self, x: u64, m: usize, k: usize) -> Option<PendingNorm> {
        let mut slot = self.0.lock().expect("deferred norm lock");
        match *slot {
            Some(n) if n.out == x && n.rows == m && n.dim == k => slot.take(),
            _ => None,
        }
    }

    fn take(&self) -> Option<PendingNorm> {
        self.0.lock().expect("deferred norm lock").take()
    }
}

impl Device {
    /// Launches the pending norm, if any, as `rms_norm` would have (and notes its int8 copy).
    pub fn flush_norm(&self) {
        let Some(n) = self.norm.take() else { return };
        let args = [
            Arg::Ptr(n.x),
            Arg::Ptr(n.out),
            Arg::Ptr(n.weight),
            long(n.rows),
            int(n.dim),
            Arg::F32(n.eps),
            int(n.zero_centred as usize),
            Arg::Ptr(n.codes),
            Arg::Ptr(n.pairs),
        ];
        self.launch(
            &self.k.rms_norm_q8_few,
            "rms_norm q8",
            (n.rows as u32, 1, 1),
            (NORM_Q_FEW_THREADS, 1, 1),
            0,
            &args,
        );
        self.fresh_x.note(n.copy());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setting_parses() {
        assert_eq!(norm_fuse_max_k(None), Ok(NORM_FUSE_MAX_K));
        assert_eq!(norm_fuse_max_k(Some(" auto ")), Ok(NORM_FUSE_MAX_K));
        assert_eq!(norm_fuse_max_k(Some("0")), Ok(0));
        assert_eq!(norm_fuse_max_k(Some("off")), Ok(0));
        assert_eq!(norm_fuse_max_k(Some("4096")), Ok(4096));
        assert!(norm_fuse_max_k(Some("yes"))
            .unwrap_err()
            .contains("DFLASH_CUDA_NORM_FUSE"));
    }

    #[test]
    fn smem_fits_the_default_widths() {
        // Four rows of the widest default x fit without raising the kernels' limit.
        assert!(mm_norm_smem_bytes(4, NORM_FUSE_MAX_K) <= MM_NORM_SMEM_MAX);
        // One row of 576: x, weight, codes, 18 pairs.
        assert_eq!(mm_norm_smem_bytes(1, 576), 2304 + 2304 + 576 + 144);
    }

    #[test]
    fn only_the_norms_own_output_takes_it() {
        let d = DeferredNorm::default();
        let n = PendingNorm {
            x: 0x1000,
            out: 0x2000,
            weight: 0x3000,
            rows: 2,
            dim: 64,
            eps: 1e-5,
            zero_centred: false,
            codes: 0x4000,
            pairs: 0x4080,
        };
        d.defer(n);
        // Its input, another row count, another width, a row inside it.
        assert_eq!(d.take_for(0x1000, 2, 64), None);
        assert_eq!(d.take_for(0x2000, 1, 64), None);
        assert_eq!(d.take_for(0x2000, 2, 32), None);
        assert_eq!(d.take_for(0x2100, 1, 64), None);
        assert_eq!(d.take_for(0x2000, 2, 64), Some(n));
        assert_eq!(d.take_for(0x2000, 2, 64), None);
        assert_eq!(n.copy().rows_at(0x2000, 2, 64), Some((0x4000, 0x4080)));
    }
}
