//! The device boundary: the op set model code is written against.
//!
//! A backend owns activation tensors (f32 matrices), uploaded weights, KV caches and the
//! per-step token metadata. Model code never looks inside them; it calls ops. Every op works
//! on a batch of tokens that may belong to different rows (sequences) at different positions:
//! [`TokenMeta`] says, for each token, which row it belongs to, its logical position and which
//! slice of its row's KV cache it may attend to.

use std::fmt;

use crate::dtype::DType;
use crate::error::RuntimeError;
use crate::weight::HostWeight;

/// What a weight matrix is used for. A backend may give each use its own numeric path (the
/// CPU multiplies target projections with int8 activations and keeps the vocabulary
/// projection and the drafter on f32 activations).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightRole {
    /// A projection inside the target's layers (q, k, v, o, gate, up, down).
    Projection,
    /// The output head (vocabulary projection), used by the target and by drafters.
    Vocab,
    /// A drafter's own weight.
    Draft,
    /// A token-embedding table (read by row, never multiplied).
    Embedding,
}

/// The activation type a product is computed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activations {
    F32,
    /// Int8 codes per row and 32-value block, with an f32 scale per block.
    Int8,
}

impl fmt::Display for Activations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Activations::F32 => "f32",
            Activations::Int8 => "int8",
        })
    }
}

/// The numeric path of one uploaded weight: its format, the activation type it is multiplied
/// with and the kernel family that does it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WeightPath {
    pub format: DType,
    pub activations: Activations,
    pub kernel: String,
}

impl fmt::Display for WeightPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} x {} ({})",
            self.format, self.activations, self.kernel
        )
    }
}

/// Per-token metadata for one forward step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenMeta {
    /// KV-cache row (sequence slot) the token belongs to.
    pub row: u32,
    /// Logical position of the token in its row (its RoPE position and KV slot).
    pub pos: u32,
    /// First KV position the token's query may attend to.
    pub kv_start: u32,
    /// One past the last KV position the token's query may attend to.
    pub kv_end: u32,
}

impl TokenMeta {
    /// A causal token: attends to positions `0..=pos` of its row.
    pub fn causal(row: u32, pos: u32) -> Self {
        Self {
            row,
            pos,
            kv_start: 0,
            kv_end: pos + 1,
        }
    }
}

/// How RoPE pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension i pairs with i + rot/2 (HF `rotate_half`, GGUF "neox").
    Neox,
    /// Dimension 2i pairs with 2i+1 (GGUF llama files, whose q/k rows were permuted for it).
    Interleaved,
}

/// Attention head layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// The op set of a device. See the module docs.
pub trait Backend: Send + Sync + 'static {
    /// An f32 matrix of `rows x cols` on the device.
    type Tensor: Send + Sync;
    /// A weight matrix in its stored format on the device.
    type Weight: Send + Sync;
    /// KV storage for `layers` layers and any number of rows.
    type Kv: Send + Sync;
    /// Token metadata of one step, on the device.
    type Meta: Send + Sync;

    fn name(&self) -> &'static str;

    /// Runs `f` in the backend's execution context (the CPU worker pool, a CUDA stream).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;

    // --- memory -------------------------------------------------------------------------
    /// Puts `w` on the device for `role` (which may pick its numeric path).
    fn upload_weight(&self, w: &HostWeight, role: WeightRole)
        -> Result<Self::Weight, RuntimeError>;
    /// The numeric path products with `w` take.
    fn weight_path(&self, w: &Self::Weight) -> WeightPath;
    /// A zeroed `rows x cols` tensor.
    fn tensor(&self, rows: usize, cols: usize) -> Self::Tensor;
    /// Reshapes `t` to `rows x cols`, reusing its storage when large enough (contents undefined).
    fn reshape(&self, t: &mut Self::Tensor, rows: usize, cols: usize);
    fn shape(&self, t: &Self::Tensor) -> (usize, usize);
    /// A `rows x cols` tensor holding `data` (host to device).
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> Self::Tensor;
    fn to_host(&self, t: &Self::Tensor) -> Vec<f32>;
    /// Copies `t` into `out` (resized), reusing `out`'s allocation.
    fn copy_to_host(&self, t: &Self::Tensor, out: &mut Vec<f32>);
    fn upload_meta(&self, meta: &[TokenMeta]) -> Self::Meta;

    // --- KV cache -------------------------------------------------------------------------
    fn kv_new(&self, layers: usize, kv_dim: usize) -> Self::Kv;
    /// Makes row `row` hold at least `capacity` positions, keeping its first `keep` positions.
    fn kv_reserve(&self, kv: &mut Self::Kv, row: usize, capacity: usize, keep: usize);
    fn kv_capacity(&self, kv: &Self::Kv, row: usize) -> usize;
    /// Copies positions `0..len` of `src` into `dst` (all layers).
    fn kv_copy_row(&self, kv: &mut Self::Kv, src: usize, dst: usize, len: usize);
    /// Releases row `row`'s storage.
    fn kv_release(&self, kv: &mut Self::Kv, row: usize);
    /// Writes each token's k and v (`[T, kv_dim]`) at (meta.row, meta.pos) of layer `layer`.
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        meta: &Self::Meta,
    );

    // --- ops ------------------------------------------------------------------------------
    /// `out[t] = table[ids[t]]`, dequantized.
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor);
    /// `out = x · wᵀ` (`x: [M, K]`, `w: [N, K]`, `out: [M, N]`).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor);
    /// Several products of the same `x` at once: `outs[i] = x · ws[i]ᵀ`.
    fn matmul_many(&self, x: &Self::Tensor, ws: &[&Self::Weight], outs: &mut [&mut Self::Tensor]);
    /// `x[t] += bias` for every row (`bias: [1, cols]`).
    fn add_bias(&self, x: &mut Self::Tensor, bias: &Self::Tensor);
    /// RMS normalisation over groups of `weight.cols` columns; `zero_centred` scales by
    /// `1 + weight`. In place when `out` is `None`.
    fn rms_norm(
        &self,
        x: &mut Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
        zero_centred: bool,
        out: Option<&mut Self::Tensor>,
    );
    /// Rotates the first `rot_dim` dimensions of every `head_dim` head of `x` in place, at each
    /// token's position, with inverse frequencies `inv_freq` (`[1, rot_dim / 2]`).
    fn rope(
        &self,
        x: &mut Self::Tensor,
        meta: &Self::Meta,
        inv_freq: &Self::Tensor,
        head_dim: usize,
        style: RopeStyle,
    );
    /// Softmax attention of each token's query heads over its KV slice of layer `layer`.
    fn attention(
        &self,
        q: &Self::Tensor,
        kv: &Self::Kv,
        layer: usize,
        meta: &Self::Meta,
        shape: AttnShape,
        out: &mut Self::Tensor,
    );
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor);
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32], out: &mut Self::Tensor);
    /// Copies `src` (`[T, c]`) into columns `col..col+c` of `dst` (`[T, C]`).
    fn copy_columns(&self, src: &Self::Tensor, dst: &mut Self::Tensor, col: usize);
    /// Index of the largest value of every row (first one on ties).
    fn argmax_rows(&self, x: &Self::Tensor) -> Vec<u32>;
}
