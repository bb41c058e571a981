//! Tokenizers: from a GGUF file's metadata (vocab, merges, pre-tokenizer) or from an HF
//! `tokenizer.json`, both through the `tokenizers` crate; plus streaming detokenization.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::error::{ModelError, Result};
use crate::source::gguf::GgufFile;

/// GGUF token types (tokenizer.ggml.token_type).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the special ids generation needs.
pub struct TextTokenizer {
    inner: Tokenizer,
    pub bos: Option<u32>,
    /// Ids that end generation (EOS, end-of-turn).
    pub stop_ids: Vec<u32>,
    /// Whether prompts get a BOS token in front.
    pub add_bos: bool,
}

impl TextTokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let model = f.str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "GGUF tokenizer model `{model}` is not supported (byte-level BPE, `gpt2`, is); \
                 load the model's Hugging Face directory instead"
            )));
        }
        let tokens = f.str_array("tokenizer.ggml.tokens")?;
        let types = match f.get("tokenizer.ggml.token_type") {
            Some(_) => f.int_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(ModelError::BadMetadata {
                key: "tokenizer.ggml.token_type".into(),
                reason: format!("{} types for {} tokens", types.len(), tokens.len()),
            });
        }
        let merges: Vec<(String, String)> = f
            .str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::BadMetadata {
                        key: "tokenizer.ggml.merges".into(),
                        reason: format!("merge `{m}` is not two tokens"),
                    })
            })
            .collect::<Result<_>>()?;
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| ModelError::Tokenizer(format!("cannot build BPE: {e}")))?;
        let mut tok = Tokenizer::new(bpe);
        let pre = f
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        tok.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &t)| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED)
            .map(|(s, &t)| AddedToken::from(s.to_string(), t == TOKEN_CONTROL))
            .collect();
        tok.add_special_tokens(specials)
            .map_err(|e| ModelError::Tokenizer(format!("cannot add special tokens: {e}")))?;
        let id = |k: &str| -> Result<Option<u32>> {
            Ok(f.opt_u64(k)?
                .map(|v| v as u32)
                .filter(|&v| (v as usize) < tokens.len()))
        };
        let mut stop_ids: Vec<u32> = [
            id("tokenizer.ggml.eos_token_id")?,
            id("tokenizer.ggml.eot_token_id")?,
        ]
        .into_iter()
        .flatten()
        .collect();
        stop_ids.dedup();
        Ok(Self {
            inner: tok,
            bos: id("tokenizer.ggml.bos_token_id")?,
            stop_ids,
            add_bos: f
                .get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })
    }

    /// Loads `tokenizer.json` from an HF directory, with special ids from its configs.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(ModelError::Tokenizer(format!(
                "{} is missing",
                path.display()
            )));
        }
        let inner = parse_tokenizer_file(&path)?;
        let cfg = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let gen = read_json_opt(&dir.join("generation_config.json"))?;
        let model_cfg = read_json_opt(&dir.join("config.json"))?;
        let token_id = |name: &str| -> Option<u32> {
            let v = cfg.as_ref()?.get(name)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(s)
        };
        let mut stop_ids = Vec::new();
        for src in [&gen, &model_cfg] {
            match src.as_ref().and_then(|g| g.get("eos_token_id")) {
                Some(serde_json::Value::Number(n)) => stop_ids.extend(n.as_u64().map(|x| x as u32)),
                Some(serde_json::Value::Array(a)) => {
                    stop_ids.extend(a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)))
                }
                _ => {}
            }
        }
        stop_ids.extend(token_id("eos_token"));
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let add_bos = cfg
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Self {
            bos: token_id("bos_token"),
            inner,
            stop_ids,
            add_bos,
        })
    }

    /// Token ids of `text` (special tokens written in the text become their ids); a BOS is put
    /// in front when the model wants one and `add_special` is set.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(format!("cannot encode: {e}")))?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(format!("cannot decode: {e}")))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

fn read_json_opt(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Config(format!("{} is not valid JSON: {e}", path.display())))
}

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` name.
fn pre_tokenizer(name: &str) -> Result<PreTokenizerWrapper> {
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| ModelError::Tokenizer(format!("bad split pattern: {e}")))?;
        Ok(Sequence::new(vec![s.into(), ByteLevel::new(false, true, false).into()]).into())
    };
    match name {
        "default" | "gpt2" | "gpt-2" => Ok(ByteLevel::new(false, true, true).into()),
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva" => {
            Ok(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])
            .into())
        }
        "llama-bpe" | "llama3" | "smaug-bpe" => split(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" => split(QWEN2_SPLIT),
        other => Err(ModelError::Tokenizer(format!(
            "GGUF pre-tokenizer `{other}` is not supported (supported: default, gpt2, smollm, \
             starcoder, llama-bpe, qwen2)"
        ))),
    }
}

/// Parses a `tokenizer.json`. The tokenizers crate panics (`expect`) on some malformed
/// files, e.g. a `decoder` that is neither null nor an object (found by fuzzing); a user's
/// file must give an error, so the parse runs under `catch_unwind` with the panic message
/// silenced.
fn parse_tokenizer_file(path: &Path) -> Result<Tokenizer> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let parsed = std::panic::catch_unwind(|| text.parse::<Tokenizer>());
    std::panic::set_hook(hook);
    match parsed {
        Ok(Ok(t)) => Ok(t),
        Ok(Err(e)) => Err(ModelError::Tokenizer(format!("{}: {e}", path.display()))),
        Err(_) => Err(ModelError::Tokenizer(format!(
            "{} is malformed (the tokenizers crate cannot read it)",
            path.display()
        ))),
    }
}

/// Turns a growing list of token ids into text pieces as soon as they are complete UTF-8.
///
/// Decodes a short window of recent tokens so each step costs O(window), not O(length).
#[derive(Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `id`; returns the new text it completes (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prev = tok.decode(&self.ids[self.prefix..self.read])?;
        let text = tok.decode(&self.ids[self.prefix..])?;
        if text.len() > prev.len()
            && text.is_char_boundary(prev.len())
            && !text.ends_with('\u{FFFD}')
        {
            let piece = text[prev.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the end), decoded lossily.
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let prev = tok.decode(&self.ids[self.prefix..self.read])?;
        let text = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(text.get(prev.len()..).unwrap_or("").to_string())
    }
}
