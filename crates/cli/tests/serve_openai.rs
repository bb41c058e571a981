//! `dflash serve` end to end through the official `openai` Python client (pytest suite in
//! `tests/openai/`): this test makes a small synthetic target and a random drafter that fits
//! it, then runs the suite, which starts servers on ephemeral loopback ports.
//!
//! Needs `python3` with `pytest`, `httpx` and `openai` (requirements-test.txt; the README's
//! test command and `.ci/run` install them). `DFLASH_PYTHON` picks another interpreter.

use std::path::Path;
use std::process::Command;

use dflash_models::synthetic::{
    drafter_config_for, special_id, synthetic_gguf, write_drafter_dir, SyntheticSpec,
};

/// A target big enough that a long generation takes seconds (so a client can leave in the
/// middle of it), with room in the context for long requests.
fn target_spec() -> SyntheticSpec {
    let mut s = SyntheticSpec::tiny();
    s.hidden = 256;
    s.heads = 8;
    s.kv_heads = 4;
    s.head_dim = 32;
    s.intermediate = 768;
    s.layers = 6;
    s.context_length = 4096;
    s
}

#[test]
fn openai_client_suite() {
    let dir = tempfile::tempdir().unwrap();
    let spec = target_spec();
    let model = dir.path().join("target.gguf");
    std::fs::write(&model, synthetic_gguf(&spec)).unwrap();
    let cfg = drafter_config_for(
        spec.hidden,
        spec.heads,
        spec.kv_heads,
        spec.intermediate,
        spec.layers,
        1,
        8,
        special_id("<|mask|>"),
    );
    let draft = dir.path().join("draft");
    write_drafter_dir(&cfg, 5, &draft).unwrap();

    let suite = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai");
    let python = std::env::var("DFLASH_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python)
        .args(["-c", "import openai, httpx, pytest"])
        .output();
    match probe {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "{python} lacks the test requirements ({}); run \
             `python3 -m pip install -r requirements-test.txt`",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!("cannot run {python}: {e}"),
    }
    let status = Command::new(&python)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(&suite)
        .current_dir(&suite)
        .env("DFLASH_BIN", env!("CARGO_BIN_EXE_dflash"))
        .env("DFLASH_TEST_MODEL", &model)
        .env("DFLASH_TEST_DRAFT", &draft)
        .env("DFLASH_CACHE_DIR", dir.path().join("cache"))
        .env_remove("DFLASH_MODEL")
        .env_remove("DFLASH_DRAFT")
        .status()
        .expect("pytest runs");
    assert!(status.success(), "the openai client suite failed");
}
