//! Tiny random Qwen 3.5 hybrids against transformers' `qwen3_5` (fixtures by
//! tools/make_qwen35_fixtures.py): prefill logits (chunked and token-by-token forms), 24
//! single-token decode steps, a 7-token verify block after a cached prefix; the text-only
//! bf16 checkpoint, the multimodal-wrapper checkpoint, and a GGUF written as llama.cpp's
//! converter writes `qwen35`, which must give the HF directory's logits.
//!
//! Tolerance: every logit within `ATOL + RTOL * |expected|` of transformers' float32
//! output (ATOL 2e-4, RTOL 1e-4: float32 with other summation orders; observed maxima are
//! printed), and every greedy id equal where the expected top-2 margin exceeds 1e-3.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_models::{load_model, LogitRows, RowStep, Target, TargetModel};
use dflash_runtime::cpu::{CpuBackend, KvType};
use dflash_runtime::Backend;
use serde_json::Value;

const ATOL: f32 = 2e-4;
const RTOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Expected {
    json: Value,
    prefill_all: Vec<f32>,
    decode: Vec<f32>,
    verify: Vec<f32>,
}

fn expected(dir: &str) -> Expected {
    let d = fixtures().join(dir);
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("expected.json")).unwrap()).unwrap();
    let bytes = std::fs::read(d.join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let get = |n: &str| -> Vec<f32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    Expected {
        prefill_all: get("prefill_all"),
        decode: get("decode_logits"),
        verify: get("verify_logits"),
        json,
    }
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Max |got - want| over a block of logits, failing beyond the tolerance.
fn compare(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        assert!(d <= ATOL + RTOL * w.abs(), "{what}: logit {i}: {g} vs {w}");
        worst = worst.max(d);
    }
    worst
}

fn argmax(x: &[f32]) -> u32 {
    dflash_runtime::cpu::ops::elementwise::argmax(x)
}

fn margin(x: &[f32]) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

fn logits(
    m: &mut TargetModel<CpuBackend>,
    row: usize,
    tokens: &[u32],
    which: LogitRows,
) -> Vec<f32> {
    m.forward(&[RowStep {
        row,
        tokens,
        logits: which,
        // Here every multi-token step asking for the last logits is a prompt.
        prompt: which == LogitRows::Last && tokens.len() > 1,
        argmax_only: false,
    }])
    .unwrap();
    m.backend().to_host(m.logits())
}

fn check(model_path: &Path, exp: &Expected) {
    let name = model_path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    let mut m = load_model(Arc::new(reference_backend()), model_path)
        .unwrap()
        .model;
    assert!(
        matches!(m, TargetModel::Qwen35(_)),
        "{name} loads as Qwen 3.5"
    );
    let vocab = m.vocab();
    let prompt = ids(&exp.json["prompt_ids"]);
    let greedy = ids(&exp.json["decode_ids"]);
    let n = prompt.len();

    // Prefill, token-by-token form (every position's logits asked: never chunked).
    let row = m.new_row(256).unwrap();
    let all = logits(&mut m, row, &prompt, LogitRows::All);
    let d_all = compare(
        &format!("{name} prefill (all positions)"),
        &all,
        &exp.prefill_all,
    );
    m.release_row(row);

    // Prefill, chunked form (last position only), then decode steps.
    let row = m.new_row(256).unwrap();
    let last = logits(&mut m, row, &prompt, LogitRows::Last);
    let want_last = &exp.prefill_all[(n - 1) * vocab..];
    let d_last = compare(&format!("{name} prefill (chunked)"), &last, want_last);
    let chunked_vs_recurrent = last
        .iter()
        .zip(&all[(n - 1) * vocab..])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let mut d_dec = 0f32;
    let mut step_logits = last;
    for (s, &tok) in greedy.iter().enumerate() {
        let want = &exp.decode[s * vocab..(s + 1) * vocab];
        d_dec = d_dec.max(compare(
            &format!("{name} decode step {s}"),
            &step_logits,
            want,
        ));
        if margin(want) > 1e-3 {
            assert_eq!(argmax(&step_logits), tok, "{name} greedy step {s}");
        }
        if s + 1 < greedy.len() {
            step_logits = logits(&mut m, row, &[tok], LogitRows::Last);
        }
    }
    m.release_row(row);

    // Verify block after a cached prefix.
    let at = exp.json["verify_prefix_greedy"].as_u64().unwrap() as usize;
    let block = ids(&exp.json["verify_block"]);
    let row = m.new_row(256).unwrap();
    let prefix: Vec<u32> = prompt.iter().chain(&greedy[..at]).copied().collect();
    logits(&mut m, row, &prefix, LogitRows::Last);
    let v = logits(&mut m, row, &block, LogitRows::All);
    let d_ver = compare(&format!("{name} verify block"), &v, &exp.verify);
    eprintln!(
        "{name}: max |Δ| prefill all {d_all:.2e}, prefill chunked {d_last:.2e}, decode {d_dec:.2e}, \
         verify {d_ver:.2e}; chunked vs token-by-token {chunked_vs_recurrent:.2e}"
    );
}

#[test]
fn text_only_bf16_tied() {
    check(&fixtures().join("tiny_qwen35"), &expected("tiny_qwen35"));
}

#[test]
fn multimodal_wrapper_f32_untied() {
    check(
        &fixtures().join("tiny_qwen35_vlm"),
        &expected("tiny_qwen35_vlm"),
    );
}

#[test]
fn gguf_gives_the_hf_logits() {
    let exp = expected("tiny_qwen35");
    check(&fixtures().join("tiny_qwen35.gguf"), &exp);
    // And directly against our HF-directory model: same weights (bf16 upcast), other order.
    let b = Arc::new(CpuBackend::new(2));
    let mut hf = load_model(b.clone(), &fixtures().join("tiny_qwen35"))
        .unwrap()
        .model;
    let mut gg = load_model(b, &fixtures().join("tiny_qwen35.gguf"))
        .unwrap()
        .model;
    let prompt = ids(&exp.json["prompt_ids"]);
    let (rh, rg) = (hf.new_row(256).unwrap(), gg.new_row(256).unwrap());
    let a = logits(&mut hf, rh, &prompt, LogitRows::All);
    let c = logits(&mut gg, rg, &prompt, LogitRows::All);
    let worst = a
        .iter()
        .zip(&c)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("GGUF vs HF directory: max |Δ| {worst:.2e}");
    assert!(worst < 1e-4, "GGUF and HF logits differ by {worst}");
}

/// transformers keeps its KV cache in f32: so does the backend compared with it (the CPU's f16
/// cache has its own bound, golden_smollm2.rs).
fn reference_backend() -> CpuBackend {
    CpuBackend::new(2).with_kv_type(KvType::F32)
}
