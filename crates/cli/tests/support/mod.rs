//! Shared support of the CLI's end-to-end tests: running the `dflash` binary, writing
//! files, asserting clean failures, and the tiny synthetic target with a random drafter
//! saved to disk.

// Each test binary uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_models::synthetic::{
    drafter_config_for, special_id, synthetic_gguf, write_drafter_dir, SyntheticSpec,
};

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

/// `dflash bench --model MODEL --device cpu ARGS...`.
pub fn bench_cpu(model: &Path, args: &[&str]) -> Output {
    let mut all = vec![
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "cpu",
    ];
    all.extend_from_slice(args);
    dflash(&all)
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
    let dir = root.join("drafter");
    write_drafter_dir(&cfg, 7, &dir).unwrap();
    dir
}
