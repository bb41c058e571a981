//! Kernel time by class: a CUDA event recorded before and after every launch while profiling
//! is on (graphs are not used then, so every kernel is seen), summed per kernel class when
//! the profile is taken.

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys as cu;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

/// GPU time of one kernel class.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelClassTime {
    /// The class: the launch's name up to its first space or `[` (e.g. `matmul`,
    /// `attention`, `rms_norm`).
    pub class: String,
    pub launches: usize,
    /// Milliseconds between each launch's events, summed.
    pub ms: f64,
}

/// Events of the launches since profiling was turned on.
#[derive(Default)]
pub(crate) struct Profiler {
    pending: Vec<(String, CudaEvent, CudaEvent)>,
    open: Option<(String, CudaEvent)>,
}

fn timing_event(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(cu::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap_or_else(|e| panic!("CUDA event creation failed: {e}"))
}

fn class_of(name: &str) -> String {
    name.split([' ', '[']).next().unwrap_or(name).to_string()
}

impl Profiler {
    pub fn before(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream, name: &str) {
        let e = timing_event(ctx);
        if let Err(err) = e.record(stream) {
            panic!("CUDA event record failed: {err}");
        }
        self.open = Some((class_of(name), e));
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
