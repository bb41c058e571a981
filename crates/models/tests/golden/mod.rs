//! The SmolLM2-135M-Instruct golden fixture (made by tools/make_golden_fixtures.py from
//! transformers) and the teacher-forced walk over its greedy tokens, shared by the CPU test
//! (`golden_smollm2.rs`) and the GPU one (`engine/tests/cuda_golden_smollm2.rs`).

use std::sync::OnceLock;

use dflash_models::{LoadedModel, LogitRows, RowStep, Target};
use dflash_runtime::Backend;
use serde_json::Value;

pub fn fixture() -> &'static Value {
    static F: OnceLock<Value> = OnceLock::new();
    F.get_or_init(|| {
        serde_json::from_str(include_str!("../fixtures/smollm2_q4_1_golden.json")).unwrap()
    })
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// What teacher-forcing the fixture's greedy tokens found.
pub struct Walk {
    /// Largest |logit − transformers| over the fixture's top-5 logits.
    pub worst: f32,
    /// Steps whose argmax differs from the fixture's token, with the fixture's top-1/top-2 margin.
    pub flips: Vec<(String, usize, f32)>,
    pub steps: usize,
}

impl Walk {
    /// Asserts every greedy token that differs from the fixture's sits where the fixture's
    /// top-1/top-2 margin is below twice `bound`, and returns a one-line summary.
    pub fn flips_within(&self, bound: f32) -> String {
        for (name, step, margin) in &self.flips {
            assert!(
                *margin < 2.0 * bound,
                "{name} step {step}: the greedy token flipped at a margin of {margin}"
            );
        }
        format!(
            "largest top-5 logit difference from transformers {:.4} (bound {bound}), {} of {} greedy tokens differ: {:?}",
            self.worst,
            self.flips.len(),
            self.steps,
            self.flips
        )
    }
}

/// Feeds every case's prompt, then the fixture's greedy tokens one at a time; checks each
/// fixture top-5 logit with `close` and records argmax flips.
pub fn walk<B: Backend>(m: &mut LoadedModel<B>, close: impl Fn(f32, f32) -> bool) -> Walk {
    let cases = fixture()["generation_cases"].as_array().unwrap();
    assert!(cases.len() >= 6);
    let mut w = Walk {
        worst: 0.0,
        flips: Vec::new(),
        steps: 0,
    };
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let prompt_text = c["prompt_text"].as_str().unwrap();
        let prompt = ids(&c["prompt_ids"]);
        assert_eq!(
            m.tokenizer.encode(prompt_text, true).unwrap(),
            prompt,
            "{name} prompt"
        );
        let greedy = ids(&c["greedy_ids"]);
        let margins = c["margin_top1_top2_all_steps"].as_array().unwrap();
        let checks: Vec<&Value> = c["top_logits"].as_array().unwrap().iter().collect();
        let model = &mut m.model;
        let row = model.new_row(prompt.len() + 40).unwrap();
        let mut next = prompt.clone();
        for (step, &want) in greedy.iter().enumerate() {
            model
                .forward(&[RowStep {
                    row,
                    tokens: &next,
                    logits: LogitRows::Last,
                    prompt: step == 0,
                    argmax_only: false,
                }])
                .unwrap();
            let logits = model.backend().to_host(model.logits());
            let got = dflash_runtime::cpu::ops::elementwise::argmax(&logits);
            w.steps += 1;
            if got != want {
                let margin = margins[step].as_f64().unwrap() as f32;
                w.flips.push((name.to_string(), step, margin));
            }
            for chk in checks
                .iter()
                .filter(|v| v["step"].as_u64() == Some(step as u64))
            {
                for (id, val) in ids(&chk["top_ids"])
                    .iter()
                    .zip(chk["top_logits"].as_array().unwrap())
                {
                    let want_v = val.as_f64().unwrap() as f32;
                    let got_v = logits[*id as usize];
                    w.worst = w.worst.max((got_v - want_v).abs());
                    assert!(
                        close(got_v, want_v),
                        "{name} step {step} token {id}: {got_v} vs {want_v}"
                    );
                }
            }
            next = vec![want];
        }
        model.release_row(row);
    }
    w
}
