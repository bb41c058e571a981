//! Shared test support: the default model, prompts, and an oracle drafter that proposes a
//! known continuation with errors injected at chosen block slots.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::Arc;

use dflash_engine::ar::ArDecoder;
use dflash_engine::session::run_batch;
use dflash_engine::{Completion, Request, SamplingParams};
use dflash_models::chat::Message;
use dflash_models::default_model::{ensure_default_model, Silent};
use dflash_models::TargetModel;
use dflash_models::{load_model, CandidateLattice, Drafter, LoadedModel};
use dflash_runtime::cpu::{CpuBackend, CpuTensor};
use dflash_runtime::Backend;

pub type Cpu = CpuBackend;

pub fn backend() -> Arc<Cpu> {
    Arc::new(CpuBackend::new(0))
}

pub fn default_model(b: &Arc<Cpu>) -> LoadedModel<Cpu> {
    let path = ensure_default_model(&Silent).expect("the default model must be obtainable");
    load_model(b.clone(), &path).unwrap()
}

pub const PROMPTS: [&str; 20] = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "List three benefits of regular exercise.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright?",
    "Give me a recipe for a simple tomato soup.",
    "What are the planets of the solar system?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a short story that starts with 'The door creaked open'.",
    "Explain what a linked list is.",
    "Why is the sky blue?",
    "Write a SQL query that counts rows in a table named users.",
    "What is the difference between weather and climate?",
    "Describe the water cycle.",
    "Write a limerick about a cat who loves coffee.",
    "What should I pack for a weekend camping trip?",
    "Explain recursion with an example in Rust.",
];

pub fn chat_prompt(m: &LoadedModel<Cpu>, text: &str) -> Vec<u32> {
    let rendered = m
        .template
        .as_ref()
        .unwrap()
        .render(&[Message::new("user", text)], true)
        .unwrap();
    m.tokenizer.encode(&rendered, false).unwrap()
}

pub fn request(prompt: Vec<u32>, max_tokens: usize, params: SamplingParams) -> Request {
    Request {
        prompt,
        max_tokens,
        params,
        stop_strings: Vec::new(),
    }
}

/// Greedy autoregressive completions, one row at a time (the reference).
pub fn ar_reference(
    target: TargetModel<Cpu>,
    tok: &dflash_models::tokenizer::TextTokenizer,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Completion>, TargetModel<Cpu>) {
    let mut dec = ArDecoder::new(target);
    let mut out = Vec::new();
    for p in prompts {
        let r = request(p.clone(), max_tokens, SamplingParams::greedy());
        out.extend(run_batch(&mut dec, tok, &[r], &mut |_, _| {}).unwrap());
    }
    (out, dec.target)
}

/// Where an [`Oracle`] puts its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Row r in round k errs at slot `(k + r * 5) % block`.
    Rotating,
    /// Row r in round k errs at a slot hashed from `(seed, k, r)`.
    Seeded(u64),
    /// In round k only the `k % n`-th of the round's n rows errs, at slot `(k + r * 5) % block`;
    /// the others accept the whole block (cheap under the clamp: the round's minimum is one
    /// row's count, which still takes every value).
    OneRowPerRound,
}

/// A drafter that knows each row's true continuation and proposes it, replacing the token at
/// one block slot per round with a wrong one. The slot for row r in round k is
/// `(k + r * 5) % block` by default (see [`Schedule`]); slot 0 means no error, so every accept
/// count 0..block-1 occurs.
pub struct Oracle {
    block: usize,
    vocab: usize,
    taps: Vec<usize>,
    /// Full token sequences (prompt + continuation) for rows yet to be opened, in order.
    pub queue: VecDeque<Vec<u32>>,
    /// Optional, parallel to `queue`: whether that sequence's next token is an end of sequence
    /// (one of `stop_ids`). The oracle then proposes a token that is no stop token there, so
    /// the row's accept count stays exactly predictable in the round that ends it.
    pub ended: VecDeque<bool>,
    /// The target's end-of-sequence tokens (needed with `ended`).
    pub stop_ids: Vec<u32>,
    refs: Vec<Vec<u32>>,
    ends: Vec<bool>,
    ctx: Vec<usize>,
    round: usize,
    logits: CpuTensor,
    /// Accept counts the oracle expects, per round, per row.
    pub expected_accepts: Vec<Vec<usize>>,
    /// Per round, per row (parallel to `expected_accepts`): the oracle's row id and whether the
    /// expected count is exact for a greedy target that wrote the known sequence (every slot up
    /// to the first wrong proposal lay inside the known sequence).
    pub round_rows: Vec<Vec<(usize, bool)>>,
    /// Where the errors go.
    pub schedule: Schedule,
    /// Propose through a DFlash2-style candidate lattice instead of logits (see
    /// [`Oracle::selector`]).
    pub selector: Option<CandidateLattice>,
}

impl Oracle {
    pub fn new(block: usize, vocab: usize, taps: Vec<usize>) -> Self {
        Self {
            block,
            vocab,
            taps,
            queue: VecDeque::new(),
            ended: VecDeque::new(),
            stop_ids: Vec::new(),
            refs: Vec::new(),
            ends: Vec::new(),
            ctx: Vec::new(),
            round: 0,
            logits: CpuTensor::default(),
            expected_accepts: Vec::new(),
            round_rows: Vec::new(),
            schedule: Schedule::Rotating,
            selector: None,
        }
    }

    /// Makes the oracle propose through a candidate lattice, the way a DFlash2 drafter does:
    /// at every slot its intended token is a candidate that only wins through the transition
    /// score from the intended token of the slot before (the anchor for the first slot); a
    /// decoy has the higher unary score. So the engine proposes the oracle's tokens only if it
    /// walks the lattice along its own choices.
    pub fn selector(mut self) -> Self {
        self.selector = Some(CandidateLattice::new(4, self.block - 1));
        self
    }

    /// An oracle with errors where `schedule` puts them.
    pub fn with_schedule(block: usize, vocab: usize, taps: Vec<usize>, schedule: Schedule) -> Self {
        Self {
            schedule,
            ..Self::new(block, vocab, taps)
        }
    }

    /// Queues the next row's known continuation: `prompt` followed by what B=1 greedy decoding
    /// wrote for it (`reference`), noting whether it ended with an end-of-sequence token.
    pub fn expect(&mut self, prompt: &[u32], reference: &Completion) {
        self.queue
            .push_back(prompt.iter().chain(&reference.tokens).copied().collect());
        self.ended
            .push_back(reference.finish_reason == dflash_engine::FinishReason::Stop);
    }

    /// The error slot of oracle row `row`, the `index`-th of `n` rows this round.
    fn error_slot(&self, row: usize, index: usize, n: usize, block: usize) -> usize {
        let rotating = (self.round + row * 5) % block;
        match self.schedule {
            Schedule::Rotating => rotating,
            Schedule::OneRowPerRound if index == self.round % n => rotating,
            Schedule::OneRowPerRound => 0,
            Schedule::Seeded(s) => {
                // splitmix64 of (seed, round, row).
                let mut z = s
                    ^ (self.round as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ (row as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                (z % block as u64) as usize
            }
        }
    }

    /// The accept counts the oracle built its rounds to produce, over every round so far.
    pub fn accept_counts_seen(&self) -> std::collections::BTreeSet<usize> {
        self.expected_accepts.iter().flatten().copied().collect()
    }

    /// Rounds in which the rows' expected accept counts (exact ones only) were not all equal.
    pub fn rounds_with_different_accepts(&self) -> usize {
        self.expected_accepts
            .iter()
            .zip(&self.round_rows)
            .filter(|(acc, rows)| {
                let exact: Vec<usize> = acc
                    .iter()
                    .zip(rows.iter())
                    .filter(|(_, r)| r.1)
                    .map(|(&a, _)| a)
                    .collect();
                exact.iter().min() != exact.iter().max()
            })
            .count()
    }

    /// Oracle rows that took part in at least one round.
    pub fn rows_seen(&self) -> std::collections::BTreeSet<usize> {
        self.round_rows.iter().flatten().map(|r| r.0).collect()
    }

    /// What each oracle row's total accepted count must be under `policy`, for rows whose
    /// every round was exact (rows in rounds with an inexact entry are left out; under the
    /// clamp an inexact entry makes the whole round's minimum unknown).
    pub fn expected_totals(&self, clamp: bool) -> std::collections::BTreeMap<usize, usize> {
        let mut totals = std::collections::BTreeMap::new();
        let mut unknown = std::collections::BTreeSet::new();
        for (acc, rows) in self.expected_accepts.iter().zip(&self.round_rows) {
            let all_exact = rows.iter().all(|r| r.1);
            let floor = acc.iter().copied().min().unwrap_or(0);
            for (&a, &(row, exact)) in acc.iter().zip(rows) {
                let known = if clamp { all_exact } else { exact };
                if known {
                    *totals.entry(row).or_insert(0) += if clamp { floor } else { a };
                } else {
                    unknown.insert(row);
                }
            }
        }
        totals.retain(|r, _| !unknown.contains(r));
        totals
    }
}

impl Drafter for Oracle {
    type B = Cpu;

    fn block_size(&self) -> usize {
        self.block
    }

    fn tap_layers(&self) -> &[usize] {
        &self.taps
    }

    fn new_row(&mut self, _capacity: usize) -> dflash_models::Result<usize> {
        let seq = self.queue.pop_front().expect("a reference for every row");
        self.refs.push(seq);
        self.ends.push(self.ended.pop_front().unwrap_or(false));
        self.ctx.push(0);
        Ok(self.refs.len() - 1)
    }

    fn release_row(&mut self, _row: usize) {}

    /// The oracle keeps no KV cache.
    fn kv_usage(&self) -> dflash_models::KvUsage {
        dflash_models::KvUsage::default()
    }

    fn context_len(&self, row: usize) -> usize {
        self.ctx[row]
    }

    fn extend(
        &mut self,
        rows: &[(usize, usize)],
        _taps: &CpuTensor,
        _tap_rows: &[u32],
    ) -> dflash_models::Result<()> {
        for &(r, n) in rows {
            self.ctx[r] += n;
        }
        Ok(())
    }

    fn draft(
        &mut self,
        rows: &[(usize, u32)],
        block: usize,
        _embed: &dflash_runtime::cpu::CpuWeight,
        _lm_head: &dflash_runtime::cpu::CpuWeight,
    ) -> dflash_models::Result<()> {
        let v = self.vocab;
        self.logits = CpuTensor::zeros(rows.len() * (block - 1), v);
        if let Some(l) = &mut self.selector {
            l.reset(4, block - 1);
        }
        let mut accepts = Vec::new();
        let mut round_rows = Vec::new();
        for (i, &(r, cur)) in rows.iter().enumerate() {
            let start = self.ctx[r];
            let seq = &self.refs[r];
            assert_eq!(
                seq.get(start),
                Some(&cur),
                "oracle row {r} is in step with the decoder"
            );
            let err = self.error_slot(r, i, rows.len(), block);
            let no_stop = (0..v as u32)
                .find(|t| !self.stop_ids.contains(t))
                .expect("a token that does not end the sequence");
            let mut expect = block - 1;
            // The first slot whose proposal is known to be wrong, and the first slot whose truth
            // is unknown.
            let (mut wrong, mut unknown) = (None, None);
            for j in 1..block {
                let pos = start + j;
                let truth = seq.get(pos).copied();
                if truth.is_none() && self.ends[r] && pos == seq.len() {
                    // The target ends the sequence here: propose anything else.
                    wrong.get_or_insert(j);
                    expect = expect.min(j - 1);
                    self.logits.row_mut(i * (block - 1) + j - 1)[no_stop as usize] = 30.0;
                    continue;
                }
                if truth.is_none() {
                    unknown.get_or_insert(j);
                }
                let truth = truth.unwrap_or(0);
                let tok = if j == err {
                    (truth + 1) % v as u32
                } else {
                    truth
                };
                if j == err {
                    wrong.get_or_insert(j);
                    expect = expect.min(j - 1);
                }
                self.logits.row_mut(i * (block - 1) + j - 1)[tok as usize] = 30.0;
            }
            let exact = match (wrong, unknown) {
                (_, None) => true,
                (Some(w), Some(u)) => w < u,
                (None, Some(_)) => false,
            };
            if let Some(l) = &mut self.selector {
                let chosen: Vec<u32> = (0..block - 1)
                    .map(|j| {
                        let row = self.logits.row(i * (block - 1) + j);
                        dflash_runtime::cpu::ops::elementwise::argmax(row)
                    })
                    .collect();
                let (ids, scores) = l.push_row_mut();
                for (j, &tok) in chosen.iter().enumerate() {
                    // Candidates: decoy, the intended token, two fillers (distinct ids).
                    let c = [
                        (tok + 7) % v as u32,
                        tok,
                        (tok + 8) % v as u32,
                        (tok + 9) % v as u32,
                    ];
                    ids[j * 4..j * 4 + 4].copy_from_slice(&c);
                    for prev in 0..4 {
                        let bonus = if j == 0 || prev == 1 { 2.0 } else { 0.0 };
                        let at = (j * 4 + prev) * 4;
                        scores[at..at + 4].copy_from_slice(&[1.0, bonus, -1.0, -1.0]);
                    }
                }
            }
            accepts.push(expect);
            round_rows.push((r, exact));
        }
        self.expected_accepts.push(accepts);
        self.round_rows.push(round_rows);
        self.round += 1;
        Ok(())
    }

    fn logits(&self) -> &CpuTensor {
        &self.logits
    }

    fn lattice(&self) -> Option<&CandidateLattice> {
        self.selector.as_ref()
    }
}

/// Turns per-row completions into `prompt + tokens` sequences for the oracle.
pub fn sequences(prompts: &[Vec<u32>], done: &[Completion]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(done)
        .map(|(p, c)| p.iter().chain(&c.tokens).copied().collect())
        .collect()
}

/// [`sharp_tiny_gguf`] written once to a temporary file (alive until the test binary exits).
pub fn sharp_tiny_path() -> &'static std::path::PathBuf {
    static P: std::sync::OnceLock<(tempfile::TempDir, std::path::PathBuf)> =
        std::sync::OnceLock::new();
    &P.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        std::fs::write(&path, sharp_tiny_gguf()).unwrap();
        (dir, path)
    })
    .1
}

/// A tiny synthetic target whose outputs depend on the context: `SyntheticSpec::tiny()` with
/// f32 matrices and an untied output head scaled up 4x (logits of standard deviation about
/// 2.3). With tied embeddings the tiny models mostly repeat their last token; with the stock
/// untied head their distributions are almost uniform.
pub fn sharp_tiny_gguf() -> Vec<u8> {
    use dflash_models::source::gguf::GgufFile;
    use dflash_models::synthetic::{synthetic_gguf, SyntheticSpec};
    let spec = SyntheticSpec {
        tied_embeddings: false,
        dtype: dflash_runtime::DType::F32,
        ..SyntheticSpec::tiny()
    };
    let mut bytes = synthetic_gguf(&spec);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    std::fs::write(&path, &bytes).unwrap();
    let head = GgufFile::open(&path).unwrap().tensors["output.weight"].clone();
    assert_eq!(head.ggml_type, dflash_runtime::DType::F32.ggml_id());
    let range = head.start as usize..(head.start + head.len) as usize;
    for x in bytes[range].chunks_exact_mut(4) {
        let v = f32::from_le_bytes(x.try_into().unwrap()) * 4.0;
        x.copy_from_slice(&v.to_le_bytes());
    }
    bytes
}

pub fn to_host(b: &Cpu, t: &CpuTensor) -> Vec<f32> {
    b.to_host(t)
}
