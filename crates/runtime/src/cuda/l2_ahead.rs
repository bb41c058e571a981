//! Weights ahead into L2. The model names the weights that the launches after its next
//! attention or product read ([`Backend::weights_ahead`](crate::Backend::weights_ahead): the
//! llama layer names o, gate and up before attention, down before the gate/up product, the
//! next layer's q/k/v before down); that launch, before it waits for the kernel before it,
//! asks each SM's copy engine to bring them into L2 (`df_l2_ahead`, common.cu), so HBM streams
//! them while the step is busy with dependent, latency-bound work, and the products read them
//! from L2 (a quarter faster at one row of x for Qwen3-4B's shapes on an H100). Up to
//! [`L2A_RANGES`] weights, in the order named, cut to a byte budget (`DFLASH_CUDA_L2_AHEAD`,
//! by default a quarter of the L2: on an H100 the default model's decode step −2 % and its
//! verify of 16 −2.5 %, the 4B's level; half the L2 or more made the 4B's step 1–3 % slower,
//! docs/benchmarks/2026-12-08-h100-l2-ahead.md). A hint only: no result depends on it.

use std::sync::Mutex;

/// Most weights one launch brings ahead (L2A_RANGES in common.cu).
pub const L2A_RANGES: usize = 4;

/// The L2 cache's share brought ahead by one launch by default (1 / 4).
pub const L2A_AUTO_SHARE: usize = 4;

/// Bytes per prefetch request (L2A_CHUNK in common.cu; a multiple of 16).
pub const L2A_CHUNK: usize = 8 << 10;

/// `L2Ahead` in common.cu: byte ranges, 16-byte aligned, lengths multiples of 16 (zero: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct L2Ahead {
    base: [u64; L2A_RANGES],
    bytes: [u64; L2A_RANGES],
}

/// The weights named since the last launch that took them, as (device address, bytes).
#[derive(Default)]
pub(crate) struct PendingAhead(Mutex<Vec<(u64, usize)>>);

impl PendingAhead {
    /// Replaces what is pending with `ranges`.
    pub fn name(&self, ranges: impl IntoIterator<Item = (u64, usize)>) {
        let mut p = self.0.lock().expect("l2 ahead lock");
        p.clear();
        p.extend(ranges);
    }

    /// Takes what is pending: the first [`L2A_RANGES`] ranges in order, the bytes cut to
    /// `budget` in all and each length rounded down to 16 (the request's unit).
    pub fn take(&self, budget: usize) -> L2Ahead {
        let mut pending = self.0.lock().expect("l2 ahead lock");
        let mut a = L2Ahead::default();
        let mut left = budget;
        // Drained, not moved out: the list keeps its capacity for the next naming.
        for (i, (base, bytes)) in pending.drain(..).take(L2A_RANGES).enumerate() {
            let n = bytes.min(left) & !15;
            if base % 16 != 0 || n == 0 {
                continue;
            }
            a.base[i] = base;
            a.bytes[i] = n as u64;
            left -= n;
        }
        a
    }
}

/// `DFLASH_CUDA_L2_AHEAD`: `auto` (or unset, empty; `None`: [`L2A_AUTO_SHARE`] of the
/// device's L2 cache), `0` / `off` none, or a budget in MiB.
pub fn l2_ahead_setting(v: Option<&str>) -> Result<Option<usize>, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(None),
        Some("off") => Ok(Some(0)),
        Some(s) => s
            .parse::<usize>()
            .ok()
            .and_then(|mb| mb.checked_mul(1 << 20))
            .map(Some)
            .ok_or_else(|| {
                format!("DFLASH_CUDA_L2_AHEAD={s:?}: expected auto, 0 / off or a budget in MiB")
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_setting_parses() {
        assert_eq!(l2_ahead_setting(None), Ok(None));
        assert_eq!(l2_ahead_setting(Some(" auto ")), Ok(None));
        assert_eq!(l2_ahead_setting(Some("off")), Ok(Some(0)));
        assert_eq!(l2_ahead_setting(Some("0")), Ok(Some(0)));
        assert_eq!(l2_ahead_setting(Some("36")), Ok(Some(36 << 20)));
        assert!(l2_ahead_setting(Some("lots"))
            .unwrap_err()
            .contains("DFLASH_CUDA_L2_AHEAD"));
        // A budget whose bytes overflow is refused, not wrapped.
        assert!(l2_ahead_setting(Some(&usize::MAX.to_string()))
            .unwrap_err()
            .contains("DFLASH_CUDA_L2_AHEAD"));
    }

    #[test]
    fn take_cuts_to_the_budget_in_order_and_empties() {
        let p = PendingAhead::default();
        p.name([
            (256, 1000),
            (4096, 5000),
            (8192, 100),
            (16384, 64),
            (32768, 64),
        ]);
        let a = p.take(3000);
        // 1000 → 992; 5000 cut to the 2008 left → 2000; the rest has no budget left.
        assert_eq!(a.base, [256, 4096, 0, 0]);
        assert_eq!(a.bytes, [992, 2000, 0, 0]);
        assert_eq!(p.take(3000), L2Ahead::default());
    }

    #[test]
    fn take_keeps_at_most_the_launch_ranges_and_skips_misaligned() {
        let p = PendingAhead::default();
        p.name([(256, 64), (8, 64), (512, 64), (1024, 64), (2048, 64)]);
        let a = p.take(usize::MAX);
        assert_eq!(a.base, [256, 0, 512, 1024]);
        assert_eq!(a.bytes, [64, 0, 64, 64]);
    }
}
