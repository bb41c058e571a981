//! Writes the seed inputs of every fuzz target into `fuzz/corpus/<target>/seed-*`: small
//! valid files of each format (a synthetic GGUF and drafter, the repository's configs and
//! templates, typical requests), from which the fuzzers mutate.
//!
//!   cargo run -p dflash-fuzz --example seeds

use std::path::{Path, PathBuf};

use dflash_models::synthetic::{
    drafter_config_for, special_id, synthetic_gguf, write_drafter_dir, SyntheticSpec, CHATML,
};
use dflash_runtime::DType;

fn put(root: &Path, target: &str, name: &str, bytes: &[u8]) {
    let dir = root.join(target);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
}

fn main() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root: PathBuf = repo.join("fuzz/corpus");

    let mut spec = SyntheticSpec::tiny();
    spec.hidden = 32;
    spec.layers = 1;
    spec.heads = 2;
    spec.kv_heads = 1;
    spec.head_dim = 16;
    spec.intermediate = 64;
    spec.context_length = 64;
    spec.dtype = DType::Q8_0;
    put(&root, "gguf", "tiny-q8", &synthetic_gguf(&spec));

    let cfg = drafter_config_for(32, 2, 1, 64, 1, 1, 4, special_id("<|mask|>"));
    let d = tempfile::tempdir().unwrap();
    write_drafter_dir(&cfg, 1, d.path()).unwrap();
    put(
        &root,
        "safetensors",
        "drafter",
        &std::fs::read(d.path().join("model.safetensors")).unwrap(),
    );
    put(
        &root,
        "drafter_config",
        "synthetic",
        &std::fs::read(d.path().join("config.json")).unwrap(),
    );
    put(
        &root,
        "drafter_config",
        "shipped",
        &std::fs::read(repo.join("models/drafters/smollm2-135m-instruct-dflash/config.json"))
            .unwrap(),
    );
    for m in ["tiny_llama3", "tiny_qwen2", "tiny_qwen3"] {
        let dir = repo.join("crates/models/tests/fixtures").join(m);
        put(
            &root,
            "hf_config",
            m,
            &std::fs::read(dir.join("config.json")).unwrap(),
        );
        if m == "tiny_llama3" {
            put(
                &root,
                "tokenizer",
                "tokenizer-json",
                &std::fs::read(dir.join("tokenizer.json")).unwrap(),
            );
        }
        if let Ok(t) = std::fs::read_to_string(dir.join("tokenizer_config.json")) {
            let v: serde_json::Value = serde_json::from_str(&t).unwrap();
            if let Some(src) = v.get("chat_template").and_then(|s| s.as_str()) {
                put(
                    &root,
                    "chat_template",
                    m,
                    format!("{src}\0You are helpful.\0Hi!\0Hello.").as_bytes(),
                );
            }
        }
    }
    put(
        &root,
        "chat_template",
        "chatml",
        format!("{CHATML}\0sys\0user says hi").as_bytes(),
    );
    for (i, t) in [
        "Hello, world! The quick brown fox.",
        "héllo wörld — ünïcödé 日本語 🦀",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    .iter()
    .enumerate()
    {
        put(&root, "tokenizer", &i.to_string(), t.as_bytes());
    }
    for (i, l) in [
        r#"{"prompt": "Write a haiku.", "max_tokens": 32}"#,
        r#"{"prompt": "hi"}"#,
    ]
    .iter()
    .enumerate()
    {
        put(&root, "batch_line", &i.to_string(), l.as_bytes());
    }
    let chat = [
        r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":0.7,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":3,"stop":["\n\n","END"],"logprobs":true,"top_logprobs":2,"frequency_penalty":0.5,"presence_penalty":-0.5,"repetition_penalty":1.1,"stream":true,"stream_options":{"include_usage":true}}"#,
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_completion_tokens":4,"n":1}"#,
    ];
    for (i, b) in chat.iter().enumerate() {
        put(
            &root,
            "http_body",
            &format!("chat{i}"),
            &[&[0u8][..], b.as_bytes()].concat(),
        );
    }
    let completions = [
        r#"{"model":"m","prompt":"Once upon","max_tokens":5,"stop":"\n","logprobs":2,"echo":false}"#,
        r#"{"prompt":[[1,2,3]],"max_tokens":2,"stream":false,"best_of":1,"seed":-4}"#,
    ];
    for (i, b) in completions.iter().enumerate() {
        put(
            &root,
            "http_body",
            &format!("cmpl{i}"),
            &[&[1u8][..], b.as_bytes()].concat(),
        );
    }
    println!("seeds written under {}", root.display());
}
