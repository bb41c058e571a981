//! Bad drafters and draft options: each gets one clear message and a non-zero exit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_models::synthetic::{
    dflash2_config_for, drafter_config_for, special_id, synthetic_gguf, write_drafter_dir,
    SyntheticSpec,
};

fn dflash(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn fails_with(out: Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure; stderr: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    assert!(
        err.contains(needle),
        "stderr does not mention `{needle}`: {err}"
    );
}

/// A tiny target and a directory for a drafter that fits it.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, synthetic_gguf(&SyntheticSpec::tiny())).unwrap();
    let cfg = drafter_config_for(64, 4, 2, 128, 4, 1, 4, special_id("<|mask|>"));
    let draft = dir.join("draft");
    write_drafter_dir(&cfg, 3, &draft).unwrap();
    (model, draft)
}

/// A tiny target and a DFlash2 drafter directory that fits it.
fn setup2(dir: &Path) -> (PathBuf, PathBuf) {
    let (model, _) = setup(dir);
    let base = drafter_config_for(64, 4, 2, 128, 4, 1, 4, special_id("<|mask|>"));
    let vocab = dflash_models::synthetic::vocab().0.len();
    let cfg = dflash2_config_for(base, vocab, 8);
    let draft = dir.join("draft2");
    write_drafter_dir(&cfg, 3, &draft).unwrap();
    (model, draft)
}

fn generate(model: &Path, draft: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "generate",
        "hello",
        "-n",
        "4",
        "--model",
        model.to_str().unwrap(),
        "--draft",
        draft.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    dflash(&args)
}

#[test]
fn a_fitting_random_drafter_runs() {
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    let out = generate(&model, &draft, &["--output-format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["stats"]["rounds"].as_u64().unwrap() >= 1);
}

#[test]
fn a_dflash2_drafter_is_recognised_and_runs() {
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup2(d.path());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(draft.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["architectures"][0], "DFlash2DraftModel");
    for extra in [&[][..], &["--temperature", "0.8", "--seed", "4"][..]] {
        let mut args = vec!["--output-format", "json"];
        args.extend_from_slice(extra);
        let out = generate(&model, &draft, &args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["stats"]["rounds"].as_u64().unwrap() >= 1);
    }
}

#[test]
fn inconsistent_dflash2_configs_are_refused() {
    let cases: [(&str, ConfigEdit); 4] = [
        ("lacks selector_top_k", |v| {
            v["dflash_config"]
                .as_object_mut()
                .unwrap()
                .remove("selector_top_k");
        }),
        ("selector covers 100", |v| {
            v["vocab_size"] = 100.into();
        }),
        ("has DFlash2 fields", |v| {
            v["architectures"] = serde_json::json!(["DFlashDraftModel"]);
        }),
        ("must divide the hidden size", |v| {
            v["dflash_config"]["conv_group_size"] = 48.into();
        }),
    ];
    for (needle, edit) in cases {
        let d = tempfile::tempdir().unwrap();
        let (model, draft) = setup2(d.path());
        edit_config(&draft, edit);
        fails_with(generate(&model, &draft, &[]), needle);
    }
    // Codebooks narrower than the config says.
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup2(d.path());
    edit_config(&draft, |v| {
        v["dflash_config"]["selector_rank"] = 32.into();
    });
    fails_with(
        generate(&model, &draft, &[]),
        "candidate_selector.predecessor_codebook",
    );
}

#[test]
fn missing_or_empty_drafter_directory() {
    let d = tempfile::tempdir().unwrap();
    let (model, _) = setup(d.path());
    fails_with(
        generate(&model, &d.path().join("nope"), &[]),
        "drafter not found",
    );
    std::fs::create_dir_all(d.path().join("empty")).unwrap();
    fails_with(
        generate(&model, &d.path().join("empty"), &[]),
        "drafter not found",
    );
}

/// A change made to a drafter's config.json.
type ConfigEdit = fn(&mut serde_json::Value);

fn edit_config(draft: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = draft.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn incompatible_configs_are_refused() {
    let cases: [(&str, ConfigEdit); 5] = [
        ("block_size 1000 is outside", |v| {
            v["block_size"] = 1000.into();
        }),
        ("hidden size", |v| {
            v["hidden_size"] = 128.into();
        }),
        ("taps target layer 9", |v| {
            v["dflash_config"]["target_layer_ids"] = serde_json::json!([1, 9]);
        }),
        ("outside the target vocabulary", |v| {
            v["dflash_config"]["mask_token_id"] = 100000.into();
        }),
        ("mask_token_id", |v| {
            v["dflash_config"]
                .as_object_mut()
                .unwrap()
                .remove("mask_token_id");
        }),
    ];
    for (needle, edit) in cases {
        let d = tempfile::tempdir().unwrap();
        let (model, draft) = setup(d.path());
        edit_config(&draft, edit);
        fails_with(generate(&model, &draft, &[]), needle);
    }
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    std::fs::write(draft.join("config.json"), "{ not json").unwrap();
    fails_with(generate(&model, &draft, &[]), "not valid JSON");
}

#[test]
fn missing_misshapen_and_corrupt_tensors() {
    // A drafter with an extra layer in its config lacks that layer's tensors.
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    edit_config(&draft, |v| {
        v["num_hidden_layers"] = 2.into();
    });
    fails_with(generate(&model, &draft, &[]), "layers.1.");

    // Wider MLP in the config than in the weights.
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    edit_config(&draft, |v| {
        v["intermediate_size"] = 256.into();
    });
    fails_with(generate(&model, &draft, &[]), "has shape");

    // Truncated safetensors file.
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    let st = draft.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let out = generate(&model, &draft, &[]);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(
        err.contains("corrupt") || err.contains("outside the file"),
        "{err}"
    );
}

#[test]
fn bad_block_sizes_and_batch_files() {
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    fails_with(
        generate(&model, &draft, &["--block-size", "1"]),
        "block size 1",
    );
    fails_with(
        generate(&model, &draft, &["--block-size", "64"]),
        "block size 64",
    );
    let batch = d.path().join("batch.jsonl");
    std::fs::write(&batch, "{\"prompt\": \"hi\"}\nnot json\n").unwrap();
    let out = dflash(&[
        "generate",
        "--batch",
        batch.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]);
    fails_with(out, "line 2");
    std::fs::write(&batch, "{\"prompt\": \"hi\", \"max_tokens\": 0}\n").unwrap();
    let out = dflash(&[
        "generate",
        "--batch",
        batch.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
    ]);
    fails_with(out, "max_tokens must be at least 1");
    let out = dflash(&[
        "generate",
        "--batch",
        "/nonexistent.jsonl",
        "--model",
        model.to_str().unwrap(),
    ]);
    fails_with(out, "cannot read the batch file");
    // One JSON object per run: several batch results would not be one document.
    std::fs::write(&batch, "{\"prompt\": \"hi\"}\n{\"prompt\": \"yo\"}\n").unwrap();
    let out = dflash(&[
        "generate",
        "--batch",
        batch.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--output-format",
        "json",
    ]);
    fails_with(out, "use --output-format jsonl");
}

#[test]
fn draft_vocabulary_shortlists() {
    use dflash_models::draft_vocab::{DraftVocab, DRAFT_VOCAB_FILE};
    let d = tempfile::tempdir().unwrap();
    let (model, draft) = setup(d.path());
    // No ranking beside the drafter: the default keeps the full vocabulary, a request fails.
    let out = generate(&model, &draft, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fails_with(
        generate(&model, &draft, &["--draft-vocab", "8"]),
        "cannot read",
    );
    // A ranking: any N up to its length runs (the default asks for more and takes it all),
    // beyond it is refused; 0 is the full vocabulary.
    let file = draft.join(DRAFT_VOCAB_FILE);
    DraftVocab::new((0..40).rev().collect())
        .unwrap()
        .write(&file)
        .unwrap();
    for extra in [&[][..], &["--draft-vocab", "40"], &["--draft-vocab", "0"]] {
        let out = generate(&model, &draft, extra);
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    fails_with(
        generate(&model, &draft, &["--draft-vocab", "41"]),
        "ranks 40",
    );
    // Ids past the target's vocabulary, and a corrupt file.
    DraftVocab::new(vec![1, 100_000])
        .unwrap()
        .write(&file)
        .unwrap();
    fails_with(generate(&model, &draft, &["--draft-vocab", "2"]), "100000");
    std::fs::write(&file, b"garbage").unwrap();
    fails_with(
        generate(&model, &draft, &["--draft-vocab", "2"]),
        "truncated or corrupt",
    );
    fails_with(generate(&model, &draft, &[]), "truncated or corrupt");
}
