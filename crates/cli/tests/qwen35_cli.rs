//! `dflash generate` and `dflash eval` on Qwen 3.5 hybrids: the tiny transformers-checked HF
//! fixture and a synthetic `qwen35` GGUF, plain and with a random DFlash drafter (greedy
//! DFlash output must equal plain output, batched too), and a config with an unknown field
//! gives a clear error.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dflash_models::synthetic::{
    drafter_config_for, synthetic_qwen35_gguf, write_drafter_dir, Qwen35Spec,
};

fn dflash(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn ok(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny_qwen35")
}

fn tokens(json: &str) -> Vec<u64> {
    let v: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn generate_plain_and_dflash_agree_on_the_hf_fixture_and_a_gguf() {
    let d = tempfile::tempdir().unwrap();
    let gguf = d.path().join("q35.gguf");
    std::fs::write(&gguf, synthetic_qwen35_gguf(&Qwen35Spec::tiny())).unwrap();
    for (model, hidden, inter, layers, mask) in
        [(fixture(), 64, 96, 6, 296), (gguf.clone(), 64, 128, 4, 263)]
    {
        let draft = d.path().join(format!("draft{layers}"));
        write_drafter_dir(
            &drafter_config_for(hidden, 4, 2, inter, layers, 1, 8, mask),
            3,
            &draft,
        )
        .unwrap();
        let m = model.to_str().unwrap();
        let base = [
            "generate",
            "The quick brown fox",
            "--raw",
            "-n",
            "24",
            "--model",
            m,
            "--output-format",
            "json",
        ];
        let plain = tokens(&ok(dflash(&[&base[..], &["--no-draft"]].concat())));
        assert!(!plain.is_empty(), "{m}");
        let spec = tokens(&ok(dflash(
            &[
                &base[..],
                &[
                    "--draft",
                    draft.to_str().unwrap(),
                    "--block-size",
                    "8",
                    "--speculation",
                    "always",
                ],
            ]
            .concat(),
        )));
        assert_eq!(spec, plain, "{m}: DFlash equals plain decoding");
    }
}

#[test]
fn unknown_config_fields_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(fixture()).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, d.path().join(f.file_name().unwrap())).unwrap();
    }
    let cfg = d.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["linear_frobnication"] = serde_json::json!(3);
    std::fs::write(&cfg, v.to_string()).unwrap();
    let out = dflash(&[
        "generate",
        "hi",
        "-n",
        "2",
        "--no-draft",
        "--model",
        d.path().to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !err.contains("panicked"), "{err}");
    assert!(err.contains("unknown field `linear_frobnication`"), "{err}");
}
