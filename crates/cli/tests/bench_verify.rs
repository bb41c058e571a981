//! `dflash bench` measures a verify block against a decode step on the target alone: the
//! report carries every timed pair and the median of the pairs' ratios, the table says it,
//! and a block that cannot fit the context after the prompt is a clear error; with a drafter,
//! the DFlash arm reports its draft, verify and commit time per round, and `--batch` arms
//! decode a queue of requests.

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
    // The ratio is the median of the timed pairs' own ratios.
    let runs = |key: &str| -> Vec<f64> {
        v[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_f64().unwrap())
            .collect()
    };
    let mut pairs: Vec<f64> = runs("verify_runs_ms")
        .iter()
        .zip(runs("decode_step_runs_ms"))
        .map(|(a, b)| a / b)
        .collect();
    pairs.sort_by(f64::total_cmp);
    let want = (pairs[4] + pairs[5]) / 2.0;
    let ratio = v["verify_over_decode"].as_f64().unwrap();
    assert!((ratio - want).abs() < 1e-9, "{v}");
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

#[test]
fn batched_arms_decode_a_queue_of_requests() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let drafter = random_drafter_dir(dir.path());
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--draft",
            drafter.to_str().unwrap(),
            "--block-size",
            "2",
            "-n",
            "4",
            "-r",
            "1",
            "--batch",
            "2",
        ];
        args.extend_from_slice(extra);
        bench_cpu(&model, &args)
    };
    for (extra, queue) in [(&[][..], 8), (&["--batch-queue", "3"][..], 3)] {
        let out = run(extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "bench failed: {err}");
        let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(report["batch"], 2);
        assert_eq!(report["batch_queue"], queue, "{report}");
        let arms = report["arms"].as_array().expect("arms");
        let names: Vec<&str> = arms.iter().map(|a| a["arm"].as_str().unwrap()).collect();
        assert_eq!(names, ["b1", "per_row", "clamp"]);
        for a in arms {
            // Every arm decodes the whole queue, each request its 4 tokens.
            assert_eq!(a["requests"], queue, "{a}");
            assert_eq!(a["tokens"], 4 * queue, "{a}");
            assert!(a["tok_per_s"].as_f64().unwrap() > 0.0, "{a}");
        }
        assert!(err.contains(&format!("| {queue} requests | B=1 ")), "{err}");
    }
    fails_with(run(&["--batch-queue", "0"]), "--batch-queue");
}
