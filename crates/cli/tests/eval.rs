//! `dflash eval` end to end: bad input gives one clear message and a non-zero exit; a tiny
//! synthetic target with a random drafter saved to disk gives a JSON report with sane values.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_models::synthetic::{
    drafter_config_for, random_drafter, special_id, synthetic_gguf, SyntheticSpec,
};
use dflash_runtime::DType;
use serde_json::{json, Value};

/// The drafter's trained block in these tests.
const TRAINED_BLOCK: usize = 6;

/// The tiny target's context (the synthetic tokenizer spends about a token per byte).
const CONTEXT: usize = 1024;

fn dflash(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .env(
            "DFLASH_CACHE_DIR",
            std::env::temp_dir().join("dflash-test-no-cache"),
        )
        .env_remove("DFLASH_MODEL")
        .env_remove("DFLASH_DRAFT")
        .output()
        .expect("the binary runs")
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Asserts a clean failure whose stderr mentions `needle`.
fn fails_with(out: Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {err}"
    );
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(
        err.to_lowercase().contains(&needle.to_lowercase()),
        "stderr does not mention `{needle}`: {err}"
    );
}

/// The tiny synthetic target, with room for the longest shipped prompt the tests use.
fn tiny(dir: &Path) -> PathBuf {
    let mut spec = SyntheticSpec::tiny();
    spec.context_length = CONTEXT;
    write(dir, "tiny.gguf", &synthetic_gguf(&spec))
}

/// Serializes tensors as one safetensors file: a little-endian u64 header length, the JSON
/// header (padded with spaces to a multiple of 8), then the data.
fn safetensors_bytes(tensors: &[(String, &str, Vec<usize>, &[u8])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let start = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut head = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !head.len().is_multiple_of(8) {
        head.push(b' ');
    }
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    out.extend_from_slice(&data);
    out
}

/// A random DFlash drafter for the tiny synthetic target, saved as config.json + safetensors.
fn random_drafter_dir(root: &Path) -> PathBuf {
    let t = SyntheticSpec::tiny();
    let mask = special_id("<|endoftext|>");
    let cfg = drafter_config_for(
        t.hidden,
        t.heads,
        t.kv_heads,
        t.intermediate,
        t.layers,
        2,
        TRAINED_BLOCK,
        mask,
    );
    let src = random_drafter(&cfg, 7);
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort();
    let tensors: Vec<(String, &str, Vec<usize>, &[u8])> = names
        .into_iter()
        .map(|n| {
            let w = &src.tensors[n];
            let dtype = match w.dtype {
                DType::F32 => "F32",
                DType::BF16 => "BF16",
                DType::F16 => "F16",
                other => panic!("random drafter tensor {n} is {other:?}"),
            };
            let shape = if w.rows == 1 {
                vec![w.cols]
            } else {
                vec![w.rows, w.cols]
            };
            (n.clone(), dtype, shape, w.bytes.as_slice())
        })
        .collect();
    let dir = root.join("drafter");
    std::fs::create_dir_all(&dir).unwrap();
    write(&dir, "model.safetensors", &safetensors_bytes(&tensors));
    let config = json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.target_layer_ids,
        },
        "num_target_layers": t.layers,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "attention_bias": false,
    });
    write(
        &dir,
        "config.json",
        serde_json::to_string_pretty(&config).unwrap().as_bytes(),
    );
    dir
}

fn prompts_file(dir: &Path) -> PathBuf {
    write(
        dir,
        "prompts.jsonl",
        b"\"hello there\"\n\n{\"prompt\": \"tell me a story\", \"question_id\": 3, \"category\": \"writing\"}\n{\"prompt\": \"count to ten\", \"category\": \"math\"}\n",
    )
}

struct Setup {
    _dir: tempfile::TempDir,
    model: String,
    drafter: String,
    prompts: String,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path()).to_str().unwrap().to_string();
    let drafter = random_drafter_dir(dir.path()).to_str().unwrap().to_string();
    let prompts = prompts_file(dir.path()).to_str().unwrap().to_string();
    Setup {
        _dir: dir,
        model,
        drafter,
        prompts,
    }
}

fn run_json(args: &[&str]) -> Value {
    let out = dflash(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The invariants every report keeps.
fn check_report(v: &Value, block: usize, prompts: usize, max_tokens: usize) {
    for key in [
        "tau",
        "tokens",
        "rounds",
        "accept_by_position",
        "drafted",
        "accepted",
        "prompts",
        "block_size",
        "temperature",
        "dataset",
        "per_prompt",
        "tok_per_s",
    ] {
        assert!(v.get(key).is_some(), "no `{key}` in {v}");
    }
    let tau = v["tau"].as_f64().unwrap();
    let rounds = v["rounds"].as_u64().unwrap() as usize;
    let tokens = v["tokens"].as_u64().unwrap() as usize;
    let drafted = v["drafted"].as_u64().unwrap() as usize;
    let accepted = v["accepted"].as_u64().unwrap() as usize;
    assert_eq!(v["prompts"].as_u64().unwrap() as usize, prompts);
    assert_eq!(v["block_size"].as_u64().unwrap() as usize, block);
    assert!(rounds > 0, "{v}");
    assert!((1.0..=block as f64).contains(&tau), "tau {tau}");
    assert!(
        (tau - (accepted + rounds) as f64 / rounds as f64).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(drafted, rounds * (block - 1));
    assert!(accepted <= drafted);
    assert!(tokens > 0 && tokens <= prompts * max_tokens, "{v}");
    let by_pos: Vec<f64> = v["accept_by_position"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(by_pos.len(), block - 1);
    assert!(by_pos.iter().all(|a| (0.0..=1.0).contains(a)), "{by_pos:?}");
    // A draft is kept only after every earlier one was.
    assert!(by_pos.windows(2).all(|w| w[0] >= w[1]), "{by_pos:?}");
    // Accepted drafts spread over the slots.
    let sum: f64 = by_pos.iter().sum::<f64>() * rounds as f64;
    assert!((sum - accepted as f64).abs() < 1e-6, "{sum} vs {accepted}");
    let per = v["per_prompt"].as_array().unwrap();
    assert_eq!(per.len(), prompts);
    for p in per {
        assert!(p["tau"].as_f64().unwrap() >= 1.0 || p["rounds"] == 0, "{p}");
    }
    assert!(v["tok_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_random_drafter_on_a_tiny_target_gives_a_report() {
    let s = setup();
    let v = run_json(&[
        "eval",
        "--prompts",
        &s.prompts,
        "--model",
        &s.model,
        "--draft",
        &s.drafter,
        "--block-size",
        "4",
        "-n",
        "24",
        "--output-format",
        "json",
    ]);
    check_report(&v, 4, 3, 24);
    assert_eq!(v["temperature"].as_f64().unwrap(), 0.0);
    assert_eq!(
        v["trained_block_size"].as_u64().unwrap() as usize,
        TRAINED_BLOCK
    );
    assert!(v["dataset"].is_null());
    assert_eq!(v["per_prompt"][1]["question_id"], 3);
    assert_eq!(v["per_prompt"][2]["category"], "math");
    assert!(v["by_category"]["writing"]["tau"].as_f64().unwrap() >= 1.0);

    // Greedy decoding is deterministic, and joining rows in a batch changes no count.
    let batched = run_json(&[
        "eval",
        "--prompts",
        &s.prompts,
        "--model",
        &s.model,
        "--draft",
        &s.drafter,
        "--block-size",
        "4",
        "-n",
        "24",
        "--batch",
        "2",
        "--output-format",
        "json",
    ]);
    check_report(&batched, 4, 3, 24);
    for key in ["tau", "rounds", "tokens", "accepted", "accept_by_position"] {
        assert_eq!(v[key], batched[key], "{key}");
    }
}

#[test]
fn sampling_limit_and_the_trained_block() {
    let s = setup();
    let block = TRAINED_BLOCK.to_string();
    let v = run_json(&[
        "eval",
        "--prompts",
        &s.prompts,
        "--limit",
        "2",
        "--model",
        &s.model,
        "--draft",
        &s.drafter,
        "--block-size",
        &block,
        "--temperature",
        "1",
        "--seed",
        "5",
        "-n",
        "16",
        "--output-format",
        "json",
    ]);
    check_report(&v, TRAINED_BLOCK, 2, 16);
    assert_eq!(v["temperature"].as_f64().unwrap(), 1.0);
    assert_eq!(v["prompts_available"].as_u64().unwrap(), 3);
}

#[test]
fn shipped_datasets_and_text_output() {
    let s = setup();
    let v = run_json(&[
        "eval",
        "--dataset",
        "mt-bench",
        "--limit",
        "1",
        "--model",
        &s.model,
        "--draft",
        &s.drafter,
        "--block-size",
        "3",
        "-n",
        "8",
        "--output-format",
        "json",
    ]);
    check_report(&v, 3, 1, 8);
    assert_eq!(v["dataset"], "mt-bench");
    assert_eq!(v["prompts_available"].as_u64().unwrap(), 80);
    assert_eq!(v["per_prompt"][0]["question_id"], 81);

    let out = dflash(&[
        "eval",
        "--dataset",
        "sharegpt-heldout",
        "--limit",
        "1",
        "--model",
        &s.model,
        "--draft",
        &s.drafter,
        "--block-size",
        "3",
        "-n",
        "8",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("tau "), "{text}");
    assert!(text.contains("slot  1"), "{text}");
    assert!(text.contains("slot  2"), "{text}");
    assert!(!text.contains("slot  3"), "{text}");
    assert!(text.contains("tok/s"), "{text}");
}

#[test]
fn bad_prompt_sources() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let ms = m.to_str().unwrap();
    fails_with(
        dflash(&[
            "eval",
            "--prompts",
            "/nonexistent/prompts.jsonl",
            "--model",
            ms,
        ]),
        "cannot read the prompt file",
    );
    let bad = write(
        dir.path(),
        "bad.jsonl",
        b"\"fine\"\n{\"prompt\": \"unterminated\n",
    );
    fails_with(
        dflash(&["eval", "--prompts", bad.to_str().unwrap(), "--model", ms]),
        "bad.jsonl line 2: not valid JSON",
    );
    let no_prompt = write(dir.path(), "noprompt.jsonl", b"{\"text\": \"x\"}\n");
    fails_with(
        dflash(&[
            "eval",
            "--prompts",
            no_prompt.to_str().unwrap(),
            "--model",
            ms,
        ]),
        "no string `prompt` field",
    );
    let number = write(dir.path(), "number.jsonl", b"17\n");
    fails_with(
        dflash(&["eval", "--prompts", number.to_str().unwrap(), "--model", ms]),
        "expected a JSON string",
    );
    let empty = write(dir.path(), "empty.jsonl", b"\n\n");
    fails_with(
        dflash(&["eval", "--prompts", empty.to_str().unwrap(), "--model", ms]),
        "has no prompts",
    );
    fails_with(
        dflash(&["eval", "--dataset", "alpaca", "--model", ms]),
        "mt-bench",
    );
    fails_with(dflash(&["eval", "--model", ms]), "--prompts");
    fails_with(
        dflash(&[
            "eval",
            "--dataset",
            "mt-bench",
            "--prompts",
            bad.to_str().unwrap(),
        ]),
        "cannot be used with",
    );
}

#[test]
fn bad_options_and_missing_drafters() {
    let s = setup();
    let base = ["eval", "--prompts", &s.prompts, "--model", &s.model];
    let with = |extra: &[&str]| {
        let mut a: Vec<&str> = base.to_vec();
        a.extend_from_slice(extra);
        dflash(&a)
    };
    fails_with(with(&["--limit", "0", "--draft", &s.drafter]), "--limit");
    fails_with(with(&["--no-draft"]), "--no-draft");
    fails_with(with(&[]), "--draft DIR");
    fails_with(
        with(&["--draft", "/nonexistent/drafter"]),
        "drafter not found",
    );
    fails_with(
        with(&["--draft", &s.drafter, "--block-size", "64"]),
        "block size 64",
    );
    fails_with(
        with(&["--draft", &s.drafter, "--max-tokens", "0"]),
        "--max-tokens",
    );
    fails_with(with(&["--draft", &s.drafter, "--batch", "0"]), "--batch");
    fails_with(
        with(&["--draft", &s.drafter, "--temperature", "-1"]),
        "temperature",
    );
    // A prompt longer than the tiny model's context.
    let long = write(
        Path::new(&s.prompts).parent().unwrap(),
        "long.jsonl",
        format!("\"{}\"\n", "x".repeat(2 * CONTEXT)).as_bytes(),
    );
    fails_with(
        dflash(&[
            "eval",
            "--prompts",
            long.to_str().unwrap(),
            "--model",
            &s.model,
            "--draft",
            &s.drafter,
        ]),
        "context",
    );
}
