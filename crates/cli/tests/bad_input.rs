//! Bad input to the `dflash` binary: every case ends with one clear message and a non-zero
//! exit, never a panic.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use dflash_models::source::gguf::MetaValue;
use dflash_models::source::gguf_writer::GgufWriter;
use dflash_models::synthetic::{synthetic_gguf, SyntheticSpec};

mod support;
use support::{dflash, fails_with, write};

fn tiny(dir: &Path) -> PathBuf {
    write(dir, "tiny.gguf", &synthetic_gguf(&SyntheticSpec::tiny()))
}

#[test]
fn a_tiny_model_generates_json() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let out = dflash(&[
        "generate",
        "hello there",
        "--model",
        m.to_str().unwrap(),
        "-n",
        "5",
        "--output-format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["tokens"].as_array().unwrap().len() <= 5);
    assert!(v["stats"]["prompt_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn missing_model_file() {
    fails_with(
        dflash(&["generate", "hi", "--model", "/nonexistent/model.gguf"]),
        "model not found",
    );
}

#[test]
fn corrupt_and_truncated_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.gguf", b"NOPE this is not a model at all");
    fails_with(
        dflash(&["generate", "hi", "--model", bad.to_str().unwrap()]),
        "not a GGUF file",
    );

    let full = synthetic_gguf(&SyntheticSpec::tiny());
    for cut in [10, 200, full.len() / 2, full.len() - 7] {
        let t = write(dir.path(), "trunc.gguf", &full[..cut]);
        let out = dflash(&["generate", "hi", "--model", t.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            !out.status.success() && !err.contains("panicked"),
            "cut {cut}: {err}"
        );
        assert!(
            err.contains("truncated or corrupt") || err.contains("outside the file"),
            "cut {cut}: {err}"
        );
    }
}

#[test]
fn unsupported_architecture_and_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("mamba".into()));
    let m = write(dir.path(), "mamba.gguf", &w.to_bytes());
    fails_with(
        dflash(&["generate", "hi", "--model", m.to_str().unwrap()]),
        "architecture `mamba` is not supported",
    );

    // A valid tiny model whose first matrix claims an unsupported type (Q5_0 = 6).
    let mut bytes = synthetic_gguf(&SyntheticSpec::tiny());
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap();
    // name, n_dims (u32), 2 dims (u64 each), then the type id.
    let ty = at + name.len() + 4 + 16;
    bytes[ty..ty + 4].copy_from_slice(&6u32.to_le_bytes());
    let m = write(dir.path(), "q5.gguf", &bytes);
    fails_with(
        dflash(&["generate", "hi", "--model", m.to_str().unwrap()]),
        "Q5_0",
    );
}

#[test]
fn tensor_shape_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let mut spec = SyntheticSpec::tiny();
    spec.intermediate = 96;
    let mut bytes = synthetic_gguf(&spec);
    // Claim a wider feed-forward in the metadata than the tensors have.
    let key = b"llama.feed_forward_length";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let val = at + key.len() + 4;
    bytes[val..val + 4].copy_from_slice(&128u32.to_le_bytes());
    let m = write(dir.path(), "shape.gguf", &bytes);
    fails_with(
        dflash(&["generate", "hi", "--model", m.to_str().unwrap()]),
        "has shape",
    );
}

#[test]
fn prompt_longer_than_the_context() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let long = "x".repeat(400);
    fails_with(
        dflash(&["generate", &long, "--raw", "--model", m.to_str().unwrap()]),
        "context",
    );
}

#[test]
fn invalid_flag_values() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let ms = m.to_str().unwrap();
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--temperature", "-1"]),
        "temperature",
    );
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--top-p", "0"]),
        "top-p",
    );
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--max-tokens", "0"]),
        "max-tokens",
    );
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--top-k", "lots"]),
        "invalid value",
    );
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--device", "tpu"]),
        "unknown device",
    );
    fails_with(
        dflash(&["generate", "hi", "--model", ms, "--no-such-flag"]),
        "unexpected argument",
    );
    fails_with(
        dflash(&["generate", "   ", "--model", ms]),
        "prompt is empty",
    );
    fails_with(
        dflash(&["bench", "--model", ms, "--repetitions", "0"]),
        "repetitions",
    );
}

#[test]
fn threads_beyond_the_cores_are_capped() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    // 100,000 threads used to abort (and 1,000 to hang a 2-core machine).
    let out = dflash(&[
        "generate",
        "hi",
        "--model",
        m.to_str().unwrap(),
        "-n",
        "3",
        "--threads",
        "100000",
        "-v",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("--threads 100000 is more than"), "{err}");
    let cores = std::thread::available_parallelism().unwrap().get();
    assert!(err.contains(&format!("using {cores}")), "{err}");
}

#[test]
fn a_temperature_that_underflows_is_greedy() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let ms = m.to_str().unwrap();
    let run = |t: &str| {
        let out = dflash(&[
            "generate",
            "hello",
            "--model",
            ms,
            "-n",
            "12",
            "--temperature",
            t,
            "--output-format",
            "json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["tokens"].clone()
    };
    let tiny_t = run("1e-39");
    // It used to give token 0 over and over (NaN probabilities).
    assert_eq!(tiny_t, run("0"));
    assert!(tiny_t.as_array().unwrap().iter().any(|t| t != 0));
}

#[test]
fn a_closed_stdout_ends_quietly_and_a_full_disk_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let ms = m.to_str().unwrap();
    // `dflash generate … | head -c 1`: the reader leaves after the first byte.
    let mut child = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["generate", "hello", "--model", ms, "-n", "200", "--raw"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // (the pipe's read end is dropped here)
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{err}");

    if Path::new("/dev/full").exists() {
        for format in ["text", "json"] {
            let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
                .args(["generate", "hello", "--model", ms, "-n", "4"])
                .args(["--output-format", format])
                .stdout(std::fs::File::create("/dev/full").unwrap())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!err.contains("panicked"), "{err}");
            assert!(!out.status.success(), "{format}: {err}");
            assert!(err.contains("cannot write the output"), "{format}: {err}");
        }
    }
}

#[test]
fn a_bad_argmax_screen_setting_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["generate", "hi", "--model", m.to_str().unwrap(), "-n", "2"])
        .args(["--device", "cpu"])
        .env("DFLASH_ARGMAX_SCREEN", "sometimes")
        .output()
        .unwrap();
    fails_with(out, "DFLASH_ARGMAX_SCREEN");
}

#[test]
fn the_microbench_times_the_greedy_screen_and_refuses_unknown_paths() {
    let out = dflash(&[
        "microbench",
        "--only",
        "q8_0:64x2048:2:screen",
        "--seconds",
        "0.05",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    if out.status.success() {
        assert!(text.contains("screen"), "{text}");
    } else {
        // CPUs without an int8 kernel family have nothing to screen with.
        println!("SKIPPED: no int8 kernel family here to screen with");
        fails_with(out, "no int8 kernel");
    }
    fails_with(
        dflash(&[
            "microbench",
            "--only",
            "q8_0:64x2048:2:fast",
            "--seconds",
            "0.05",
        ]),
        "PATH must be int8, int8x2, screen or f32",
    );
}

#[test]
fn kv_cache_types_run_and_bad_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(dir.path());
    let ms = m.to_str().unwrap();
    let generate = |kv: &str| {
        dflash(&[
            "generate",
            "hello",
            "--model",
            ms,
            "-n",
            "4",
            "--device",
            "cpu",
            "--kv-cache",
            kv,
        ])
    };
    for kv in ["f16", "f32"] {
        let out = generate(kv);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "--kv-cache {kv}: {err}");
    }
    fails_with(generate("bf16"), "possible values: f16, f32");
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args([
            "generate", "hi", "--model", ms, "-n", "2", "--device", "cpu",
        ])
        .env("DFLASH_KV_CACHE", "q8_0")
        .output()
        .unwrap();
    fails_with(out, "kv-cache");
}
