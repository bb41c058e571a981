//! Fuzz harnesses: one function per parser that a user's bytes reach. Each takes arbitrary
//! bytes and must return without panicking, hanging or exhausting memory, whatever they are
//! (errors are fine: they are the parsers' answers).
//!
//! The coverage-guided libFuzzer targets in `fuzz/` call these (see `tools/fuzz.sh`); the
//! `corpus` test replays the committed corpora and a bounded number of mutations of them
//! in every `cargo test`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use dflash_models::chat::{ChatTemplate, Message};
use dflash_models::config::LlamaConfig;
use dflash_models::dflash::DrafterConfig;
use dflash_models::source::gguf::GgufFile;
use dflash_models::source::safetensors_dir::SafetensorsDir;
use dflash_models::source::TensorSource;
use dflash_models::synthetic::{synthetic_gguf, SyntheticSpec, CHATML};
use dflash_models::tokenizer::{StreamDecoder, TextTokenizer};
use dflash_runtime::cpu::CpuBackend;
use dflash_server::api::{ChatRequest, CompletionRequest};
use dflash_server::validate::{self, ModelInfo};

/// A harness: takes any bytes, must return.
pub type Harness = fn(&[u8]);

/// Every harness, by the name its corpus directory and libFuzzer target have.
pub const TARGETS: [(&str, Harness); 8] = [
    ("gguf", gguf),
    ("safetensors", safetensors),
    ("hf_config", hf_config),
    ("drafter_config", drafter_config),
    ("tokenizer", tokenizer),
    ("chat_template", chat_template),
    ("batch_line", batch_line),
    ("http_body", http_body),
];

/// A scratch directory for harnesses that must hand the loaders a file.
fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"))
        .path()
}

fn write(name: &str, data: &[u8]) -> PathBuf {
    let p = scratch().join(name);
    std::fs::write(&p, data).expect("the scratch directory is writable");
    p
}

/// The synthetic model's tokenizer and chat template (real byte-level BPE, ChatML).
fn model() -> &'static ModelInfo {
    static INFO: OnceLock<ModelInfo> = OnceLock::new();
    INFO.get_or_init(|| {
        let bytes = synthetic_gguf(&SyntheticSpec::tiny());
        let f = GgufFile::parse(Path::new("synthetic.gguf"), Arc::new(bytes))
            .expect("the synthetic model parses");
        ModelInfo {
            id: "m".into(),
            tokenizer: Arc::new(TextTokenizer::from_gguf(&f).expect("its tokenizer loads")),
            template: Some(ChatTemplate::new(CHATML, "", "<|im_end|>").expect("ChatML compiles")),
            context_length: 256,
        }
    })
}

/// A GGUF file: header, metadata, tensor table, then the whole model load (config,
/// tokenizer, chat template, every tensor's shape and bytes) on a one-thread CPU backend.
pub fn gguf(data: &[u8]) {
    if let Ok(f) = GgufFile::parse(Path::new("fuzz.gguf"), Arc::new(data.to_vec())) {
        let _ = LlamaConfig::from_gguf(&f);
        let _ = TextTokenizer::from_gguf(&f);
        let path = write("fuzz.gguf", data);
        static BACKEND: OnceLock<Arc<CpuBackend>> = OnceLock::new();
        let b = BACKEND.get_or_init(|| Arc::new(CpuBackend::new(1)));
        let _ = dflash_models::load_model(b.clone(), &path);
    }
}

/// A `model.safetensors` file: header, offsets, every tensor read as a weight.
pub fn safetensors(data: &[u8]) {
    let dir = scratch().join("st");
    let _ = std::fs::create_dir_all(&dir);
    std::fs::write(dir.join("model.safetensors"), data).expect("writable");
    if let Ok(st) = SafetensorsDir::open(&dir) {
        let names: Vec<String> = st.names().map(str::to_string).collect();
        for n in names {
            let _ = st.weight(&n, None);
        }
    }
}

/// A Hugging Face `config.json` of a target.
pub fn hf_config(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice(data) {
        if let Ok(c) = LlamaConfig::from_hf_json(&v) {
            let _ = c.validate();
        }
    }
}

/// A DFlash drafter's `config.json`, checked against the synthetic target's shape.
pub fn drafter_config(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice(data) {
        if let Ok(c) = DrafterConfig::from_json(&v) {
            let _ = c.check_target(64, 4, 264);
        }
    }
}

/// A `tokenizer.json` (when the bytes are JSON); else text through the synthetic model's
/// tokenizer and back, and arbitrary ids through the streaming decoder.
pub fn tokenizer(data: &[u8]) {
    if data.first() == Some(&b'{') {
        let dir = scratch().join("tok");
        let _ = std::fs::create_dir_all(&dir);
        std::fs::write(dir.join("tokenizer.json"), data).expect("writable");
        if let Ok(t) = TextTokenizer::from_hf_dir(&dir) {
            if let Ok(ids) = t.encode("Hello wörld", true) {
                let _ = t.decode(&ids);
            }
        }
        return;
    }
    let tok = &model().tokenizer;
    let text = String::from_utf8_lossy(data);
    if let Ok(ids) = tok.encode(&text, true) {
        let _ = tok.decode(&ids);
    }
    let mut stream = StreamDecoder::new();
    for c in data.chunks(2) {
        let id = u16::from_le_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
        let _ = stream.push(tok, id);
    }
    let _ = stream.flush(tok);
}

/// A chat template (from a model file) rendered over messages: the bytes up to the first
/// NUL are the template source, the rest are message contents split at NULs.
pub fn chat_template(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.split('\0');
    let src = parts.next().unwrap_or("");
    let roles = ["system", "user", "assistant"];
    let messages: Vec<Message> = parts
        .enumerate()
        .map(|(i, c)| Message::new(roles[i % 3], c))
        .collect();
    if let Ok(t) = ChatTemplate::new(src, "<s>", "</s>") {
        let _ = t.render(&messages, true);
    }
    // The same messages through the model's own template and tokenizer.
    let info = model();
    let _ = dflash_models::chat::conversation_ids(
        &info.tokenizer,
        info.template.as_ref(),
        &messages,
        false,
    );
}

/// A line of a `--batch` JSONL file.
pub fn batch_line(data: &[u8]) {
    if let Ok(line) = std::str::from_utf8(data) {
        let _ = validate::batch_line(line);
    }
}

/// An HTTP request body for `/v1/chat/completions` (first byte even) or `/v1/completions`.
pub fn http_body(data: &[u8]) {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let info = model();
    if which % 2 == 0 {
        if let Ok(r) = validate::parse::<ChatRequest>(body) {
            let _ = validate::chat(info, r);
        }
    } else if let Ok(r) = validate::parse::<CompletionRequest>(body) {
        let _ = validate::completion(info, r);
    }
}
