//! `dflash bench --requests R`: a serving-style load on a tiny synthetic target gives a JSON
//! report whose counts and percentiles hang together; bad values are clear errors.

use std::path::PathBuf;
use std::process::{Command, Output};

use dflash_models::synthetic::{synthetic_gguf, SyntheticSpec};
use serde_json::Value;

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

fn tiny_model(dir: &std::path::Path) -> PathBuf {
    let mut spec = SyntheticSpec::tiny();
    spec.context_length = 1024;
    let p = dir.join("tiny.gguf");
    std::fs::write(&p, synthetic_gguf(&spec)).unwrap();
    p
}

#[test]
fn load_report_counts_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = dflash(&[
        "bench",
        "--model",
        model.to_str().unwrap(),
        "--device",
        "cpu",
        "--no-draft",
        "--requests",
        "5",
        "--max-live",
        "2",
        "-n",
        "6",
        "-r",
        "2",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {err}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(report["requests"], 5);
    assert_eq!(report["max_live"], 2);
    let arms = report["arms"].as_array().expect("arms");
    assert_eq!(arms.len(), 1, "no drafter: the plain arm only");
    let ar = &arms[0];
    assert_eq!(ar["arm"], "ar");
    // Every request yields its first token at admission and at most 6 in all.
    let tokens = ar["generated_tokens"].as_u64().unwrap();
    assert!((5..=30).contains(&tokens), "generated {tokens}");
    assert_eq!(ar["runs_tok_per_s"].as_array().unwrap().len(), 2);
    assert!(ar["tok_per_s"].as_f64().unwrap() > 0.0);
    assert!(ar["requests_per_s"].as_f64().unwrap() > 0.0);
    for key in ["ttft_ms", "itl_ms"] {
        let p = &ar[key];
        let (p50, p90, p99) = (
            p["p50"].as_f64().unwrap(),
            p["p90"].as_f64().unwrap(),
            p["p99"].as_f64().unwrap(),
        );
        assert!(
            0.0 <= p50 && p50 <= p90 && p90 <= p99,
            "{key} percentiles out of order: {p}"
        );
    }
    assert!(err.contains("5 requests, 2 live"), "table: {err}");
}

#[test]
fn bad_load_flags_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let m = model.to_str().unwrap();
    for (args, needle) in [
        (vec!["--requests", "0"], "at least 1"),
        (vec!["--requests", "3", "--max-live", "0"], "at least 1"),
        (vec!["--max-live", "2"], "--requests"),
        (
            vec!["--requests", "3", "--batch", "2"],
            "cannot be used with",
        ),
    ] {
        let mut all = vec!["bench", "--model", m, "--device", "cpu", "--no-draft"];
        all.extend(args.iter());
        let out = dflash(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
