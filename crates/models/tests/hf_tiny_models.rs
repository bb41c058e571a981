//! Tiny random Hugging Face models (Qwen3 bf16 with q/k norm and tied head; sharded f32 Qwen2
//! with qkv bias; f16 Llama with Llama-3 RoPE scaling) against transformers: tokenization,
//! chat template, logits and greedy tokens (fixtures by tools/make_tiny_hf_fixtures.py).

use std::path::Path;
use std::sync::Arc;

use dflash_models::chat::Message;
use dflash_models::{load_model, LogitRows, RowStep, Target};
use dflash_runtime::cpu::{CpuBackend, KvType};
use dflash_runtime::Backend;
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn check(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let exp: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let mut m = load_model(Arc::new(reference_backend()), &dir).unwrap();
    let prompt = exp["prompt"].as_str().unwrap();
    assert_eq!(
        m.tokenizer.encode(prompt, false).unwrap(),
        ids(&exp["prompt_ids"]),
        "{name} prompt ids"
    );
    let msgs: Vec<Message> = serde_json::from_value(exp["chat_messages"].clone()).unwrap();
    let rendered = m.template.as_ref().unwrap().render(&msgs, true).unwrap();
    assert_eq!(
        rendered,
        exp["chat_rendered"].as_str().unwrap(),
        "{name} chat template"
    );
    assert_eq!(
        m.tokenizer.encode(&rendered, false).unwrap(),
        ids(&exp["chat_ids"]),
        "{name} chat ids"
    );
    for (ids_key, gen_key) in [
        ("prompt_ids", "generation"),
        ("chat_ids", "chat_generation"),
    ] {
        let prompt = ids(&exp[ids_key]);
        let gen = &exp[gen_key];
        let model = &mut m.model;
        let row = model.new_row(prompt.len() + 20).unwrap();
        let mut next = prompt.clone();
        for (step, want) in ids(&gen["greedy_ids"]).into_iter().enumerate() {
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
            if step == 0 {
                let full: Vec<f32> = gen["last_prompt_logits"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                assert_eq!(full.len(), logits.len());
                for (i, (g, w)) in logits.iter().zip(&full).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-4 + 1e-5 * w.abs(),
                        "{name} {gen_key} logit {i}: {g} vs {w}"
                    );
                }
            }
            let got = dflash_runtime::cpu::ops::elementwise::argmax(&logits);
            assert_eq!(got, want, "{name} {gen_key} greedy step {step}");
            next = vec![want];
        }
        model.release_row(row);
    }
}

#[test]
fn qwen3_bf16_tied_with_qk_norm() {
    check("tiny_qwen3");
}

#[test]
fn qwen2_sharded_f32_with_qkv_bias() {
    check("tiny_qwen2");
}

#[test]
fn llama3_f16_with_rope_scaling() {
    check("tiny_llama3");
}

/// Fuzzing found that the tokenizers crate panics on some malformed `tokenizer.json` files
/// (its deserializers `expect`); they must be errors.
#[test]
fn a_malformed_tokenizer_json_is_an_error_not_a_panic() {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_llama3/tokenizer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    for bad in [
        serde_json::json!(5),
        serde_json::json!("x"),
        serde_json::json!([1]),
    ] {
        v["decoder"] = bad.clone();
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("tokenizer.json"), v.to_string()).unwrap();
        let err = dflash_models::tokenizer::TextTokenizer::from_hf_dir(d.path())
            .err()
            .unwrap_or_else(|| panic!("decoder {bad} was accepted"));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }
}

/// transformers keeps its KV cache in f32: so does the backend compared with it (the CPU's f16
/// cache has its own bound, golden_smollm2.rs).
fn reference_backend() -> CpuBackend {
    CpuBackend::new(2).with_kv_type(KvType::F32)
}
