//! `dflash bench --requests R`: a serving-style load on a tiny synthetic target (plain, and
//! DFlash with a random drafter) gives a JSON report whose counts, percentiles and KV cache
//! peak hang together, with prompts longer than the step's token budget (chunked prefill);
//! `--join-probe` times prompts joining a busy batch; bad values are clear errors.

mod support;

use serde_json::Value;
use support::*;

#[test]
fn load_report_counts_every_request() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let out = bench_cpu(
        &model,
        &[
            "--no-draft",
            "--requests",
            "5",
            "--max-live",
            "2",
            "-n",
            "6",
            "-r",
            "2",
        ],
    );
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
    // Two rows of at most 6 positions beyond their prompts, never their whole context.
    let kv = &ar["kv_peak"];
    let (rows, positions, reserved) = (
        kv["rows"].as_u64().unwrap(),
        kv["positions"].as_u64().unwrap(),
        kv["reserved_positions"].as_u64().unwrap(),
    );
    assert!((1..=2).contains(&rows), "KV peak {kv}");
    assert!(positions > 0 && positions <= reserved, "KV peak {kv}");
    assert!(
        reserved < CONTEXT as u64,
        "rows reserved their context: {kv}"
    );
    assert!(kv["bytes"].as_u64().unwrap() > 0, "KV peak {kv}");
    assert!(err.contains("5 requests, 2 live"), "table: {err}");
    assert!(err.contains("KV peak"), "table: {err}");
}

#[test]
fn dflash_load_with_prompts_longer_than_the_step_budget() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let drafter = random_drafter_dir(dir.path());
    for speculation in ["always", "auto"] {
        let out = bench_cpu(
            &model,
            &[
                "--draft",
                drafter.to_str().unwrap(),
                "--requests",
                "4",
                "--max-live",
                "3",
                "--max-batch-tokens",
                "24",
                "-n",
                "8",
                "-r",
                "1",
                "--speculation",
                speculation,
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "bench failed: {err}");
        let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
        assert_eq!(report["max_batch_tokens"], 24);
        let arms = report["arms"].as_array().expect("arms");
        assert_eq!(arms.len(), 2, "plain and DFlash arms");
        // Greedy DFlash is lossless: both arms generate the same number of tokens.
        assert_eq!(arms[0]["generated_tokens"], arms[1]["generated_tokens"]);
        for arm in arms {
            let kv = &arm["kv_peak"];
            assert!(kv["rows"].as_u64().unwrap() >= 1, "{arm}");
            assert!(kv["bytes"].as_u64().unwrap() > 0, "{arm}");
        }
        // The DFlash arm counts target and drafter rows.
        assert!(arms[1]["kv_peak"]["rows"].as_u64().unwrap() >= 2);
        // Speculative rounds and plain steps: `always` never skips the draft; `auto` tries
        // both kinds at each batch size it meets.
        let (rounds, plain) = (
            arms[1]["rounds"].as_u64().unwrap(),
            arms[1]["plain_steps"].as_u64().unwrap(),
        );
        assert!(rounds > 0, "{speculation}: {err}");
        assert_eq!(plain == 0, speculation == "always", "{speculation}: {err}");
        assert!(err.contains("plain steps"), "table: {err}");
    }
}

#[test]
fn join_probe_times_prompts_joining_a_busy_batch() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    let drafter = random_drafter_dir(dir.path());
    let out = bench_cpu(
        &model,
        &[
            "--draft",
            drafter.to_str().unwrap(),
            "--requests",
            "3",
            "--max-live",
            "3",
            "--max-batch-tokens",
            "16",
            "-n",
            "4",
            "-r",
            "1",
            "--join-probe",
            "40",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {err}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let probes = report["join_probe"].as_array().expect("join_probe");
    assert_eq!(probes.len(), 2, "plain and DFlash arms: {probes:?}");
    for p in probes {
        assert_eq!(p["prompt_tokens"], 40);
        assert_eq!(p["probes"], 5, "{p}");
        // Three background rows stay live; a 40-token prompt under a 16-token budget with
        // the live rows' tokens first takes several steps to its first token.
        assert_eq!(p["background_live_min"], 3, "{p}");
        let steps = p["steps_median"].as_f64().unwrap();
        assert!((3.0..=40.0).contains(&steps), "{p}");
        let (med, max) = (
            p["ttft_ms_median"].as_f64().unwrap(),
            p["ttft_ms_max"].as_f64().unwrap(),
        );
        assert!(0.0 < med && med <= max, "{p}");
    }
    assert!(
        err.contains("40-token prompt joining 3 live rows"),
        "table: {err}"
    );
}

#[test]
fn bad_load_flags_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny(dir.path());
    for (args, needle) in [
        (vec!["--requests", "0"], "at least 1"),
        (vec!["--requests", "3", "--max-live", "0"], "at least 1"),
        (
            vec!["--requests", "3", "--max-batch-tokens", "0"],
            "at least 1",
        ),
        (vec!["--requests", "3", "--join-probe", "0"], "at least 1"),
        (vec!["--join-probe", "64"], "--requests"),
        (vec!["--max-live", "2"], "--requests"),
        (
            vec!["--requests", "3", "--batch", "2"],
            "cannot be used with",
        ),
    ] {
        let mut all = vec!["--no-draft"];
        all.extend(args.iter());
        let out = bench_cpu(&model, &all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
