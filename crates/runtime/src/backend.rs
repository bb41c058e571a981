//! The device boundary: the op set model code is written against.
//!
//! A backend owns activation tensors (f32 matrices), uploaded weights, KV caches and the
//! per-step token metadata. Model code never looks inside them; it calls ops. Every op works
//! on a batch of tokens that may belong to different rows (sequences) at different positions:
//! [`TokenMeta`] says, for each token, which row it belongs to, its logical position and which
//! slice of its row's KV cache it may attend to.

use std::fmt;

use crate::choice::{DraftRow, SampleRow, Verdict, VerifyRow};
use crate::dtype::DType;
use crate::error::RuntimeError;
use crate::weight::HostWeight;

/// What a weight matrix is used for. A backend may give each use its own numeric path (the
/// CPU multiplies target projections with int8 activations and keeps the vocabulary
/// projection on f32 activations, and the drafter too unless its f32 kernels are AVX2's:
/// `cpu::policy`).
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
    /// Two int8 rows per row: the codes of x, then those of its residual (each per 32-value
    /// block with its own scale); the product is the sum of both rows' products.
    Int8x2,
}

impl fmt::Display for Activations {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Activations::F32 => "f32",
            Activations::Int8 => "int8",
            Activations::Int8x2 => "int8x2",
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
    /// The int8 kernel family that screens products read only for their greedy choice
    /// ([`Backend::matmul_argmax`]), if the backend screens this weight's.
    pub greedy_screen: Option<String>,
}

impl fmt::Display for WeightPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} x {} ({}", self.format, self.activations, self.kernel)?;
        match &self.greedy_screen {
            Some(k) => write!(f, "; greedy rows screened by {k})"),
            None => f.write_str(")"),
        }
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

/// The rotary embedding of an attention layer: its frequencies (`[half]`, `inv_freq[i]` for
/// pair i), the head size and how dimensions pair.
#[derive(Debug)]
pub struct Rope<'a, T> {
    pub inv_freq: &'a T,
    pub head_dim: usize,
    pub style: RopeStyle,
}

impl<T> Clone for Rope<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Rope<'_, T> {}

/// The per-head RMS norms of an attention layer's q and k (Qwen3 style): `[1, head_dim]`
/// weights applied to every head of q and of k, plain (not zero-centred), with `eps`.
#[derive(Debug)]
pub struct QkNorm<'a, T> {
    pub q: &'a T,
    pub k: &'a T,
    pub eps: f32,
}

impl<T> Clone for QkNorm<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for QkNorm<'_, T> {}

/// [`Backend::k_norm_rope_kv_write`] as its ops: `rms_norm` of k (in place), `rope` of k,
/// then `kv_write` (the trait's default, and a backend's fallback where it cannot fuse them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn k_norm_then_rope_kv<B: Backend + ?Sized>(
    b: &B,
    k: &mut B::Tensor,
    v: &B::Tensor,
    kv: &mut B::Kv,
    layer: usize,
    meta: &B::Meta,
    (k_norm, eps): (&B::Tensor, f32),
    rope: Rope<'_, B::Tensor>,
) {
    b.rms_norm(k, k_norm, eps, false, None);
    b.rope(k, meta, rope.inv_freq, rope.head_dim, rope.style);
    b.kv_write(kv, layer, k, v, meta);
}

/// [`Backend::qk_norm_rope_kv_write`] as its ops: `rms_norm` of q and of k (in place), then
/// `rope_kv_write` (the trait's default, and a backend's fallback where it cannot fuse them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_then_rope_kv<B: Backend + ?Sized>(
    b: &B,
    q: &mut B::Tensor,
    k: &mut B::Tensor,
    v: &B::Tensor,
    kv: &mut B::Kv,
    layer: usize,
    meta: &B::Meta,
    norm: QkNorm<'_, B::Tensor>,
    rope: Rope<'_, B::Tensor>,
) {
    b.rms_norm(q, norm.q, norm.eps, false, None);
    b.rms_norm(k, norm.k, norm.eps, false, None);
    b.rope_kv_write(q, k, v, kv, layer, meta, rope);
}

/// [`Backend::step_qkv_rope_kv`] as its two ops: `step_matmul_many`, then `rope_kv_write`
/// (the trait's default, and a backend's fallback where it cannot fuse them).
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_then_rope_kv<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    ws: [&B::Weight; 3],
    outs: [&mut B::Tensor; 3],
    kv: &mut B::Kv,
    layer: usize,
    meta: &B::Meta,
    rope: Rope<'_, B::Tensor>,
    spans: &[RowSpan],
) {
    let [q, k, v] = outs;
    b.step_matmul_many(x, &ws, &mut [&mut *q, &mut *k, &mut *v], spans);
    b.rope_kv_write(q, k, v, kv, layer, meta, rope);
}

/// Attention head layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// Shapes of a model's Gated DeltaNet (linear-attention) layers.
///
/// The mixer input is `qkv = [q (k_heads x k_dim) | k (k_heads x k_dim) | v (v_heads x v_dim)]`;
/// v head `j` reads q/k head `j / (v_heads / k_heads)` (grouped, HF checkpoints) or
/// `j % k_heads` (tiled: llama.cpp's GGUF converter reorders the v heads so). The recurrent
/// state of one row and
/// layer is `v_heads` matrices of `k_dim x v_dim` f32 values, the conv state the last
/// `conv_kernel - 1` inputs of every qkv channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
    /// v heads in tiled order (see above).
    pub tiled_heads: bool,
}

impl GdnShape {
    /// The q/k head read by v head `h`.
    pub fn k_head_of(&self, h: usize) -> usize {
        if self.tiled_heads {
            h % self.k_heads
        } else {
            h / (self.v_heads / self.k_heads)
        }
    }

    pub fn key_dim(&self) -> usize {
        self.k_heads * self.k_dim
    }
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }
    /// Channels of the causal convolution: `2 * key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// f32 values of one row's recurrent state in one layer.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

/// The tokens `first..first + count` of a step belong to row `row` and continue it (a row's
/// tokens are contiguous in the step and in position order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowSpan {
    pub row: u32,
    pub first: u32,
    pub count: u32,
    /// Run the gated delta rule over this span in its chunked form (prefill) rather than
    /// token by token. Both give the same result up to rounding; only the token-by-token form
    /// is bit-identical between a block of tokens and the same tokens one at a time, so
    /// verification always uses it.
    pub chunked: bool,
    /// The tokens are a piece of the row's prompt (prefill), not decode or verify tokens:
    /// products over the step (`Backend::step_matmul_*`) may run these rows on the backend's
    /// prefill path.
    pub prompt: bool,
}

/// The rows `0..rows` of a step laid out by `spans` (in order, disjoint, inside `0..rows`) as
/// maximal runs of rows that are prompt rows (`true`) or not, in order; rows no span covers
/// are not prompt rows. Panics when the spans break that layout.
pub fn prompt_runs(rows: usize, spans: &[RowSpan]) -> Vec<(std::ops::Range<usize>, bool)> {
    let mut runs: Vec<(std::ops::Range<usize>, bool)> = Vec::new();
    let mut push = |r: std::ops::Range<usize>, prompt: bool| {
        if r.is_empty() {
            return;
        }
        match runs.last_mut() {
            Some((last, p)) if *p == prompt && last.end == r.start => last.end = r.end,
            _ => runs.push((r, prompt)),
        }
    };
    let mut at = 0;
    for s in spans {
        let (first, end) = (s.first as usize, (s.first + s.count) as usize);
        assert!(
            first >= at && end <= rows,
            "step spans must be in order, disjoint and inside the step's {rows} rows"
        );
        push(at..first, false);
        push(first..end, s.prompt);
        at = end;
    }
    push(at..rows, false);
    runs
}

/// What a captured step graph is replayed for: a model instance ([`Backend::graph_owner`])
/// and the launch shapes of its step. Two steps with equal keys launch the same kernels with
/// the same arguments; only device data (step inputs, KV contents) differ.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub owner: u64,
    /// Tokens in the step.
    pub tokens: usize,
    /// Rows whose logits are computed.
    pub rows: usize,
    /// Any other shape the model's step depends on (e.g. its tap layout's generation).
    pub variant: u64,
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
    /// Recurrent (Gated DeltaNet) state of every row for a number of layers: per row and
    /// layer a conv window and a recurrent state, each kept twice (the state before the row's
    /// last forward step and after it), plus what is needed to roll a row back into its last
    /// step (see [`Backend::gdn_rollback`]).
    type Gdn: Send + Sync;
    /// A model's step inputs, kept on the device at fixed addresses between steps: token
    /// metadata, token ids (for [`Backend::embed_step`]) and selected rows (for
    /// [`Backend::gather_step`]). Written once per step by [`Backend::step_upload`].
    type Step: Send + Sync;

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

    /// Empty step inputs.
    fn step_new(&self) -> Self::Step;
    /// Writes a step's inputs (one host-to-device copy on a GPU).
    fn step_upload(&self, step: &mut Self::Step, meta: &[TokenMeta], ids: &[u32], sel: &[u32]);
    /// The token metadata of the last upload.
    fn step_meta<'a>(&self, step: &'a Self::Step) -> &'a Self::Meta;

    // --- KV cache -------------------------------------------------------------------------
    /// A cache for `layers` layers of `kv_heads` KV heads of `head_dim` values (no rows yet).
    fn kv_new(&self, layers: usize, kv_heads: usize, head_dim: usize) -> Self::Kv;
    /// Makes row `row` hold at least `capacity` positions, keeping its first `keep` positions.
    fn kv_reserve(&self, kv: &mut Self::Kv, row: usize, capacity: usize, keep: usize);
    fn kv_capacity(&self, kv: &Self::Kv, row: usize) -> usize;
    /// Bytes of one value `kv` stores (default: f32).
    fn kv_value_bytes(&self, kv: &Self::Kv) -> usize {
        let _ = kv;
        4
    }
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

    // --- recurrent (Gated DeltaNet) state ------------------------------------------------
    /// State for `layers` GDN layers of `shape`; a row can be rolled back by at most
    /// `history` tokens into its last step.
    fn gdn_new(&self, layers: usize, shape: GdnShape, history: usize) -> Self::Gdn;
    /// Gives row `row` a zero state (a new sequence).
    fn gdn_open_row(&self, st: &mut Self::Gdn, row: usize);
    fn gdn_release_row(&self, st: &mut Self::Gdn, row: usize);
    /// Copies row `src`'s current state into row `dst` (which cannot roll back afterwards).
    fn gdn_copy_row(&self, st: &mut Self::Gdn, src: usize, dst: usize);
    /// Starts a forward step over `spans`: each row's current state becomes its checkpoint,
    /// which the step's ops read and from which [`Backend::gdn_rollback`] replays.
    fn gdn_begin(&self, st: &mut Self::Gdn, spans: &[RowSpan]);
    /// Makes row `row`'s state (every layer) the state after the first `keep` tokens of its
    /// last step: the checkpoint, the conv window moved over those tokens, and the recurrence
    /// replayed over them with the inputs recorded during the step (the same arithmetic, so
    /// the result is bit-identical to a step that had only those tokens).
    fn gdn_rollback(&self, st: &mut Self::Gdn, row: usize, keep: usize)
        -> Result<(), RuntimeError>;
    /// Depthwise causal convolution of width `shape.conv_kernel` over the step's qkv inputs
    /// `x` (`[T, conv_dim]`) with `weight` (`[conv_dim, conv_kernel]`, tap `conv_kernel - 1`
    /// on the current token), continuing each row's conv window, then SiLU, into `out`.
    /// Updates the windows.
    #[allow(clippy::too_many_arguments)]
    fn causal_conv(
        &self,
        st: &mut Self::Gdn,
        layer: usize,
        x: &Self::Tensor,
        weight: &Self::Tensor,
        spans: &[RowSpan],
        out: &mut Self::Tensor,
    );
    /// Gated delta rule over the step: `qkv` is the conv output (`[T, conv_dim]`; q and k
    /// are L2-normalised here, q scaled by `k_dim^-1/2`), `g` the log decays and `beta` the
    /// write strengths (`[T, v_heads]` each); `out` gets `[T, value_dim]`. Continues and
    /// updates each row's recurrent state (kept in f32).
    #[allow(clippy::too_many_arguments)]
    fn gated_delta(
        &self,
        st: &mut Self::Gdn,
        layer: usize,
        qkv: &Self::Tensor,
        g: &Self::Tensor,
        beta: &Self::Tensor,
        spans: &[RowSpan],
        out: &mut Self::Tensor,
    );
    /// GDN gates in place: `a <- a_neg * softplus(a + dt_bias)` (the log decay g, with
    /// `a_neg = -exp(A_log)`) and `b <- sigmoid(b)` (beta); `a`, `b`: `[T, v_heads]`,
    /// `a_neg`, `dt_bias`: `[1, v_heads]`.
    fn gdn_gates(
        &self,
        a: &mut Self::Tensor,
        b: &mut Self::Tensor,
        a_neg: &Self::Tensor,
        dt_bias: &Self::Tensor,
    );
    /// Gated RMS norm in place over groups of `weight.cols` columns:
    /// `x <- rms_norm(x) * weight * silu(z)`.
    fn rms_norm_gated(
        &self,
        x: &mut Self::Tensor,
        z: &Self::Tensor,
        weight: &Self::Tensor,
        eps: f32,
    );
    /// `x <- x * sigmoid(gate)` (the gated attention output).
    fn sigmoid_mul(&self, x: &mut Self::Tensor, gate: &Self::Tensor);

    // --- ops ------------------------------------------------------------------------------
    /// `out[t] = table[ids[t]]`, dequantized.
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor);
    /// `out = x · wᵀ` (`x: [M, K]`, `w: [N, K]`, `out: [M, N]`).
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor);
    /// [`Backend::matmul`] for a caller that reads only each row's first largest value and
    /// its position (a greedy choice): those are exactly `matmul`'s, bit for bit, while the
    /// other outputs may hold cheaper values below that maximum (the CPU screens the
    /// vocabulary projection with int8 activations and recomputes in f32 only the outputs
    /// that could be the largest).
    fn matmul_argmax(&self, x: &Self::Tensor, w: &Self::Weight, out: &mut Self::Tensor) {
        self.matmul(x, w, out);
    }
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
    /// A hint: `weights` are read, in this order, by the launches after the next attention or
    /// product (`attention`, `step_matmul_*`, `matmul*`). A backend may start moving them
    /// closer while that work runs (the CUDA backend: into L2, cuda/l2_ahead.rs). Nothing
    /// depends on it; the default does nothing.
    fn weights_ahead(&self, _weights: &[&Self::Weight]) {}
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
    /// `x *= s`.
    fn scale(&self, x: &mut Self::Tensor, s: f32);
    /// Grouped dynamic causal convolution along each row's run of consecutive positions
    /// (DFlash2). With `taps = base.rows`, `groups = x.cols / group` and `g = c / group`:
    ///
    /// `out[t][c] = Σ_{o < taps} base[o][c]·x[t−o][c] + dynamic[t][col + o·groups + g]·x[t−o][c]`
    ///
    /// accumulated from 0 for o = 0, 1, ... in that order, base term then dynamic term, every
    /// product and sum rounded to f32. Tap o of token t reads token t − o only when that token
    /// is the same row's position `pos − o` (`meta`); otherwise it adds nothing.
    #[allow(clippy::too_many_arguments)]
    fn grouped_conv(
        &self,
        x: &Self::Tensor,
        base: &Self::Tensor,
        dynamic: &Self::Tensor,
        col: usize,
        group: usize,
        meta: &Self::Meta,
        out: &mut Self::Tensor,
    );
    /// `out[i] = x[rows[i]]`.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[u32], out: &mut Self::Tensor);
    /// `out[at + i] = x[rows[i]]`; `out` keeps its shape and its other rows (it must have x's
    /// columns and at least `at + rows.len()` rows).
    fn gather_rows_at(&self, x: &Self::Tensor, rows: &[u32], out: &mut Self::Tensor, at: usize);
    /// Copies `src` (`[T, c]`) into columns `col..col+c` of `dst` (`[T, C]`).
    fn copy_columns(&self, src: &Self::Tensor, dst: &mut Self::Tensor, col: usize);
    /// Index of the largest value of every row (first one on ties).
    fn argmax_rows(&self, x: &Self::Tensor) -> Vec<u32>;

    // --- step inputs, fusions and graphs (defaults compose the ops above) -----------------

    /// `out[t] = table[ids[t]]` for the ids of the step's last upload.
    fn embed_step(&self, table: &Self::Weight, step: &Self::Step, out: &mut Self::Tensor);
    /// `out[i] = x[sel[i]]` for the selected rows of the step's last upload.
    fn gather_step(&self, x: &Self::Tensor, step: &Self::Step, out: &mut Self::Tensor);

    /// `out += x · wᵀ` (a residual add fused into the product); `scratch` may be used for
    /// the product. Bit-identical to `matmul` then `add`.
    fn matmul_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        out: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
    ) {
        self.matmul(x, w, scratch);
        self.add(out, scratch);
    }

    /// `out = silu(x · gateᵀ) * (x · upᵀ)`; `scratch` may hold the up product.
    /// Bit-identical to `matmul_many` then `silu_mul`.
    fn matmul_swiglu(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        out: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
    ) {
        self.matmul_many(x, &[gate, up], &mut [out, scratch]);
        self.silu_mul(out, scratch);
    }

    // Products over a forward step's activations, whose rows are laid out by `spans` (rows
    // `first..first + count` of each span). The rows of spans marked `prompt` may take a
    // prefill path of the backend (the CUDA backend's tensor-core kernels); every other row
    // takes the path of the plain op, bit for bit. On either path a row's result depends on
    // that row alone (not on the other rows, their number or their order), so a prompt token
    // gets the same bits whether its prompt runs whole or in pieces that ride in other rows'
    // steps, and decode and verify rows keep equal bits. The defaults ignore `spans` (the
    // CPU's products are row-invariant already).

    /// [`Backend::matmul_many`] over a step laid out by `spans` (see above).
    fn step_matmul_many(
        &self,
        x: &Self::Tensor,
        ws: &[&Self::Weight],
        outs: &mut [&mut Self::Tensor],
        spans: &[RowSpan],
    ) {
        let _ = spans;
        self.matmul_many(x, ws, outs)
    }

    /// [`Backend::matmul_add`] over a step laid out by `spans` (see above).
    fn step_matmul_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        out: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
        spans: &[RowSpan],
    ) {
        let _ = spans;
        self.matmul_add(x, w, out, scratch)
    }

    /// [`Backend::matmul_swiglu`] over a step laid out by `spans` (see above).
    fn step_matmul_swiglu(
        &self,
        x: &Self::Tensor,
        gate: &Self::Weight,
        up: &Self::Weight,
        out: &mut Self::Tensor,
        scratch: &mut Self::Tensor,
        spans: &[RowSpan],
    ) {
        let _ = spans;
        self.matmul_swiglu(x, gate, up, out, scratch)
    }

    /// The q/k/v products of an attention layer over a step (`ws` into `outs`, as
    /// [`Backend::step_matmul_many`]), then RoPE of q and k and the KV write of k and v (as
    /// [`Backend::rope_kv_write`]): bit-identical to those two calls, which is the default.
    /// A backend may do both in one pass (the CUDA backend rotates and writes the cache in
    /// the products' epilogue).
    #[allow(clippy::too_many_arguments)]
    fn step_qkv_rope_kv(
        &self,
        x: &Self::Tensor,
        ws: [&Self::Weight; 3],
        outs: [&mut Self::Tensor; 3],
        kv: &mut Self::Kv,
        layer: usize,
        meta: &Self::Meta,
        rope: Rope<'_, Self::Tensor>,
        spans: &[RowSpan],
    ) {
        qkv_then_rope_kv(self, x, ws, outs, kv, layer, meta, rope, spans)
    }

    /// The per-head norms of q and k (in place), then RoPE and the KV write as
    /// [`Backend::rope_kv_write`]: bit-identical to `rms_norm(q)`, `rms_norm(k)`,
    /// `rope_kv_write`, which is the default. A backend may do it in one pass.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_kv_write(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        meta: &Self::Meta,
        norm: QkNorm<'_, Self::Tensor>,
        rope: Rope<'_, Self::Tensor>,
    ) {
        qk_norm_then_rope_kv(self, q, k, v, kv, layer, meta, norm, rope)
    }

    /// The keys-only form of [`Backend::qk_norm_rope_kv_write`] (a DFlash drafter's context:
    /// keys and values, no queries): the per-head norm `k_norm` of k (in place), RoPE of k,
    /// and the KV write of k and v. Bit-identical to `rms_norm(k)`, `rope(k)`, `kv_write`,
    /// which is the default; a backend may do it in one pass.
    #[allow(clippy::too_many_arguments)]
    fn k_norm_rope_kv_write(
        &self,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        meta: &Self::Meta,
        (k_norm, eps): (&Self::Tensor, f32),
        rope: Rope<'_, Self::Tensor>,
    ) {
        k_norm_then_rope_kv(self, k, v, kv, layer, meta, (k_norm, eps), rope)
    }

    /// RoPE of `q` and `k` at each token's position, then the KV write of `k` and `v`.
    /// Bit-identical to `rope(q)`, `rope(k)`, `kv_write`.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_write(
        &self,
        q: &mut Self::Tensor,
        k: &mut Self::Tensor,
        v: &Self::Tensor,
        kv: &mut Self::Kv,
        layer: usize,
        meta: &Self::Meta,
        rope: Rope<'_, Self::Tensor>,
    ) {
        self.rope(q, meta, rope.inv_freq, rope.head_dim, rope.style);
        self.rope(k, meta, rope.inv_freq, rope.head_dim, rope.style);
        self.kv_write(kv, layer, k, v, meta);
    }

    /// A number no other model of this backend gets, for [`GraphKey::owner`].
    fn graph_owner(&self) -> u64 {
        0
    }

    /// Runs `f`, which enqueues one step's device work, possibly as a replay of a graph
    /// captured from an earlier call with the same `key`. The caller guarantees that every
    /// call with one key enqueues the same work on the same tensors, already shaped before
    /// the call (so that no op reallocates), reading what changes between steps from device
    /// memory only (step inputs, KV), and that `f` does nothing else that must happen every
    /// step: on a replay `f` is not called. The default runs `f`.
    fn graph(&self, key: GraphKey, f: &mut dyn FnMut()) {
        let _ = key;
        f()
    }

    // --- token choice on the device (see `choice`) -----------------------------------------
    // Each op returns `None` when the backend does not choose tokens itself: the caller then
    // copies the logits and chooses on the host, with the engine's code, which is the
    // definition these ops reproduce. The CPU backend declines them all (its logits are
    // already on the host).

    /// One token per row of `logits` (`rows[i]` for row i).
    fn sample_rows(&self, logits: &Self::Tensor, rows: &[SampleRow<'_>]) -> Option<Vec<u32>> {
        let _ = (logits, rows);
        None
    }

    /// Drafts of every row: `logits` holds `slots` rows per row; returns `rows.len() * slots`
    /// ids, row-major.
    fn draft_rows(
        &self,
        logits: &Self::Tensor,
        slots: usize,
        rows: &[DraftRow<'_>],
    ) -> Option<Vec<u32>> {
        let _ = (logits, slots, rows);
        None
    }

    /// The `k` first items (`k <= cols`) of every row of `x` by value, descending as
    /// `f32::total_cmp` ranks values, NaN as -inf, ties to the lower index (the order of
    /// `dflash_models::selector::top_k_indices`): `(ids, raw values)`, row-major `[rows][k]`.
    /// The DFlash2 selector's candidates, without the logits' trip to the host.
    fn top_k_rows(&self, x: &Self::Tensor, k: usize) -> Option<(Vec<u32>, Vec<f32>)> {
        let _ = (x, k);
        None
    }

    /// DFlash verification of every row: `target` holds `block` rows per row, `draft` the
    /// drafter's `block - 1` rows per row (read only for rows sampled at T > 0).
    fn verify_rows(
        &self,
        target: &Self::Tensor,
        draft: &Self::Tensor,
        block: usize,
        rows: &[VerifyRow<'_>],
    ) -> Option<Vec<Verdict>> {
        let _ = (target, draft, block, rows);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(first: u32, count: u32, prompt: bool) -> RowSpan {
        RowSpan {
            first,
            count,
            prompt,
            ..RowSpan::default()
        }
    }

    #[test]
    fn prompt_runs_merge_neighbours_and_cover_every_row() {
        let spans = [
            span(0, 3, false),
            span(3, 1, false),
            span(4, 5, true),
            span(9, 2, true),
            span(12, 1, false),
        ];
        assert_eq!(
            prompt_runs(15, &spans),
            vec![(0..4, false), (4..11, true), (11..15, false)]
        );
        assert_eq!(prompt_runs(4, &[span(0, 4, true)]), vec![(0..4, true)]);
        assert_eq!(prompt_runs(0, &[]), vec![]);
    }

    #[test]
    #[should_panic(expected = "in order")]
    fn prompt_runs_reject_overlapping_spans() {
        prompt_runs(8, &[span(0, 4, true), span(2, 4, false)]);
    }
}
