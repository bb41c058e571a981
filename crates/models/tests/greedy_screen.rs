//! The CPU's greedy screen of the output head (`dflash_runtime::cpu::argmax_screen`) on the
//! default model: forwards whose rows ask only for their greedy choice
//! (`RowStep::argmax_only`) give, after every prompt, at every decode step and at every
//! position of 8-token verify blocks, the same largest logit (bit for bit) at the same
//! position as the plain f32 head of a model loaded without screens; and the head reports
//! its screen.

use std::sync::Arc;

use dflash_models::default_model::{ensure_default_model, Silent};
use dflash_models::{load_model, LoadedModel, LogitRows, RowStep, Target};
use dflash_runtime::cpu::int8::Int8Kernel;
use dflash_runtime::cpu::{CpuBackend, Isa, MatmulMode};
use dflash_runtime::Backend;

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def reverse(s):\n    return",
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea,",
];

fn load(screen: bool) -> LoadedModel<CpuBackend> {
    let path = ensure_default_model(&Silent).expect("the default model must be obtainable");
    let b = CpuBackend::with_options(0, Isa::detect(), MatmulMode::Auto).with_screen(screen);
    load_model(Arc::new(b), &path).unwrap()
}

/// Every logit row's first largest value and its position.
fn choices(m: &LoadedModel<CpuBackend>) -> Vec<(usize, u32)> {
    let t = &m.model;
    let logits = t.backend().to_host(t.logits());
    let vocab = t.vocab();
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let mut best = 0;
            for (j, v) in row.iter().enumerate() {
                if *v > row[best] {
                    best = j;
                }
            }
            (best, row[best].to_bits())
        })
        .collect()
}

/// Runs `tokens` on `row` of both models (screened rows asking only for the choice) and
/// checks their choices agree.
fn step_both(
    models: &mut [LoadedModel<CpuBackend>; 2],
    row: usize,
    tokens: &[u32],
    logits: LogitRows,
    prompt: bool,
    what: &str,
) -> Vec<(usize, u32)> {
    let mut got = Vec::new();
    for (i, m) in models.iter_mut().enumerate() {
        m.model
            .forward(&[RowStep {
                row,
                tokens,
                logits,
                prompt,
                argmax_only: i == 0,
            }])
            .unwrap();
        got.push(choices(m));
    }
    assert_eq!(
        got[0], got[1],
        "{what}: screened and f32 heads choose differently"
    );
    got.swap_remove(1)
}

#[test]
fn screened_greedy_choices_equal_the_f32_heads_bit_for_bit() {
    let mut models = [load(true), load(false)];
    let paths = models[0].model.matmul_paths();
    let head = paths.iter().find(|p| p.name == "lm_head").unwrap();
    match Int8Kernel::best() {
        Some(k) => assert_eq!(
            head.path.greedy_screen.as_deref(),
            Some(format!("{} {k}", head.path.format).as_str()),
            "{head:?}"
        ),
        None => {
            println!("SKIPPED: this CPU has no usable int8 kernel family, so nothing is screened");
            assert_eq!(head.path.greedy_screen, None);
            return;
        }
    }
    let plain = models[1].model.matmul_paths();
    assert!(plain.iter().all(|p| p.path.greedy_screen.is_none()));
    for text in PROMPTS {
        let prompt = models[0].tokenizer.encode(text, true).unwrap();
        let rows: Vec<usize> = models
            .iter_mut()
            .map(|m| m.model.new_row(prompt.len() + 64).unwrap())
            .collect();
        assert_eq!(rows[0], rows[1]);
        let row = rows[0];
        let mut next = step_both(&mut models, row, &prompt, LogitRows::Last, true, text)[0].0;
        for step in 0..32 {
            let what = format!("{text:?} step {step}");
            let tok = [next as u32];
            next = step_both(&mut models, row, &tok, LogitRows::Last, false, &what)[0].0;
            if step % 8 == 7 {
                // A verify block of the next 8 tokens of the prompt text, then cut back.
                let len = models[0].model.row_len(row);
                let block: Vec<u32> = prompt.iter().cycle().skip(step).take(8).copied().collect();
                let what = format!("{text:?} verify block after step {step}");
                let got = step_both(&mut models, row, &block, LogitRows::All, false, &what);
                assert_eq!(got.len(), 8);
                for m in models.iter_mut() {
                    m.model.truncate_row(row, len).unwrap();
                }
            }
        }
        for m in models.iter_mut() {
            m.model.release_row(row);
        }
    }
}
