//! CUDA graphs of model steps: the first call of a key runs eagerly (so that every buffer the
//! step needs is allocated), the second is captured and instantiated, later ones replay it.
//!
//! A graph holds the device addresses its kernels were launched with. Every reallocation of a
//! buffer kernels use bumps the device's epoch ([`Device::moved`]); graphs of an older epoch
//! are dropped and captured again. A capture that fails (an op that cannot be captured, or a
//! reallocation during the capture) marks its key as eager-only: correctness never depends
//! on a graph.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use cudarc::driver::sys as cu;
use cudarc::driver::CudaGraph;

use super::device::Device;
use crate::backend::GraphKey;

/// A graph owned by [`Graphs`], which is only reached through the backend's mutex.
struct OwnedGraph(CudaGraph);

// SAFETY: CUDA graph objects may be used from any thread as long as calls on one graph are
// serialized; every use goes through `Graphs`, which the backend keeps behind a mutex.
unsafe impl Send for OwnedGraph {}

enum Entry {
    /// Ran eagerly once.
    Seen,
    Ready(OwnedGraph),
    /// Capture failed: always eager.
    Eager,
}

/// The graphs of one backend.
pub(crate) struct Graphs {
    enabled: bool,
    epoch: u64,
    entries: HashMap<GraphKey, Entry>,
}

/// Most graphs kept (distinct step shapes); beyond it all are dropped and rebuilt on demand.
const MAX_GRAPHS: usize = 256;

impl Graphs {
    /// Graphs on, unless `DFLASH_CUDA_GRAPHS=0`.
    pub fn from_env() -> Result<Self, String> {
        let enabled = match std::env::var("DFLASH_CUDA_GRAPHS").as_deref() {
            Err(_) | Ok("1") | Ok("") => true,
            Ok("0") => false,
            Ok(v) => return Err(format!("DFLASH_CUDA_GRAPHS={v:?}: expected 0 or 1")),
        };
        Ok(Self {
            enabled,
            epoch: 0,
            entries: HashMap::new(),
        })
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Runs `f` for `key`: eagerly, by capture then replay, or by replay (see the module docs).
    pub fn run(&mut self, dev: &Device, key: GraphKey, f: &mut dyn FnMut()) {
        // A replay runs no host code: no int8 copy of x is known before or after it.
        dev.fresh_x.forget();
        self.run_step(dev, key, f);
        dev.fresh_x.forget();
    }

    fn run_step(&mut self, dev: &Device, key: GraphKey, f: &mut dyn FnMut()) {
        let epoch = dev.epoch.load(Ordering::Relaxed);
        if epoch != self.epoch || self.entries.len() >= MAX_GRAPHS {
            self.entries.clear();
            self.epoch = epoch;
        }
        match self.entries.get(&key) {
            Some(Entry::Ready(g)) => {
                if let Err(e) = g.0.launch() {
                    panic!("CUDA graph launch failed: {e}");
                }
            }
            Some(Entry::Eager) => f(),
            None => {
                f();
                // Whatever `f` allocated moved buffers: graphs captured before are stale.
                let now = dev.epoch.load(Ordering::Relaxed);
                if now != self.epoch {
                    self.entries.retain(|_, e| !matches!(e, Entry::Ready(_)));
                    self.epoch = now;
                }
                self.entries.insert(key, Entry::Seen);
            }
            Some(Entry::Seen) => {
                let entry = match capture(dev, f) {
                    Ok(g) if dev.epoch.load(Ordering::Relaxed) == epoch => {
                        if let Err(e) = g.launch() {
                            panic!("CUDA graph launch failed: {e}");
                        }
                        Entry::Ready(OwnedGraph(g))
                    }
                    Ok(_) => {
                        // A buffer moved while capturing: the graph may hold stale addresses
                        // and its work did not run. Run the step eagerly; capture again later.
                        f();
                        self.epoch = dev.epoch.load(Ordering::Relaxed);
                        Entry::Seen
                    }
                    Err(e) => {
                        tracing::warn!(
                            "CUDA graph capture failed ({e}); this step shape runs eagerly"
                        );
                        f();
                        Entry::Eager
                    }
                };
                self.entries.insert(key, entry);
            }
        }
    }
}

/// Captures the work `f` enqueues on the device's stream. A panic inside `f` (an op that
/// cannot be captured fails its launch) ends the capture and comes back as an error; the
/// caller then runs the step eagerly, where a real fault shows itself again.
fn capture(dev: &Device, f: &mut dyn FnMut()) -> Result<CudaGraph, String> {
    dev.stream
        .begin_capture(cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| format!("begin capture: {e}"))?;
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *f));
    let graph = dev
        .stream
        .end_capture(cu::CUgraphInstantiate_flags(0))
        .map_err(|e| format!("end capture: {e}"));
    if ran.is_err() {
        return Err("an op failed while being captured".into());
    }
    graph?.ok_or_else(|| "the capture recorded no work".to_string())
}
