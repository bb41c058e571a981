//! The resolver: turns what the user named (a GGUF file or an HF directory) into a loaded
//! model with its tokenizer and chat template.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_runtime::Backend;

use crate::any_target::TargetModel;
use crate::chat::ChatTemplate;
use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::llama::{LlamaModel, Naming};
use crate::qwen35::{self, Qwen35Config, Qwen35Model};
use crate::source::gguf::GgufFile;
use crate::source::safetensors_dir::SafetensorsDir;
use crate::tokenizer::TextTokenizer;

/// A target model ready to run, with what is needed to talk to it.
pub struct LoadedModel<B: Backend> {
    pub model: TargetModel<B>,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    /// A short name for logs and the API (`general.name`, or the file/dir name).
    pub name: String,
    pub path: PathBuf,
}

/// Loads the model at `path`: a `.gguf` file or a Hugging Face model directory.
pub fn load_model<B: Backend>(backend: Arc<B>, path: &Path) -> Result<LoadedModel<B>> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.is_dir() {
        load_hf_dir(backend, path)
    } else {
        load_gguf(backend, path)
    }
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .or_else(|| path.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}

fn token_text(tok: &TextTokenizer, id: Option<u32>) -> String {
    id.and_then(|i| tok.id_to_token(i)).unwrap_or_default()
}

fn load_gguf<B: Backend>(backend: Arc<B>, path: &Path) -> Result<LoadedModel<B>> {
    let file = GgufFile::open(path)?;
    let tokenizer = TextTokenizer::from_gguf(&file)?;
    let template = match file.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        Some(src) => Some(ChatTemplate::new(
            src,
            &token_text(&tokenizer, tokenizer.bos),
            &token_text(&tokenizer, tokenizer.stop_ids.first().copied()),
        )?),
        None => None,
    };
    let name = file
        .get("general.name")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| file_stem(path));
    let model = if file.get("general.architecture").and_then(|v| v.as_str()) == Some("qwen35") {
        let cfg = Qwen35Config::from_gguf(&file)?;
        TargetModel::Qwen35(Qwen35Model::load(
            backend,
            cfg,
            &file,
            qwen35::Naming::Gguf,
        )?)
    } else {
        let cfg = LlamaConfig::from_gguf(&file)?;
        TargetModel::Llama(LlamaModel::load(backend, cfg, &file, Naming::Gguf)?)
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        template,
        name,
        path: path.to_path_buf(),
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| ModelError::Config(format!("{} is not valid JSON: {e}", path.display())))
}

/// The chat template of an HF directory: `chat_template.jinja`, or `chat_template` in
/// tokenizer_config.json (a string, or a list of named templates where `default` is used).
fn hf_template_source(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| ModelError::io(&jinja, e));
    }
    let cfg_path = dir.join("tokenizer_config.json");
    if !cfg_path.exists() {
        return Ok(None);
    }
    let cfg = read_json(&cfg_path)?;
    Ok(match cfg.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .or_else(|| list.first())
            .and_then(|t| t.get("template"))
            .and_then(|t| t.as_str())
            .map(str::to_string),
        _ => None,
    })
}

fn load_hf_dir<B: Backend>(backend: Arc<B>, dir: &Path) -> Result<LoadedModel<B>> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(ModelError::Config(format!(
            "{} is not a model directory: config.json is missing",
            dir.display()
        )));
    }
    let json = read_json(&cfg_path)?;
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    let template = match hf_template_source(dir)? {
        Some(src) => Some(ChatTemplate::new(
            &src,
            &token_text(&tokenizer, tokenizer.bos),
            &token_text(&tokenizer, tokenizer.stop_ids.first().copied()),
        )?),
        None => None,
    };
    let tensors = SafetensorsDir::open(dir)?;
    let model = if qwen35::config::is_qwen35_json(&json) {
        let cfg = Qwen35Config::from_hf_json(&json)?;
        let naming = qwen35::Naming::detect_hf(&tensors);
        TargetModel::Qwen35(Qwen35Model::load(backend, cfg, &tensors, naming)?)
    } else {
        let cfg = LlamaConfig::from_hf_json(&json)?;
        TargetModel::Llama(LlamaModel::load(
            backend,
            cfg,
            &tensors,
            Naming::HuggingFace,
        )?)
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        template,
        name: file_stem(dir),
        path: dir.to_path_buf(),
    })
}
