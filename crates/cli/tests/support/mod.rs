//! Shared support of the CLI's end-to-end tests: running the `dflash` binary, writing
//! files, asserting clean failures, and the tiny synthetic target with a random drafter
//! saved to disk.

// Each test binary uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_models::synthetic::{
    drafter_config_for, random_drafter, special_id, synthetic_gguf, SyntheticSpec,
};
use dflash_runtime::DType;
use serde_json::{json, Value};

/// The drafter's trained block in these tests.
pub const TRAINED_BLOCK: usize = 6;

/// The tiny target's context (the synthetic tokenizer spends about a token per byte).
pub const CONTEXT: usize = 1024;

pub fn dflash(args: &[&str]) -> Output {
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

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Asserts a clean failure whose stderr mentions `needle`.
pub fn fails_with(out: Output, needle: &str) {
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
pub fn tiny(dir: &Path) -> PathBuf {
    let mut spec = SyntheticSpec::tiny();
    spec.context_length = CONTEXT;
    write(dir, "tiny.gguf", &synthetic_gguf(&spec))
}

/// Serializes tensors as one safetensors file: a little-endian u64 header length, the JSON
/// header (padded with spaces to a multiple of 8), then the data.
pub fn safetensors_bytes(tensors: &[(String, &str, Vec<usize>, &[u8])]) -> Vec<u8> {
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
pub fn random_drafter_dir(root: &Path) -> PathBuf {
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
