//! `dflash bench` measures a verify block against a decode step on the target alone: the
//! report carries every timed pair and the median ratio, the table says it, and a block that
//! cannot fit the context after the prompt is a clear error; with a drafter, the DFlash arm
//! reports its draft, verify and commit time per round.

mod support;

use serde_json::Value;
use support::*;

#[test]
fn report_has_the_verify_block_against_a_decode_step() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = bench_cpu(
        &model,
        &[
            "--no-draft",
            "--block-size",
            "4",
            "-p",
            "8",
            "-n",
            "4",
            "-r",
            "2",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {err}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let v = &report["verify"];
    assert_eq!(v["block"], 4);
    assert_eq!(v["context"], 8, "the row holds the prompt");
    for key in ["verify_runs_ms", "decode_step_runs_ms"] {
        let runs = v[key].as_array().expect(key);
        assert_eq!(runs.len(), 10, "5 timed pairs per repetition: {v}");
        assert!(runs.iter().all(|r| r.as_f64().unwrap() > 0.0), "{v}");
    }
    let (verify, decode) = (
        v["verify_ms"].as_f64().unwrap(),
        v["decode_step_ms"].as_f64().unwrap(),
    );
    let ratio = v["verify_over_decode"].as_f64().unwrap();
    assert!((ratio - verify / decode).abs() < 1e-9, "{v}");
    assert!(
        err.contains("verify of 4 (forward + greedy choice)"),
        "table: {err}"
    );
}

#[test]
fn a_verify_block_past_the_context_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let prompt = (CONTEXT - 4).to_string();
    let out = bench_cpu(
        &model,
        &[
            "--no-draft",
            "--block-size",
            "8",
            "-p",
            &prompt,
            "-n",
            "2",
            "-r",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a block past the context must fail");
    assert!(
        err.contains("does not fit the context"),
        "unclear error: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn dflash_arm_reports_draft_verify_and_commit_time_per_round() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let drafter = random_drafter_dir(dir.path());
    let out = bench_cpu(
        &model,
        &[
            "--draft",
            drafter.to_str().unwrap(),
            "--block-size",
            "2",
            "-p",
            "8",
            "-n",
            "8",
            "-r",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {err}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let arms = report["arms"].as_array().expect("arms");
    let dflash = arms
        .iter()
        .find(|a| a["arm"] == "dflash")
        .expect("dflash arm");
    assert!(dflash["rounds"].as_u64().unwrap() > 0, "{dflash}");
    for key in [
        "draft_ms_per_round",
        "verify_ms_per_round",
        "commit_ms_per_round",
    ] {
        assert!(dflash[key].as_f64().unwrap() > 0.0, "{key}: {dflash}");
    }
    assert!(
        err.contains("ms per round: draft "),
        "the table gives the round's time split: {err}"
    );
}
