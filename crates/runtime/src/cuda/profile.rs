//! Kernel time by class or by launch: a CUDA event recorded before and after every launch
//! while profiling is on (graphs are not used then, so every kernel is seen), summed per key
//! ([`ProfileKeys`]) when the profile is taken.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

/// How a profile groups its launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ProfileKeys {
    /// By kernel class: the launch's name up to its first space or `[` (`matmul`,
    /// `attention`, `rms_norm`).
    #[default]
    Class,
    /// By launch name with every run of digits written `N`, so that the layers' launches of
    /// one weight share a key (`matmul[blk.N.attn_q.weight]`).
    Name,
}

impl ProfileKeys {
    pub(crate) fn key(self, name: &str) -> String {
        match self {
            ProfileKeys::Class => name.split([' ', '[']).next().unwrap_or(name).to_string(),
            ProfileKeys::Name => {
                let mut k = String::with_capacity(name.len());
                let mut in_digits = false;
                for c in name.chars() {
                    let digit = c.is_ascii_digit();
                    if !digit {
                        k.push(c);
                    } else if !in_digits {
                        k.push('N');
                    }
                    in_digits = digit;
                }
                k
            }
        }
    }
}

/// GPU time of the launches of one profile key.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelClassTime {
    /// The key ([`ProfileKeys`]): a kernel class, or a launch name.
    pub class: String,
    pub launches: usize,
    /// Milliseconds between each launch's events, summed.
    pub ms: f64,
}

/// Events of the launches since profiling was turned on.
#[derive(Default)]
pub(crate) struct Profiler {
    keys: ProfileKeys,
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    open: Option<(String, CudaEvent)>,
}

fn timing_event(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap_or_else(|e| panic!("CUDA event creation failed: {e}"))
}

impl Profiler {
    pub fn new(keys: ProfileKeys) -> Self {
        Self {
            keys,
            ..Self::default()
        }
    }

    pub fn before(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream, name: &str) {
        let e = timing_event(ctx);
        if let Err(err) = e.record(stream) {
            panic!("CUDA event record failed: {err}");
        }
        self.open = Some((self.keys.key(name), e));
    }

    pub fn after(&mut self, stream: &CudaStream) {
        if let Some((class, start)) = self.open.take() {
            let end = timing_event(start.context());
            if let Err(err) = end.record(stream) {
                panic!("CUDA event record failed: {err}");
            }
            self.pending.push((class, start, end));
        }
    }

    /// Waits for the recorded launches and sums their times per class (largest first).
    pub fn take(&mut self) -> Vec<KernelClassTime> {
        let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
        for (class, start, end) in self.pending.drain(..) {
            let ms = start
                .elapsed_ms(&end)
                .unwrap_or_else(|e| panic!("CUDA event timing failed: {e}"));
            let slot = by.entry(class).or_default();
            slot.0 += 1;
            slot.1 += ms as f64;
        }
        let mut v: Vec<KernelClassTime> = by
            .into_iter()
            .map(|(class, (launches, ms))| KernelClassTime {
                class,
                launches,
                ms,
            })
            .collect();
        v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        v
    }
}

/// `DFLASH_CUDA_SKIP`'s launch names: comma-separated [`ProfileKeys::Name`] keys, blanks
/// around each dropped (unset or empty: none).
pub(crate) fn skip_list(v: Option<&str>) -> Vec<String> {
    v.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{skip_list, ProfileKeys};

    #[test]
    fn skip_lists_hold_launch_name_keys() {
        assert!(skip_list(None).is_empty());
        assert!(skip_list(Some(" , ")).is_empty());
        let s = skip_list(Some(
            "attention merge, matmul[blk.N.ffn_down.weight] ,quant_qN",
        ));
        assert_eq!(
            s,
            [
                "attention merge",
                "matmul[blk.N.ffn_down.weight]",
                "quant_qN"
            ]
        );
        // A launch is skipped when its name's key is listed.
        assert!(s.contains(&ProfileKeys::Name.key("matmul[blk.3.ffn_down.weight]")));
        assert!(!s.contains(&ProfileKeys::Name.key("matmul[blk.3.ffn_gate.weight]")));
    }

    #[test]
    fn keys_fold_layer_numbers_or_keep_the_class() {
        let name = "matmul[blk.12.ffn_down.weight]";
        assert_eq!(ProfileKeys::Class.key(name), "matmul");
        assert_eq!(ProfileKeys::Name.key(name), "matmul[blk.N.ffn_down.weight]");
        assert_eq!(ProfileKeys::Name.key("quant_q8 7 rows"), "quant_qN N rows");
        assert_eq!(ProfileKeys::Class.key("attention merge"), "attention");
        assert_eq!(ProfileKeys::Name.key("rms_norm"), "rms_norm");
    }
}
