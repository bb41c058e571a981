//! Which weights multiply int8-quantized activations on the GPU (`DFLASH_CUDA_INT8`), and which
//! formats have the int8 kernels.

use super::device::{rows_setting, QT_WIDTHS};
use crate::cpu::int8::pack::Int8Format;
use crate::dtype::DType;

/// Which of the target's projections (Q4_0, Q4_1 or Q8_0, at least `PANEL` rows, as on the CPU)
/// multiply int8-quantized activations (the `mmq_*` / `mmqt_*` kernels); `DFLASH_CUDA_INT8` =
/// `1` (default; `auto` and `on` say the same), `x2` (two-term activations) or `0`. Fixed per
/// weight at upload, so every product with a weight, whatever M, takes one path.
///
/// The default is the CPU's rule (`cpu::policy`): both backends quantize the same projections'
/// inputs to the same codes, which is also what llama.cpp's quantized CUDA products do. Measured
/// on the H200 (docs/benchmarks/2026-12-01-h200-int8-activations.md,
/// 2026-12-02-h200-int8-handoff.md, 2026-12-02-h200-int8-default.md): on the Qwen3-4B shapes
/// int8 cuts a 16-token verify from 4.6 to 2.9 decode steps and decodes faster; on the default
/// model's it decodes and verifies ~8% faster than f32. Its logits stay within the int8 path's
/// end-to-end bound of transformers' (`dflash_models::bounds`, checked on a GPU by
/// engine/tests/cuda_golden_smollm2.rs), a looser bound than the f32 path's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Policy {
    /// None: f32 activations everywhere.
    Off,
    /// Every eligible projection (the default).
    All,
    /// Every eligible projection, with two-term int8 activations (`x2`; the CPU's
    /// `DFLASH_MATMUL=int8x2`): each row of x is carried by the codes of x and of its residual,
    /// the products (the `matmul_<format>_int8x2` module, `DF_X_TERMS` 2 in matmul.cu) multiply
    /// both and add the two sums, about 250 times closer to the f32 product than one term. The
    /// weights' bytes are read once either way; the x bytes and the integer work double.
    TwoTerms,
}

impl Int8Policy {
    /// Whether an eligible projection takes int8 activations.
    pub fn takes(self) -> bool {
        self != Int8Policy::Off
    }

    /// Int8 rows per row of x in the int8 copies (1, or 2 for [`Int8Policy::TwoTerms`]).
    pub fn terms(self) -> usize {
        if self == Int8Policy::TwoTerms {
            2
        } else {
            1
        }
    }
}

impl std::str::FromStr for Int8Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "auto" | "1" | "on" => Ok(Int8Policy::All),
            "0" | "off" => Ok(Int8Policy::Off),
            "x2" | "int8x2" => Ok(Int8Policy::TwoTerms),
            v => Err(format!("DFLASH_CUDA_INT8={v:?}: expected auto, 1, x2 or 0")),
        }
    }
}

/// The fewest rows of x that take the int8 tensor-core kernels by default
/// (`DFLASH_CUDA_INT8_MMA`). Their time hardly grows with M, the dp4a kernels' does. On the
/// H200 (docs/benchmarks/2026-12-02-h200-int8-default.md), with the narrow blocks for
/// products of few outputs, the tensor cores verify 5 to 8 rows faster than dp4a's tile of 8
/// (a verify of 8: 1.06 → 0.93 ms on the default model's shapes, 6.42 → 5.07 ms on Qwen3-4B's),
/// while dp4a's tiles of 1, 2 and 4 rows stay faster up to 4 (a verify of 4 with the tensor
/// cores: 0.76 → 0.90 ms, 3.29 → 4.66 ms).
pub const INT8_MMA_MIN_M: usize = 5;

/// The fewest rows of x whose int8 products run on integer tensor cores, from the value of
/// `DFLASH_CUDA_INT8_MMA` (unset, empty or `auto`: [`INT8_MMA_MIN_M`]; `0` or `off`: never, as
/// `usize::MAX`; else a row count of at least 1).
pub fn int8_mma_min_rows(v: Option<&str>) -> Result<usize, String> {
    rows_setting("DFLASH_CUDA_INT8_MMA", v, INT8_MMA_MIN_M)
}

/// The value of `DFLASH_CUDA_INT8_MMA_WIDTH`: `None` for `auto` (or empty), else one of
/// `QT_WIDTHS`.
pub(crate) fn int8_mma_width(v: &str) -> Result<Option<usize>, String> {
    match v.trim() {
        "" | "auto" => Ok(None),
        s => match s.parse::<usize>() {
            Ok(t) if QT_WIDTHS.contains(&t) => Ok(Some(t)),
            _ => Err(format!(
                "DFLASH_CUDA_INT8_MMA_WIDTH={s:?}: expected auto or one of {QT_WIDTHS:?}"
            )),
        },
    }
}

/// Whether format `d` has int8-activation kernels (`mmq_*`, built with `DF_MM_INT8`): the
/// formats of the CPU's int8 kernels. The GPU stores every weight of these formats in the
/// packed layout (cuda/pack.rs), whatever its activations.
pub(crate) fn int8_format(d: DType) -> bool {
    Int8Format::of(d).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::CudaOptions;

    #[test]
    fn int8_policy_parses_and_defaults_to_every_eligible_projection() {
        for v in ["", "auto", "1", " on "] {
            assert_eq!(v.parse(), Ok(Int8Policy::All), "{v:?}");
        }
        assert_eq!("0".parse(), Ok(Int8Policy::Off));
        assert_eq!("off".parse(), Ok(Int8Policy::Off));
        assert_eq!(" x2".parse(), Ok(Int8Policy::TwoTerms));
        assert_eq!("int8x2".parse(), Ok(Int8Policy::TwoTerms));
        for bad in ["yes", "2", "x3"] {
            let e = bad.parse::<Int8Policy>().unwrap_err();
            assert!(
                e.contains("DFLASH_CUDA_INT8") && e.contains("auto, 1, x2 or 0"),
                "{e}"
            );
        }
        assert!(Int8Policy::All.takes() && !Int8Policy::Off.takes());
        assert!(Int8Policy::TwoTerms.takes());
        assert_eq!(Int8Policy::All.terms(), 1);
        assert_eq!(Int8Policy::TwoTerms.terms(), 2);
        assert_eq!(Int8Policy::Off.terms(), 1);
        assert_eq!(CudaOptions::default().int8, Int8Policy::All);
    }

    #[test]
    fn int8_mma_width_parses() {
        assert_eq!(int8_mma_width(""), Ok(None));
        assert_eq!(int8_mma_width(" auto "), Ok(None));
        assert_eq!(int8_mma_width("4"), Ok(Some(4)));
        assert_eq!(int8_mma_width("2"), Ok(Some(2)));
        assert_eq!(int8_mma_width("1"), Ok(Some(1)));
        for bad in ["0", "3", "wide"] {
            let e = int8_mma_width(bad).unwrap_err();
            assert!(e.contains("DFLASH_CUDA_INT8_MMA_WIDTH"), "{e}");
        }
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
