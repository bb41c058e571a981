//! The CPU's uploaded weight: the stored weight, plus its int8 repacking when its path uses
//! int8 activations, or its greedy screen (`argmax_screen`).

use std::sync::Arc;

use super::argmax_screen::ArgmaxScreen;
use super::huge::HugeBytes;
use super::int8::pack::PackedWeight;
use super::int8::quantize::Terms;
use super::int8::Int8Kernel;
use crate::weight::{HostWeight, WeightBytes};

/// A weight on the CPU backend.
#[derive(Clone, Debug)]
pub struct CpuWeight {
    /// The stored form (read by the f32 kernels and by embedding lookups).
    pub host: HostWeight,
    /// Set when products use int8 activations.
    pub int8: Option<Arc<Int8Weight>>,
    /// Set when products read only for a greedy choice are screened with int8 activations.
    pub screen: Option<Arc<ArgmaxScreen>>,
}

/// A weight repacked for one int8 kernel family.
#[derive(Debug)]
pub struct Int8Weight {
    pub packed: PackedWeight,
    pub kernel: Int8Kernel,
    /// Int8 rows per activation row.
    pub terms: Terms,
}

impl CpuWeight {
    /// A weight on the f32 path.
    pub fn f32(host: HostWeight) -> Self {
        Self {
            host,
            int8: None,
            screen: None,
        }
    }
}

/// A copy of `w` whose bytes live on huge pages (see `huge`), as the backend stores the
/// matrices the f32 kernels stream; the microbench times the same layout.
pub fn on_huge_pages(w: &HostWeight) -> HostWeight {
    let bytes = HugeBytes::copy_of(w.bytes.as_slice());
    let len = bytes.as_slice().len();
    HostWeight {
        bytes: WeightBytes::new(Arc::new(bytes), 0..len),
        ..w.clone()
    }
}
