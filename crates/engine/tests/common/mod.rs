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
use dflash_models::llama::LlamaModel;
use dflash_models::{load_model, Drafter, LoadedModel};
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
    target: LlamaModel<Cpu>,
    tok: &dflash_models::tokenizer::TextTokenizer,
    prompts: &[Vec<u32>],
    max_tokens: usize,
) -> (Vec<Completion>, LlamaModel<Cpu>) {
    let mut dec = ArDecoder::new(target);
    let mut out = Vec::new();
    for p in prompts {
        let r = request(p.clone(), max_tokens, SamplingParams::greedy());
        out.extend(run_batch(&mut dec, tok, &[r], &mut |_, _| {}).unwrap());
    }
    (out, dec.target)
}

/// A drafter that knows each row's true continuation and proposes it, replacing the token at
/// one block slot per round with a wrong one. The slot for row r in round k is
/// `(k + r * 5) % block`; slot 0 means no error, so every accept count 0..block-1 occurs.
pub struct Oracle {
    block: usize,
    vocab: usize,
    taps: Vec<usize>,
    /// Full token sequences (prompt + continuation) for rows yet to be opened, in order.
    pub queue: VecDeque<Vec<u32>>,
    refs: Vec<Vec<u32>>,
    ctx: Vec<usize>,
    round: usize,
    logits: CpuTensor,
    /// Accept counts the oracle expects, per round, per row.
    pub expected_accepts: Vec<Vec<usize>>,
}

impl Oracle {
    pub fn new(block: usize, vocab: usize, taps: Vec<usize>) -> Self {
        Self {
            block,
            vocab,
            taps,
            queue: VecDeque::new(),
            refs: Vec::new(),
            ctx: Vec::new(),
            round: 0,
            logits: CpuTensor::default(),
            expected_accepts: Vec::new(),
        }
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
        self.ctx.push(0);
        Ok(self.refs.len() - 1)
    }

    fn release_row(&mut self, _row: usize) {}

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
        _embed: &dflash_runtime::HostWeight,
        _lm_head: &dflash_runtime::HostWeight,
    ) -> dflash_models::Result<()> {
        let v = self.vocab;
        self.logits = CpuTensor::zeros(rows.len() * (block - 1), v);
        let mut accepts = Vec::new();
        for (i, &(r, cur)) in rows.iter().enumerate() {
            let start = self.ctx[r];
            let seq = &self.refs[r];
            assert_eq!(
                seq.get(start),
                Some(&cur),
                "oracle row {r} is in step with the decoder"
            );
            let err = (self.round + r * 5) % block;
            let mut expect = block - 1;
            for j in 1..block {
                let truth = seq.get(start + j).copied().unwrap_or(0);
                let tok = if j == err {
                    (truth + 1) % v as u32
                } else {
                    truth
                };
                if j == err {
                    expect = expect.min(j - 1);
                }
                self.logits.row_mut(i * (block - 1) + j - 1)[tok as usize] = 30.0;
            }
            accepts.push(expect);
        }
        self.expected_accepts.push(accepts);
        self.round += 1;
        Ok(())
    }

    fn logits(&self) -> &CpuTensor {
        &self.logits
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

pub fn to_host(b: &Cpu, t: &CpuTensor) -> Vec<f32> {
    b.to_host(t)
}
