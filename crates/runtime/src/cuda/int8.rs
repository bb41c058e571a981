//! Which weights multiply int8-quantized activations on the GPU (`DFLASH_CUDA_INT8`), and which
//! formats have the int8 kernels.

use super::device::rows_setting;
use crate::cpu::int8::pack::Int8Format;
use crate::dtype::DType;

/// Which of the target's projections (Q4_0, Q4_1 or Q8_0, at least `PANEL` rows, as on the CPU)
/// multiply int8-quantized activations (`quant_q8_f32`, then the `mmq_*` kernels: dp4a);
/// `DFLASH_CUDA_INT8` = `auto` (default), `1` or `0`. Fixed per weight at upload, so every
/// product with a weight, whatever M, takes one path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Policy {
    /// None: f32 activations everywhere.
    Off,
    /// Q4_0 and Q4_1 projections with at least [`INT8_MIN_K`] inputs. (Q8_0 stays on f32: on the
    /// Qwen3-4B shapes its int8 M = 1 products are slower for three of six shapes.)
    Auto,
    /// Every eligible projection.
    All,
}

/// The smallest inner dimension `Int8Policy::Auto` gives int8 activations. Measured on the
/// H200 (docs/benchmarks/2026-12-01-h200-int8-activations.md, 2026-12-02-h200-int8-handoff.md):
/// on the Qwen3-4B shapes (K 2560 and 9728, Q4_0) int8 cuts a 16-token verify from 4.6 to 2.9
/// decode steps and decode is faster; on the default model's (K 576 and 1536) int8 decodes as
/// fast as f32 once the norm and the attention merge hand int8 x on, but its greedy tokens part
/// from the CPU's int8 tokens more than the f32 path's part from the CPU's f32 tokens.
pub const INT8_MIN_K: usize = 2048;

impl Int8Policy {
    /// Whether an eligible projection stored as `dtype` with `k` inputs takes int8 activations.
    pub fn takes(self, dtype: DType, k: usize) -> bool {
        match self {
            Int8Policy::Off => false,
            Int8Policy::Auto => k >= INT8_MIN_K && dtype != DType::Q8_0,
            Int8Policy::All => true,
        }
    }
}

impl std::str::FromStr for Int8Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "auto" => Ok(Int8Policy::Auto),
            "1" | "on" => Ok(Int8Policy::All),
            "0" | "off" => Ok(Int8Policy::Off),
            v => Err(format!("DFLASH_CUDA_INT8={v:?}: expected auto, 1 or 0")),
        }
    }
}

/// The fewest rows of x that take the int8 tensor-core kernels by default
/// (`DFLASH_CUDA_INT8_MMA`). Their time hardly grows with M, the dp4a kernels' does; on the
/// H200 (Qwen3-4B shapes, docs/benchmarks/2026-12-01-h200-int8-mma.md) dp4a is as fast or
/// faster up to 8 rows (one tile of 8), the tensor cores faster from 9 (two tiles of 8).
pub const INT8_MMA_MIN_M: usize = 9;

/// The fewest rows of x whose int8 products run on integer tensor cores, from the value of
/// `DFLASH_CUDA_INT8_MMA` (unset, empty or `auto`: [`INT8_MMA_MIN_M`]; `0` or `off`: never, as
/// `usize::MAX`; else a row count of at least 1).
pub fn int8_mma_min_rows(v: Option<&str>) -> Result<usize, String> {
    rows_setting("DFLASH_CUDA_INT8_MMA", v, INT8_MMA_MIN_M)
}

/// Whether format `d` has int8-activation kernels (`mmq_*`, built with `DF_MM_INT8`): the
/// formats of the CPU's int8 kernels.
pub(crate) fn int8_format(d: DType) -> bool {
    Int8Format::of(d).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaOptions;

    #[test]
    fn int8_policy_parses_and_gates_by_inner_dimension() {
        assert_eq!("".parse(), Ok(Int8Policy::Auto));
        assert_eq!("auto".parse(), Ok(Int8Policy::Auto));
        assert_eq!("1".parse(), Ok(Int8Policy::All));
        assert_eq!("0".parse(), Ok(Int8Policy::Off));
        let bad = "yes".parse::<Int8Policy>().unwrap_err();
        assert!(
            bad.contains("DFLASH_CUDA_INT8") && bad.contains("auto, 1 or 0"),
            "{bad}"
        );
        // The default model's projections (K 576, 1536) stay on f32; Qwen3-4B's (2560, 9728)
        // take int8.
        for k in [576, 1536] {
            assert!(!Int8Policy::Auto.takes(DType::Q4_1, k));
            assert!(Int8Policy::All.takes(DType::Q4_1, k));
        }
        for k in [2560, 9728] {
            assert!(Int8Policy::Auto.takes(DType::Q4_0, k));
            assert!(Int8Policy::Auto.takes(DType::Q4_1, k));
            assert!(!Int8Policy::Auto.takes(DType::Q8_0, k));
            assert!(Int8Policy::All.takes(DType::Q8_0, k));
            assert!(!Int8Policy::Off.takes(DType::Q4_0, k));
        }
        assert_eq!(CudaOptions::default().int8, Int8Policy::Auto);
    }

    #[test]
    fn int8_mma_rows_parse() {
        assert_eq!(int8_mma_min_rows(None), Ok(INT8_MMA_MIN_M));
        assert_eq!(int8_mma_min_rows(Some("auto")), Ok(INT8_MMA_MIN_M));
        assert_eq!(int8_mma_min_rows(Some(" 0 ")), Ok(usize::MAX));
        assert_eq!(int8_mma_min_rows(Some("off")), Ok(usize::MAX));
        assert_eq!(int8_mma_min_rows(Some("1")), Ok(1));
        assert_eq!(int8_mma_min_rows(Some("16")), Ok(16));
        for bad in ["-1", "two", "1.5"] {
            let e = int8_mma_min_rows(Some(bad)).unwrap_err();
            assert!(e.contains("DFLASH_CUDA_INT8_MMA"), "{e}");
        }
    }

    #[test]
    fn int8_formats_are_the_cpu_int8_formats() {
        for d in DType::ALL {
            assert_eq!(
                int8_format(d),
                matches!(d, DType::Q4_0 | DType::Q4_1 | DType::Q8_0),
                "{d}"
            );
        }
    }
}
