//! Which numeric path each weight takes on the CPU, and the `DFLASH_MATMUL` switch.
//!
//! - `auto` (default): the target's projections (q, k, v, o, gate, up, down) in Q4_0, Q4_1
//!   or Q8_0 use int8 activations with the best tuned int8 kernel family that passed its
//!   self-check; the vocabulary projection, other formats (Q4_K, Q6_K, f16, bf16, f32) and
//!   tiny shapes (fewer than 16 output rows) keep the f32 kernels. The drafter's own
//!   projections (fc, q, k, v, o, gate, up, down) keep f32 activations too, except where the
//!   f32 kernels are AVX2's (no AVX-512): there they take two-term int8 activations, whose
//!   products land about 250 times closer to the f32 product than one-term int8 (logits
//!   within 0.004 of the f32 path's on the default model) at a fraction of the cost: on an
//!   AVX2-only AMD EPYC the f32 Q4_1 product of two rows costs 4.6x the int8 one (1.3x on
//!   AVX-512), so f32 drafts made DFlash slower than plain decoding there (median 0.95x) and
//!   these faster (median 1.065x, draft 1.17 ms a round against 1.81; MT-Bench τ unchanged;
//!   docs/benchmarks/2026-12-06-cpu-avx2-int8x2-drafts.md). The draft head keeps f32.
//! - `f32-draft`: as `auto`, with the drafter's projections on f32 on every CPU.
//! - `int8x2`: as `auto` with two-term int8 activations for the target's projections too
//!   (the codes of x and of its residual, see `int8::quantize::Terms`): each product
//!   multiplies twice the int8 rows and lands about 250 times closer to the f32 product, so
//!   the target's greedy text stays near the model's (with the shipped drafter, MT-Bench τ
//!   at block 16 2.95 against 2.71 for `auto`, f32 2.92), at 10–20 % of the decode speed
//!   (docs/benchmarks/2026-12-04-cpu-int8x2.md).
//! - `int8-vocab`: as `auto`, and the vocabulary projection too (for measurements; drafts
//!   then also read int8 vocabulary logits).
//! - `int8-draft`: as `auto`, with the drafter's projections on one-term int8 activations on
//!   every CPU; the draft head keeps f32 activations.
//! - `reference`: the f32 kernels everywhere.
//!
//! A weight's path is fixed when it is uploaded, so every product with it, whatever the
//! number of rows, uses one arithmetic: decode, verify and prefill rows agree bit for bit.
//!
//! A vocabulary projection on the f32 path also gets an int8 screen for the products read
//! only for a greedy choice (`argmax_screen`: the same choice as the f32 product, bit for
//! bit, at about the int8 product's cost), in every mode but `reference`;
//! `DFLASH_ARGMAX_SCREEN=off` turns that off (for measurements).

use std::fmt;
use std::str::FromStr;

use super::int8::pack::{Int8Format, PANEL};
use super::int8::quantize::Terms;
use super::int8::Int8Kernel;
use super::matmul::Isa;
use crate::backend::WeightRole;
use crate::dtype::DType;
use crate::error::RuntimeError;

/// The environment variable that picks the [`MatmulMode`].
pub const ENV: &str = "DFLASH_MATMUL";

/// The environment variable that turns greedy screens on (`on`, the default) or off (`off`).
pub const SCREEN_ENV: &str = "DFLASH_ARGMAX_SCREEN";

/// Whether `DFLASH_ARGMAX_SCREEN` lets greedy products be screened (unset: yes).
pub fn screen_from_env() -> Result<bool, RuntimeError> {
    parse_screen(&std::env::var(SCREEN_ENV).unwrap_or_default())
}

fn parse_screen(v: &str) -> Result<bool, RuntimeError> {
    match v {
        "" | "on" => Ok(true),
        "off" => Ok(false),
        other => Err(RuntimeError::Device(format!(
            "{SCREEN_ENV}={other:?}: expected on or off"
        ))),
    }
}

/// The CPU's matmul policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MatmulMode {
    #[default]
    Auto,
    Int8x2,
    Int8Vocab,
    Int8Draft,
    F32Draft,
    Reference,
}

impl FromStr for MatmulMode {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Self, RuntimeError> {
        match s {
            "" | "auto" => Ok(MatmulMode::Auto),
            "int8x2" => Ok(MatmulMode::Int8x2),
            "int8-vocab" => Ok(MatmulMode::Int8Vocab),
            "int8-draft" => Ok(MatmulMode::Int8Draft),
            "f32-draft" => Ok(MatmulMode::F32Draft),
            "reference" => Ok(MatmulMode::Reference),
            other => Err(RuntimeError::Device(format!(
                "{ENV}={other:?}: expected auto, int8x2, int8-vocab, int8-draft, f32-draft or \
                 reference"
            ))),
        }
    }
}

impl fmt::Display for MatmulMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MatmulMode::Auto => "auto",
            MatmulMode::Int8x2 => "int8x2",
            MatmulMode::Int8Vocab => "int8-vocab",
            MatmulMode::Int8Draft => "int8-draft",
            MatmulMode::F32Draft => "f32-draft",
            MatmulMode::Reference => "reference",
        })
    }
}

impl MatmulMode {
    /// The mode `DFLASH_MATMUL` asks for (unset: `auto`).
    pub fn from_env() -> Result<MatmulMode, RuntimeError> {
        std::env::var(ENV).unwrap_or_default().parse()
    }

    /// The int8 rows per activation row of this mode's int8 products of the target's
    /// projections.
    pub fn terms(self) -> Terms {
        match self {
            MatmulMode::Int8x2 => Terms::Two,
            _ => Terms::One,
        }
    }

    /// The int8 terms a weight of `role` takes in this mode where the f32 kernels are
    /// `isa`'s, or `None` for f32 activations (see the module docs).
    fn int8_terms(self, role: WeightRole, isa: Isa) -> Option<Terms> {
        match (self, role) {
            (MatmulMode::Reference, _) => None,
            (_, WeightRole::Projection) => Some(self.terms()),
            (MatmulMode::Int8Vocab, WeightRole::Vocab) => Some(Terms::One),
            (MatmulMode::Int8Draft, WeightRole::Draft) => Some(Terms::One),
            (MatmulMode::F32Draft, WeightRole::Draft) => None,
            (_, WeightRole::Draft) if isa == Isa::Avx2 => Some(Terms::Two),
            _ => None,
        }
    }
}

/// The kernels a weight is multiplied with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuPath {
    /// Int8 activations in these terms, this tuned family.
    Int8(Int8Kernel, Terms),
    /// F32 activations, the f32 kernels of this instruction set.
    F32(Isa),
}

impl fmt::Display for CpuPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpuPath::Int8(k, Terms::One) => write!(f, "int8 {k}"),
            CpuPath::Int8(k, Terms::Two) => write!(f, "int8x2 {k}"),
            CpuPath::F32(isa) => write!(f, "f32 {isa}"),
        }
    }
}

/// The path for a `rows x cols` weight stored as `dtype` and used for `role`, given the
/// mode, the usable int8 family (if any) and the f32 instruction set.
pub fn select(
    mode: MatmulMode,
    role: WeightRole,
    dtype: DType,
    rows: usize,
    cols: usize,
    int8: Option<Int8Kernel>,
    isa: Isa,
) -> CpuPath {
    let shape_fits = rows >= PANEL && cols.is_multiple_of(32);
    match (int8, mode.int8_terms(role, isa)) {
        (Some(k), Some(terms)) if Int8Format::of(dtype).is_some() && shape_fits => {
            CpuPath::Int8(k, terms)
        }
        _ => CpuPath::F32(isa),
    }
}

/// The int8 family and format that screen greedy products through a `dtype` weight whose
/// path is `path` (see the module docs): vocabulary weights left on the f32 path, unless the
/// mode is `reference` or screening is off. The screen is the stored weight itself when the
/// int8 kernels read its format (its bound is then the int8 rounding alone: one or two
/// outputs recomputed a row on the default model), else its Q8_0 encoding (bf16, f16, f32
/// and K-quant heads). A coarser screen would read fewer bytes, but the rigorous bound of
/// its weight error spans almost every output (a Q4_0 screen of the default model's head
/// recomputed 91 % of them).
pub fn screen_for(
    mode: MatmulMode,
    role: WeightRole,
    dtype: DType,
    path: CpuPath,
    int8: Option<Int8Kernel>,
    enabled: bool,
) -> Option<(Int8Kernel, DType)> {
    let on = enabled && mode != MatmulMode::Reference && role == WeightRole::Vocab;
    match (int8, path) {
        (Some(k), CpuPath::F32(_)) if on => Some((k, screen_format(dtype))),
        _ => None,
    }
}

/// The format of a `dtype` weight's greedy screen: its own where the int8 kernels read it,
/// else Q8_0 (see [`screen_for`]).
pub fn screen_format(dtype: DType) -> DType {
    Int8Format::of(dtype).map_or(DType::Q8_0, |f| f.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: Option<Int8Kernel> = Some(Int8Kernel::Avx2);

    #[test]
    fn modes_parse_and_bad_values_are_refused() {
        assert_eq!("".parse::<MatmulMode>().unwrap(), MatmulMode::Auto);
        assert_eq!("auto".parse::<MatmulMode>().unwrap(), MatmulMode::Auto);
        assert_eq!("int8x2".parse::<MatmulMode>().unwrap(), MatmulMode::Int8x2);
        assert_eq!(
            "reference".parse::<MatmulMode>().unwrap(),
            MatmulMode::Reference
        );
        assert_eq!(
            "int8-vocab".parse::<MatmulMode>().unwrap(),
            MatmulMode::Int8Vocab
        );
        assert_eq!(
            "int8-draft".parse::<MatmulMode>().unwrap(),
            MatmulMode::Int8Draft
        );
        assert_eq!(
            "f32-draft".parse::<MatmulMode>().unwrap(),
            MatmulMode::F32Draft
        );
        for m in [
            "auto",
            "int8x2",
            "int8-vocab",
            "int8-draft",
            "f32-draft",
            "reference",
        ] {
            assert_eq!(m.parse::<MatmulMode>().unwrap().to_string(), m);
        }
        let e = "fast".parse::<MatmulMode>().unwrap_err().to_string();
        assert!(
            e.contains("DFLASH_MATMUL") && e.contains("reference"),
            "{e}"
        );
    }

    #[test]
    fn the_default_model_shapes_get_the_documented_paths() {
        let isa = Isa::Portable(8);
        let sel = |mode, role, dtype, n, k| select(mode, role, dtype, n, k, K, isa);
        let auto = MatmulMode::Auto;
        // SmolLM2-135M Q4_1: q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536.
        for (n, k) in [(576, 576), (192, 576), (1536, 576), (576, 1536)] {
            let p = sel(auto, WeightRole::Projection, DType::Q4_1, n, k);
            assert_eq!(p, CpuPath::Int8(Int8Kernel::Avx2, Terms::One));
            let p = sel(
                MatmulMode::Int8x2,
                WeightRole::Projection,
                DType::Q4_1,
                n,
                k,
            );
            assert_eq!(p, CpuPath::Int8(Int8Kernel::Avx2, Terms::Two));
        }
        // The Q8_0 output head keeps f32 activations unless asked.
        let head = (DType::Q8_0, 49152, 576);
        assert_eq!(
            sel(auto, WeightRole::Vocab, head.0, head.1, head.2),
            CpuPath::F32(isa)
        );
        let v = sel(
            MatmulMode::Int8Vocab,
            WeightRole::Vocab,
            head.0,
            head.1,
            head.2,
        );
        assert_eq!(v, CpuPath::Int8(Int8Kernel::Avx2, Terms::One));
        // Drafter weights (where the f32 kernels are not AVX2's), other formats, tiny
        // shapes, reference mode, no int8 family: f32.
        assert_eq!(
            sel(auto, WeightRole::Draft, DType::Q4_1, 576, 576),
            CpuPath::F32(isa)
        );
        // `int8-draft` moves the drafter's projections (fc 576x2880 too) but not any head.
        let draft = MatmulMode::Int8Draft;
        for (n, k) in [(576, 2880), (576, 576), (1536, 576), (576, 1536)] {
            let p = sel(draft, WeightRole::Draft, DType::Q4_1, n, k);
            assert_eq!(p, CpuPath::Int8(Int8Kernel::Avx2, Terms::One));
        }
        assert_eq!(
            sel(draft, WeightRole::Vocab, head.0, head.1, head.2),
            CpuPath::F32(isa)
        );
        for d in [DType::Q4K, DType::Q6K, DType::BF16, DType::F16, DType::F32] {
            assert_eq!(
                sel(auto, WeightRole::Projection, d, 576, 576),
                CpuPath::F32(isa)
            );
        }
        assert_eq!(
            sel(auto, WeightRole::Projection, DType::Q4_0, 8, 576),
            CpuPath::F32(isa)
        );
        let r = sel(
            MatmulMode::Reference,
            WeightRole::Projection,
            DType::Q4_0,
            576,
            576,
        );
        assert_eq!(r, CpuPath::F32(isa));
        let none = select(
            auto,
            WeightRole::Projection,
            DType::Q4_1,
            576,
            576,
            None,
            isa,
        );
        assert_eq!(none, CpuPath::F32(isa));
    }

    #[test]
    fn drafter_projections_take_two_term_int8_where_the_f32_kernels_are_avx2s() {
        let (n, k) = (1536, 576);
        let two = CpuPath::Int8(Int8Kernel::Avx2, Terms::Two);
        let one = CpuPath::Int8(Int8Kernel::Avx2, Terms::One);
        let draft = |mode, isa| select(mode, WeightRole::Draft, DType::Q4_1, n, k, K, isa);
        for mode in [MatmulMode::Auto, MatmulMode::Int8x2, MatmulMode::Int8Vocab] {
            assert_eq!(draft(mode, Isa::Avx2), two, "{mode}");
            for isa in [Isa::Avx512, Isa::Neon, Isa::Portable(8)] {
                assert_eq!(draft(mode, isa), CpuPath::F32(isa), "{mode} {isa}");
            }
        }
        for isa in [Isa::Avx2, Isa::Avx512] {
            assert_eq!(draft(MatmulMode::F32Draft, isa), CpuPath::F32(isa));
            assert_eq!(draft(MatmulMode::Int8Draft, isa), one);
            assert_eq!(draft(MatmulMode::Reference, isa), CpuPath::F32(isa));
        }
        // The rule moves the drafter's projections only: not the target's, not any head,
        // nor formats or shapes the int8 kernels do not take.
        let avx2 = |role, dtype, n| select(MatmulMode::Auto, role, dtype, n, k, K, Isa::Avx2);
        assert_eq!(avx2(WeightRole::Projection, DType::Q4_1, n), one);
        assert_eq!(
            avx2(WeightRole::Vocab, DType::Q8_0, 49152),
            CpuPath::F32(Isa::Avx2)
        );
        assert_eq!(
            avx2(WeightRole::Draft, DType::BF16, n),
            CpuPath::F32(Isa::Avx2)
        );
        assert_eq!(
            avx2(WeightRole::Draft, DType::Q4_1, 8),
            CpuPath::F32(Isa::Avx2)
        );
    }

    #[test]
    fn only_f32_vocabulary_weights_are_screened() {
        let f32 = CpuPath::F32(Isa::Portable(8));
        let int8 = CpuPath::Int8(Int8Kernel::Avx2, Terms::One);
        let v = WeightRole::Vocab;
        let q8 = Some((Int8Kernel::Avx2, DType::Q8_0));
        for mode in [MatmulMode::Auto, MatmulMode::Int8x2, MatmulMode::Int8Draft] {
            assert_eq!(screen_for(mode, v, DType::Q8_0, f32, K, true), q8);
        }
        // The stored weight where the int8 kernels read it, else its Q8_0 encoding.
        let q4 = Some((Int8Kernel::Avx2, DType::Q4_1));
        assert_eq!(
            screen_for(MatmulMode::Auto, v, DType::Q4_1, f32, K, true),
            q4
        );
        for d in [DType::BF16, DType::F16, DType::Q6K] {
            assert_eq!(screen_for(MatmulMode::Auto, v, d, f32, K, true), q8);
        }
        assert_eq!(
            screen_for(MatmulMode::Auto, v, DType::Q8_0, f32, K, false),
            None
        );
        assert_eq!(
            screen_for(MatmulMode::Reference, v, DType::Q8_0, f32, K, true),
            None
        );
        assert_eq!(
            screen_for(MatmulMode::Int8Vocab, v, DType::Q8_0, int8, K, true),
            None
        );
        assert_eq!(
            screen_for(MatmulMode::Auto, v, DType::Q8_0, f32, None, true),
            None
        );
        let p = WeightRole::Projection;
        assert_eq!(
            screen_for(MatmulMode::Auto, p, DType::Q8_0, f32, K, true),
            None
        );
        assert!(parse_screen("").unwrap());
        assert!(!parse_screen("off").unwrap());
        let e = parse_screen("maybe").unwrap_err().to_string();
        assert!(e.contains(SCREEN_ENV), "{e}");
    }
}
