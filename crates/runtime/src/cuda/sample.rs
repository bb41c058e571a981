//! Token choice on the GPU (`kernels/sample.cu`): argmax, sampling, DFlash drafts and
//! verification. Each op uploads its per-row inputs in one copy (parameters, the distinct
//! history ids of penalised rows, uniforms, drafts), launches, and copies back only ids (and
//! accept counts).

use cudarc::driver::{CudaFunction, CudaSlice};

use super::device::{ensure, int, Arg, Device};
use super::tensor::CudaTensor;
use crate::choice::{ChoiceParams, DraftRow, SampleRow, Verdict, VerifyRow};

/// Threads of the one-block-per-row kernels (CH_THREADS in sample.cu).
pub(super) const CH_THREADS: u32 = 1024;
/// Columns per block of the first argmax stage (ARGMAX_CHUNK in sample.cu).
pub(super) const ARGMAX_CHUNK: usize = 4096;
/// Threads per block of the first argmax stage (ARGMAX_THREADS in sample.cu).
pub(super) const ARGMAX_THREADS: u32 = 256;
/// Words of one row's parameters (ChParams in sample.cu).
const PARAM_WORDS: usize = 8;

/// The functions of sample.cu.
pub(crate) struct SampleKernels {
    argmax_part: CudaFunction,
    argmax_final: CudaFunction,
    sample_rows: CudaFunction,
    draft_rows: CudaFunction,
    verify_slots: CudaFunction,
    verify_finish: CudaFunction,
    topk_rows: CudaFunction,
}

impl SampleKernels {
    pub fn load(get: impl Fn(&str) -> Result<CudaFunction, String>) -> Result<Self, String> {
        Ok(Self {
            argmax_part: get("argmax_part_f32")?,
            argmax_final: get("argmax_final")?,
            sample_rows: get("sample_rows_f32")?,
            draft_rows: get("draft_rows_f32")?,
            verify_slots: get("verify_slots_f32")?,
            verify_finish: get("verify_finish")?,
            topk_rows: get("topk_rows_f32")?,
        })
    }
}

/// Buffers of the token-choice ops, reused across calls.
#[derive(Default)]
pub(crate) struct SampleScratch {
    /// Work rows: each row's processed logits, then probabilities.
    work: Option<CudaSlice<f32>>,
    /// The packed inputs (see [`Inputs`]).
    input: Option<CudaSlice<u32>>,
    /// argmax partial values.
    part_v: Option<CudaSlice<f32>>,
    /// argmax partial indices, then per-token results.
    part_i: Option<CudaSlice<u32>>,
    /// Results copied back.
    out: Option<CudaSlice<u32>>,
}

/// The per-row inputs of one op, packed as u32 words for one upload.
#[derive(Default)]
struct Inputs {
    words: Vec<u32>,
}

impl Inputs {
    /// Appends `vals`; returns their word offset.
    fn push(&mut self, vals: impl IntoIterator<Item = u32>) -> usize {
        let at = self.words.len();
        self.words.extend(vals);
        at
    }

    /// Parameters of every row (ChParams) followed by the distinct history ids of the
    /// penalised rows; returns the offset of the parameters and the history.
    fn params<'a>(
        &mut self,
        rows: impl Iterator<Item = (ChoiceParams, &'a [u32])>,
    ) -> (usize, usize) {
        let rows: Vec<_> = rows.collect();
        let mut hist: Vec<u32> = Vec::new();
        let at = self.words.len();
        for (p, h) in &rows {
            let off = hist.len();
            if p.penalized() {
                let mut ids = h.to_vec();
                ids.sort_unstable();
                ids.dedup();
                hist.extend_from_slice(&ids);
            }
            let words: [u32; PARAM_WORDS] = [
                p.temperature.to_bits(),
                p.top_k,
                p.top_p.to_bits(),
                p.min_p.to_bits(),
                p.repetition_penalty.to_bits(),
                off as u32,
                (hist.len() - off) as u32,
                0,
            ];
            self.words.extend(words);
        }
        (at, self.push(hist))
    }

    fn floats(&mut self, vals: impl IntoIterator<Item = f32>) -> usize {
        self.push(vals.into_iter().map(f32::to_bits))
    }

    /// Uploads the words; returns the device address of the first.
    fn upload(&self, dev: &Device, s: &mut SampleScratch) -> u64 {
        let p = ensure(&dev.stream, &dev.epoch, &mut s.input, self.words.len());
        dev.htod(&self.words, p);
        p
    }
}

fn word(base: u64, at: usize) -> Arg {
    Arg::Ptr(base + 4 * at as u64)
}

/// Whether every row takes the first largest raw logit (no sampling, no penalty).
fn plain_argmax(params: impl Iterator<Item = ChoiceParams>) -> bool {
    params.into_iter().all(|p| p.is_greedy() && !p.penalized())
}

/// Work rows for `rows` logits rows of `cols` values.
fn work(dev: &Device, s: &mut SampleScratch, rows: usize, cols: usize) -> u64 {
    ensure(&dev.stream, &dev.epoch, &mut s.work, rows * cols)
}

/// Launches the two argmax stages over every row of `x`; returns the device address of the
/// `x.rows` indices (in `s.part_i`, after the partial results).
fn argmax_device(dev: &Device, s: &mut SampleScratch, x: &CudaTensor) -> u64 {
    let (rows, cols) = (x.rows, x.cols);
    let chunks = cols.div_ceil(ARGMAX_CHUNK);
    let pv = ensure(&dev.stream, &dev.epoch, &mut s.part_v, rows * chunks);
    let pi = ensure(&dev.stream, &dev.epoch, &mut s.part_i, rows * chunks + rows);
    let out = pi + 4 * (rows * chunks) as u64;
    dev.launch(
        &dev.k.sample.argmax_part,
        "argmax_part",
        (chunks as u32, rows as u32, 1),
        (ARGMAX_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(dev.ptr(&x.buf)),
            int(cols),
            Arg::Ptr(pv),
            Arg::Ptr(pi),
        ],
    );
    dev.launch(
        &dev.k.sample.argmax_final,
        "argmax_final",
        (rows as u32, 1, 1),
        (32, 1, 1),
        0,
        &[Arg::Ptr(pv), Arg::Ptr(pi), int(chunks), Arg::Ptr(out)],
    );
    out
}

/// The `k` first items of every row of `x` by value (see [`crate::Backend::top_k_rows`]):
/// ids and raw values, row-major `[rows][k]`.
pub(crate) fn top_k_rows(dev: &Device, x: &CudaTensor, k: usize) -> (Vec<u32>, Vec<f32>) {
    assert!(k <= x.cols, "top_k_rows: {k} of {} columns", x.cols);
    let n = x.rows * k;
    if n == 0 {
        return (Vec::new(), Vec::new());
    }
    dev.bind();
    let mut s = dev.sample.lock().expect("sample scratch lock");
    let out = ensure(&dev.stream, &dev.epoch, &mut s.out, 2 * n);
    dev.launch(
        &dev.k.sample.topk_rows,
        "topk_rows",
        (x.rows as u32, 1, 1),
        (CH_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(dev.ptr(&x.buf)),
            int(x.cols),
            int(k),
            Arg::Ptr(out),
            Arg::Ptr(out + 4 * n as u64),
        ],
    );
    let words = results(dev, out, 2 * n);
    let vals = words[n..].iter().map(|&w| f32::from_bits(w)).collect();
    (words[..n].to_vec(), vals)
}

/// Copies `n` u32 results from `src` back.
fn results(dev: &Device, src: u64, n: usize) -> Vec<u32> {
    let mut out = vec![0u32; n];
    dev.dtoh(src, &mut out);
    out
}

/// Index of the first largest value of every row.
pub(crate) fn argmax_rows(dev: &Device, x: &CudaTensor) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    if x.cols == 0 {
        return vec![0; x.rows];
    }
    dev.bind();
    let mut s = dev.sample.lock().expect("sample scratch lock");
    let out = argmax_device(dev, &mut s, x);
    results(dev, out, x.rows)
}

/// One token per row of `logits`.
pub(crate) fn sample_rows(dev: &Device, logits: &CudaTensor, rows: &[SampleRow<'_>]) -> Vec<u32> {
    assert_eq!(
        logits.rows,
        rows.len(),
        "sample_rows: one row of logits per row"
    );
    if plain_argmax(rows.iter().map(|r| r.params)) || logits.cols == 0 {
        return argmax_rows(dev, logits);
    }
    let v = logits.cols;
    dev.bind();
    let mut s = dev.sample.lock().expect("sample scratch lock");
    let mut inp = Inputs::default();
    let (par, hist) = inp.params(rows.iter().map(|r| (r.params, r.history)));
    let u = inp.floats(rows.iter().map(|r| r.u));
    let base = inp.upload(dev, &mut s);
    let w = work(dev, &mut s, rows.len(), v);
    let out = ensure(&dev.stream, &dev.epoch, &mut s.out, rows.len());
    dev.launch(
        &dev.k.sample.sample_rows,
        "sample_rows",
        (rows.len() as u32, 1, 1),
        (CH_THREADS, 1, 1),
        0,
        &[
            Arg::Ptr(dev.ptr(&logits.buf)),
            Arg::Ptr(w),
            int(v),
            word(base, par),
            word(base, hist),
            word(base, u),
            Arg::Ptr(out),
        ],
    );
    results(dev, out, rows.len())
}

/// Drafts of every row, `slots` per row, row-major.
pub(crate) fn draft_rows(
    dev: &Device,
    logits: &CudaTensor,
    slots: usize,
    rows: &[DraftRow<'_>],
) -> Vec<u32> {
    assert_eq!(
        logits.rows,
        rows.len() * slots,
        "draft_rows: `slots` rows of logits per row"
    );
    for r in rows {
        assert!(
            r.params.is_greedy() || r.u.len() == slots,
            "draft_rows: one uniform per slot"
        );
    }
    if slots == 0 || rows.is_empty() {
        return Vec::new();
    }
    if plain_argmax(rows.iter().map(|r| r.params)) || logits.cols == 0 {
        return argmax_rows(dev, logits);
    }
    let v = logits.cols;
    dev.bind();
    let mut s = dev.sample.lock().expect("sample scratch lock");
    let mut inp = Inputs::default();
    let (par, hist) = inp.params(rows.iter().map(|r| (r.params, r.history)));
    let u = inp.floats(
        rows.iter()
            .flat_map(|r| (0..slots).map(|i| r.u.get(i).copied().unwrap_or(0.0))),
    );
    let base = inp.upload(dev, &mut s);
    let w = work(dev, &mut s, rows.len() * slots, v);
    let drafts = ensure(&dev.stream, &dev.epoch, &mut s.out, rows.len() * slots);
    // A penalised row's slot depends on the drafts before it: one launch per slot then.
    let sequential = rows.iter().any(|r| r.params.penalized());
    let launches: Vec<(usize, usize)> = if sequential {
        (0..slots).map(|i| (i, 1)).collect()
    } else {
        vec![(0, slots)]
    };
    for (slot0, count) in launches {
        dev.launch(
            &dev.k.sample.draft_rows,
            "draft_rows",
            (count as u32, rows.len() as u32, 1),
            (CH_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(dev.ptr(&logits.buf)),
                Arg::Ptr(w),
                int(v),
                int(slots),
                int(slot0),
                word(base, par),
                word(base, hist),
                word(base, u),
                Arg::Ptr(drafts),
            ],
        );
    }
    results(dev, drafts, rows.len() * slots)
}

/// DFlash verification of every row (see `Backend::verify_rows`).
pub(crate) fn verify_rows(
    dev: &Device,
    target: &CudaTensor,
    draft: &CudaTensor,
    block: usize,
    rows: &[VerifyRow<'_>],
) -> Vec<Verdict> {
    assert!(block >= 1, "verify_rows: a block has at least one slot");
    let n = block - 1;
    assert_eq!(
        target.rows,
        rows.len() * block,
        "verify_rows: `block` rows of target logits per row"
    );
    for r in rows {
        assert_eq!(r.drafts.len(), n, "verify_rows: block - 1 drafts per row");
        assert!(
            r.params.is_greedy() || r.accept_u.len() == n,
            "verify_rows: one accept uniform per draft"
        );
    }
    let sampled = rows.iter().any(|r| !r.params.is_greedy());
    if sampled && n > 0 {
        assert_eq!(
            (draft.rows, draft.cols),
            (rows.len() * n, target.cols),
            "verify_rows: block - 1 rows of drafter logits per row"
        );
    }
    if rows.is_empty() {
        return Vec::new();
    }
    let v = target.cols;
    assert!(v > 0, "verify_rows: logits of an empty vocabulary");
    dev.bind();
    let mut s = dev.sample.lock().expect("sample scratch lock");
    let mut inp = Inputs::default();
    let (par, hist) = inp.params(rows.iter().map(|r| (r.params, r.history)));
    let drafts = inp.push(rows.iter().flat_map(|r| r.drafts.iter().copied()));
    let u_acc = inp.floats(
        rows.iter()
            .flat_map(|r| (0..n).map(|i| r.accept_u.get(i).copied().unwrap_or(0.0))),
    );
    let u_last = inp.floats(rows.iter().map(|r| r.last_u));
    let base = inp.upload(dev, &mut s);
    let tokens = rows.len() * block;
    let out = ensure(
        &dev.stream,
        &dev.epoch,
        &mut s.out,
        2 * tokens + 2 * rows.len(),
    );
    let (accept, cand, verdicts) = (out, out + 4 * tokens as u64, out + 8 * tokens as u64);
    let amax = if plain_argmax(rows.iter().map(|r| r.params)) {
        argmax_device(dev, &mut s, target)
    } else {
        let w = work(dev, &mut s, 2 * tokens, v);
        dev.launch(
            &dev.k.sample.verify_slots,
            "verify_slots",
            (block as u32, rows.len() as u32, 1),
            (CH_THREADS, 1, 1),
            0,
            &[
                Arg::Ptr(dev.ptr(&target.buf)),
                Arg::Ptr(dev.ptr(&draft.buf)),
                Arg::Ptr(w),
                int(v),
                int(block),
                word(base, par),
                word(base, hist),
                word(base, drafts),
                word(base, u_acc),
                word(base, u_last),
                Arg::Ptr(accept),
                Arg::Ptr(cand),
            ],
        );
        0
    };
    dev.launch(
        &dev.k.sample.verify_finish,
        "verify_finish",
        (rows.len().div_ceil(128) as u32, 1, 1),
        (128, 1, 1),
        0,
        &[
            int(rows.len()),
            int(block),
            Arg::Ptr(accept),
            Arg::Ptr(cand),
            Arg::Ptr(amax),
            word(base, drafts),
            Arg::Ptr(verdicts),
        ],
    );
    results(dev, verdicts, 2 * rows.len())
        .chunks_exact(2)
        .map(|c| Verdict {
            accepted: c[0] as usize,
            token: c[1],
        })
        .collect()
}
