//! Who chooses a row's tokens: the device, or the host from copied logits.
//!
//! A row whose parameters the device understands ([`SamplingParams::device`]) chooses on the
//! device when the backend offers token choice (`Backend::sample_rows`, `draft_rows`,
//! `verify_rows`); then only ids come back. Every other row — on a backend that declines (the
//! CPU backend), or one whose logits the caller wants — chooses here, on the host, with the
//! engine's definition. Uniforms are drawn before the split, in the same order on both paths,
//! so a row's random stream does not depend on where it was chosen.

use dflash_runtime::choice::ChoiceParams;
use dflash_runtime::Backend;

use crate::sampling::{Sampler, SamplingParams};

/// Per-row sampling state shared by the decoders.
pub(crate) struct RowSampling {
    pub params: SamplingParams,
    /// `params` for the device (`None`: this row chooses on the host).
    pub device: Option<ChoiceParams>,
    pub sampler: Sampler,
    /// Prompt and generated ids (for the repetition penalty).
    pub history: Vec<u32>,
    /// With `params.keep_logits`: the logits behind the tokens of the last start or step.
    pub logits: Vec<f32>,
}

impl RowSampling {
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        Self {
            params: params.clone(),
            device: params.device(),
            sampler: Sampler::new(params.seed),
            history: prompt.to_vec(),
            logits: Vec::new(),
        }
    }

    /// The uniform for one sampled token (greedy rows draw none).
    pub fn uniform(&mut self) -> f32 {
        if self.params.is_greedy() {
            0.0
        } else {
            self.sampler.uniform()
        }
    }

    /// `n` uniforms (none drawn when greedy).
    pub fn uniforms(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }

    /// The token at `u` of the distribution of `logits` (the host definition).
    pub fn choose_host(&self, logits: &[f32], u: f32, scratch: &mut Vec<f32>) -> u32 {
        self.params
            .distribution(logits, &self.history, scratch)
            .pick(u)
    }
}

/// Rows that choose on the device (indices into the batch) and those that choose on the host.
pub(crate) fn split<'a>(rows: impl Iterator<Item = &'a RowSampling>) -> (Vec<usize>, Vec<usize>) {
    let mut device = Vec::new();
    let mut host = Vec::new();
    for (i, r) in rows.enumerate() {
        if r.device.is_some() {
            device.push(i);
        } else {
            host.push(i);
        }
    }
    (device, host)
}

/// Tensor row indices of the batch rows `rows`, each owning `per` consecutive tensor rows
/// from tensor row `first` on.
fn tensor_rows(first: usize, rows: &[usize], per: usize) -> Vec<u32> {
    rows.iter()
        .flat_map(|&i| (first + i * per..first + (i + 1) * per).map(|r| r as u32))
        .collect()
}

/// Where a batch's rows sit in a tensor: batch row i owns tensor rows
/// `first + i * per .. first + (i + 1) * per`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub first: usize,
    pub per: usize,
}

impl Layout {
    /// `per` rows each from the tensor's first row.
    pub fn from_start(per: usize) -> Self {
        Self { first: 0, per }
    }
}

/// Runs `f` on the tensor rows of batch rows `rows` (distinct, ascending) of `t`, laid out
/// as `at`: on `t` itself when those are all of its rows, else on a gathered copy in `tmp`.
pub(crate) fn with_rows<B: Backend, R>(
    b: &B,
    t: &B::Tensor,
    at: Layout,
    rows: &[usize],
    tmp: &mut Option<B::Tensor>,
    f: impl FnOnce(&B::Tensor) -> R,
) -> R {
    if at.first == 0 && rows.len() * at.per == b.shape(t).0 {
        return f(t);
    }
    let out = tmp.get_or_insert_with(|| b.tensor(0, 0));
    b.gather_rows(t, &tensor_rows(at.first, rows, at.per), out);
    f(out)
}

/// Copies the tensor rows of batch rows `rows` (laid out as `at`) of `t` to `out`, in that
/// order.
pub(crate) fn copy_rows<B: Backend>(
    b: &B,
    t: &B::Tensor,
    at: Layout,
    rows: &[usize],
    tmp: &mut Option<B::Tensor>,
    out: &mut Vec<f32>,
) {
    with_rows(b, t, at, rows, tmp, |x| b.copy_to_host(x, out));
}
