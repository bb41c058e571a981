//! `dflash eval` end to end: bad input gives one clear message and a non-zero exit; a tiny
//! synthetic target with a random drafter saved to disk gives a JSON report with sane values.

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::*;

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
