//! Synthetic models: random weights of any Llama-family or Qwen 3.5 hybrid shape with a small
//! byte-level BPE tokenizer (padded to the model's vocabulary) and a ChatML template, written
//! as GGUF. Used by tests (no download needed) and by benchmarks of large shapes.

use dflash_runtime::quant::quantize_row;
use dflash_runtime::DType;
use rand::{Rng, SeedableRng};

use crate::config::Arch;
use crate::source::gguf::MetaValue;
use crate::source::gguf_writer::GgufWriter;

/// Shape and storage of a synthetic model.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub arch: Arch,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub context_length: usize,
    /// Storage of the matrices (norms stay f32).
    pub dtype: DType,
    /// Storage of the token embedding and the output head, where it differs from `dtype`.
    pub head_dtype: Option<DType>,
    pub tied_embeddings: bool,
    pub seed: u64,
    /// Vocabulary size: the synthetic tokenizer's tokens padded with unused control tokens
    /// up to this size (0: no padding), for output heads of real models' shapes.
    pub vocab_size: usize,
}

impl SyntheticSpec {
    /// A tiny Llama: 4 layers of width 64, context 256, Q8_0 matrices.
    pub fn tiny() -> Self {
        Self {
            arch: Arch::Llama,
            hidden: 64,
            layers: 4,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            intermediate: 128,
            context_length: 256,
            dtype: DType::Q8_0,
            head_dtype: None,
            tied_embeddings: true,
            seed: 1,
            vocab_size: 0,
        }
    }

    /// SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads of 64, FFN 1536,
    /// vocabulary 49152, tied embeddings), context 8192, random weights stored as `dtype`: the
    /// default model's step without its download (the head is stored as `dtype` too unless
    /// `head_dtype` says otherwise; the published GGUF keeps it in Q8_0).
    pub fn smollm2_135m(dtype: DType) -> Self {
        Self {
            arch: Arch::Llama,
            hidden: 576,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            intermediate: 1536,
            context_length: 8192,
            dtype,
            head_dtype: None,
            tied_embeddings: true,
            seed: 135,
            vocab_size: 49_152,
        }
    }

    /// Qwen3-4B's shapes (36 layers, hidden 2560, 32 query / 8 KV heads of 128, FFN 9728,
    /// vocabulary 151936, tied embeddings, q/k norms), context 8192, random weights stored as
    /// `dtype`: a target whose decode is bound by weight bytes, for benchmarks.
    pub fn qwen3_4b(dtype: DType) -> Self {
        Self {
            arch: Arch::Qwen3,
            hidden: 2560,
            layers: 36,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            intermediate: 9728,
            context_length: 8192,
            dtype,
            head_dtype: None,
            tied_embeddings: true,
            seed: 4,
            vocab_size: 151_936,
        }
    }
}

pub const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's reversible map from bytes to printable characters.
pub fn byte_to_char(b: u8) -> char {
    let printable =
        |c: u32| (33..=126).contains(&c) || (161..=172).contains(&c) || (174..=255).contains(&c);
    if printable(b as u32) {
        return char::from(b);
    }
    let rank = (0..b as u32).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + rank).expect("valid code point")
}

/// The synthetic vocabulary: 256 byte tokens, a few merges, then the special tokens.
pub fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_char(b).to_string()).collect();
    let sp = byte_to_char(b' ').to_string();
    let merges = vec![
        format!("{sp} t"),
        "h e".to_string(),
        format!("{sp}t he"),
        "i n".to_string(),
    ];
    tokens.extend([
        format!("{sp}t"),
        "he".into(),
        format!("{sp}the"),
        "in".into(),
    ]);
    let mut types = vec![1i32; tokens.len()];
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"] {
        tokens.push(s.to_string());
        types.push(3);
    }
    (tokens, types, merges)
}

/// Id of a special token of the synthetic vocabulary.
pub fn special_id(name: &str) -> u32 {
    let (tokens, _, _) = vocab();
    tokens
        .iter()
        .position(|t| t == name)
        .expect("special token exists") as u32
}

fn random_matrix(rng: &mut rand::rngs::StdRng, rows: usize, cols: usize, scale: f32) -> Vec<f32> {
    (0..rows * cols)
        .map(|_| rng.random_range(-scale..scale))
        .collect()
}

fn encode(dtype: DType, values: &[f32], cols: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for row in values.chunks_exact(cols) {
        quantize_row(dtype, row, &mut out);
    }
    out
}

/// A `rows x cols` matrix of values uniform in `[-scale, scale)`, stored as `dtype`: made
/// in chunks of rows, each from its own generator seeded by (`seed`, chunk), on all cores
/// (the values depend on the seed only, not on the number of threads).
fn random_encoded(seed: u64, dtype: DType, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    const CHUNK_ROWS: usize = 256;
    let chunks = rows.div_ceil(CHUNK_ROWS);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(chunks.max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let parts = std::sync::Mutex::new(Vec::with_capacity(chunks));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if c >= chunks {
                    break;
                }
                let mut rng = rand::rngs::StdRng::seed_from_u64(
                    seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                );
                let n = CHUNK_ROWS.min(rows - c * CHUNK_ROWS);
                let bytes = encode(dtype, &random_matrix(&mut rng, n, cols, scale), cols);
                parts.lock().expect("parts lock").push((c, bytes));
            });
        }
    });
    let mut parts = parts.into_inner().expect("parts lock");
    parts.sort_by_key(|p| p.0);
    parts.into_iter().flat_map(|p| p.1).collect()
}

/// The GGUF bytes of a random model with `spec`'s shapes.
pub fn synthetic_gguf(spec: &SyntheticSpec) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let (mut tokens, mut types, merges) = vocab();
    for i in tokens.len()..spec.vocab_size {
        tokens.push(format!("<|unused_{i}|>"));
        types.push(3);
    }
    let vocab_len = tokens.len();
    let arch = match spec.arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
    };
    let key = |k: &str| format!("{arch}.{k}");
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str(arch.into()))
        .meta("general.name", MetaValue::Str("synthetic".into()))
        .meta(&key("block_count"), MetaValue::U32(spec.layers as u32))
        .meta(
            &key("context_length"),
            MetaValue::U32(spec.context_length as u32),
        )
        .meta(&key("embedding_length"), MetaValue::U32(spec.hidden as u32))
        .meta(
            &key("feed_forward_length"),
            MetaValue::U32(spec.intermediate as u32),
        )
        .meta(
            &key("attention.head_count"),
            MetaValue::U32(spec.heads as u32),
        )
        .meta(
            &key("attention.head_count_kv"),
            MetaValue::U32(spec.kv_heads as u32),
        )
        .meta(
            &key("attention.key_length"),
            MetaValue::U32(spec.head_dim as u32),
        )
        .meta(&key("rope.freq_base"), MetaValue::F32(10000.0))
        .meta(
            &key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-5),
        )
        .meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::Str("default".into()))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::Str).collect()),
        )
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        )
        .meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(merges.into_iter().map(MetaValue::Str).collect()),
        )
        .meta(
            "tokenizer.ggml.bos_token_id",
            MetaValue::U32(special_id("<|im_start|>")),
        )
        .meta(
            "tokenizer.ggml.eos_token_id",
            MetaValue::U32(special_id("<|im_end|>")),
        )
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .meta("tokenizer.chat_template", MetaValue::Str(CHATML.into()));
    let h = spec.hidden;
    let (qd, kvd) = (spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim);
    let f32_id = DType::F32.ggml_id();
    let mut matrix_as =
        |w: &mut GgufWriter, dt: DType, name: &str, rows: usize, cols: usize, scale: f32| {
            let bytes = random_encoded(rng.random(), dt, rows, cols, scale);
            w.tensor(name, &[cols as u64, rows as u64], dt.ggml_id(), bytes);
        };
    let head_dt = spec.head_dtype.unwrap_or(spec.dtype);
    matrix_as(&mut w, head_dt, "token_embd.weight", vocab_len, h, 1.0);
    if !spec.tied_embeddings {
        matrix_as(
            &mut w,
            head_dt,
            "output.weight",
            vocab_len,
            h,
            1.0 / (h as f32).sqrt(),
        );
    }
    let dt = spec.dtype;
    let mut matrix = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize, scale: f32| {
        matrix_as(w, dt, name, rows, cols, scale)
    };
    for i in 0..spec.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        matrix(&mut w, &n("attn_q.weight"), qd, h, 1.0 / (h as f32).sqrt());
        matrix(&mut w, &n("attn_k.weight"), kvd, h, 1.0 / (h as f32).sqrt());
        matrix(&mut w, &n("attn_v.weight"), kvd, h, 1.0 / (h as f32).sqrt());
        matrix(
            &mut w,
            &n("attn_output.weight"),
            h,
            qd,
            1.0 / (qd as f32).sqrt(),
        );
        matrix(
            &mut w,
            &n("ffn_gate.weight"),
            spec.intermediate,
            h,
            1.0 / (h as f32).sqrt(),
        );
        matrix(
            &mut w,
            &n("ffn_up.weight"),
            spec.intermediate,
            h,
            1.0 / (h as f32).sqrt(),
        );
        matrix(
            &mut w,
            &n("ffn_down.weight"),
            h,
            spec.intermediate,
            1.0 / (spec.intermediate as f32).sqrt(),
        );
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed ^ 0x5eed);
    let mut norm = |w: &mut GgufWriter, name: &str, len: usize| {
        let v: Vec<f32> = (0..len)
            .map(|_| 1.0 + rng.random_range(-0.1f32..0.1))
            .collect();
        w.tensor(name, &[len as u64], f32_id, encode(DType::F32, &v, len));
    };
    for i in 0..spec.layers {
        norm(&mut w, &format!("blk.{i}.attn_norm.weight"), h);
        norm(&mut w, &format!("blk.{i}.ffn_norm.weight"), h);
        if spec.arch == Arch::Qwen3 {
            norm(
                &mut w,
                &format!("blk.{i}.attn_q_norm.weight"),
                spec.head_dim,
            );
            norm(
                &mut w,
                &format!("blk.{i}.attn_k_norm.weight"),
                spec.head_dim,
            );
        }
    }
    norm(&mut w, "output_norm.weight", h);
    w.to_bytes()
}

/// Shape and storage of a synthetic Qwen 3.5 hybrid (written as llama.cpp's `qwen35` GGUF).
#[derive(Clone, Debug)]
pub struct Qwen35Spec {
    pub hidden: usize,
    pub layers: usize,
    /// Layer i is full attention iff (i + 1) % interval == 0.
    pub full_attention_interval: usize,
    pub intermediate: usize,
    /// Vocabulary (the synthetic tokenizer padded with unreachable tokens up to it).
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot_dim: usize,
    pub gdn: dflash_runtime::GdnShape,
    pub context_length: usize,
    /// Storage of the matrices (norms, conv kernels and gates stay f32).
    pub dtype: DType,
    pub tied_embeddings: bool,
    pub seed: u64,
}

impl Qwen35Spec {
    /// Qwen3.5-0.8B's shapes (notes/qwen35_gdn.md §1.3): 24 layers of width 1024, 6 of them
    /// gated attention (8 q / 2 kv heads of 256, rotary 64), 18 GDN (16 k / 16 v heads of 128),
    /// vocabulary 248320, tied head.
    pub fn qwen35_0_8b(dtype: DType) -> Self {
        Self {
            hidden: 1024,
            layers: 24,
            full_attention_interval: 4,
            intermediate: 3584,
            vocab: 248320,
            heads: 8,
            kv_heads: 2,
            head_dim: 256,
            rot_dim: 64,
            gdn: dflash_runtime::GdnShape {
                k_heads: 16,
                v_heads: 16,
                k_dim: 128,
                v_dim: 128,
                conv_kernel: 4,
                tiled_heads: true,
            },
            context_length: 4096,
            dtype,
            tied_embeddings: true,
            seed: 1,
        }
    }

    /// Qwen3.5-4B's shapes: 32 layers of width 2560 (8 attention with 16 q / 4 kv heads, 24
    /// GDN with 16 k / 32 v heads), intermediate 9216, tied head.
    pub fn qwen35_4b(dtype: DType) -> Self {
        Self {
            hidden: 2560,
            layers: 32,
            intermediate: 9216,
            heads: 16,
            kv_heads: 4,
            gdn: dflash_runtime::GdnShape {
                k_heads: 16,
                v_heads: 32,
                ..Self::qwen35_0_8b(dtype).gdn
            },
            ..Self::qwen35_0_8b(dtype)
        }
    }

    /// A tiny hybrid for tests: 4 layers (3 GDN + 1 attention) of width 64.
    pub fn tiny() -> Self {
        Self {
            hidden: 64,
            layers: 4,
            full_attention_interval: 4,
            intermediate: 128,
            vocab: vocab().0.len(),
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            rot_dim: 4,
            gdn: dflash_runtime::GdnShape {
                k_heads: 2,
                v_heads: 4,
                k_dim: 16,
                v_dim: 16,
                conv_kernel: 4,
                tiled_heads: true,
            },
            context_length: 512,
            dtype: DType::F32,
            tied_embeddings: false,
            seed: 1,
        }
    }
}

/// The GGUF bytes of a random Qwen 3.5 hybrid with `spec`'s shapes, named and laid out as
/// llama.cpp writes `qwen35` (zero-centred norms stored as `1 + w`, `ssm_a` = -exp(A_log),
/// v heads in tiled order).
pub fn synthetic_qwen35_gguf(spec: &Qwen35Spec) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let (mut tokens, mut types, merges) = vocab();
    assert!(
        spec.vocab >= tokens.len(),
        "vocabulary below the synthetic tokenizer's"
    );
    for i in tokens.len()..spec.vocab {
        tokens.push(format!("<unused{i}>"));
        types.push(1);
    }
    let key = |k: &str| format!("qwen35.{k}");
    let g = spec.gdn;
    let u = |v: usize| MetaValue::U32(v as u32);
    let mut w = GgufWriter::new();
    w.meta("general.architecture", MetaValue::Str("qwen35".into()))
        .meta("general.name", MetaValue::Str("synthetic-qwen35".into()))
        .meta(&key("block_count"), u(spec.layers))
        .meta(&key("context_length"), u(spec.context_length))
        .meta(&key("embedding_length"), u(spec.hidden))
        .meta(&key("feed_forward_length"), u(spec.intermediate))
        .meta(&key("attention.head_count"), u(spec.heads))
        .meta(&key("attention.head_count_kv"), u(spec.kv_heads))
        .meta(&key("attention.key_length"), u(spec.head_dim))
        .meta(&key("attention.value_length"), u(spec.head_dim))
        .meta(
            &key("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-6),
        )
        .meta(&key("rope.freq_base"), MetaValue::F32(1e7))
        .meta(&key("rope.dimension_count"), u(spec.rot_dim))
        .meta(&key("ssm.conv_kernel"), u(g.conv_kernel))
        .meta(&key("ssm.state_size"), u(g.k_dim))
        .meta(&key("ssm.group_count"), u(g.k_heads))
        .meta(&key("ssm.time_step_rank"), u(g.v_heads))
        .meta(&key("ssm.inner_size"), u(g.value_dim()))
        .meta(
            &key("full_attention_interval"),
            u(spec.full_attention_interval),
        )
        .meta("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::Str("default".into()))
        .meta(
            "tokenizer.ggml.tokens",
            MetaValue::Array(tokens.into_iter().map(MetaValue::Str).collect()),
        )
        .meta(
            "tokenizer.ggml.token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        )
        .meta(
            "tokenizer.ggml.merges",
            MetaValue::Array(merges.into_iter().map(MetaValue::Str).collect()),
        )
        .meta(
            "tokenizer.ggml.eos_token_id",
            u(special_id("<|im_end|>") as usize),
        )
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(false))
        .meta("tokenizer.chat_template", MetaValue::Str(CHATML.into()));
    let h = spec.hidden;
    let qd = spec.heads * spec.head_dim;
    let kvd = spec.kv_heads * spec.head_dim;
    let f32_id = DType::F32.ggml_id();
    let dt = spec.dtype;
    let mut matrix = |w: &mut GgufWriter, name: &str, rows: usize, cols: usize| {
        let m = random_matrix(&mut rng, rows, cols, 1.0 / (cols as f32).sqrt());
        w.tensor(
            name,
            &[cols as u64, rows as u64],
            dt.ggml_id(),
            encode(dt, &m, cols),
        );
    };
    matrix(&mut w, "token_embd.weight", spec.vocab, h);
    if !spec.tied_embeddings {
        matrix(&mut w, "output.weight", spec.vocab, h);
    }
    for i in 0..spec.layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        if (i + 1) % spec.full_attention_interval == 0 {
            matrix(&mut w, &n("attn_q.weight"), 2 * qd, h);
            matrix(&mut w, &n("attn_k.weight"), kvd, h);
            matrix(&mut w, &n("attn_v.weight"), kvd, h);
            matrix(&mut w, &n("attn_output.weight"), h, qd);
        } else {
            matrix(&mut w, &n("attn_qkv.weight"), g.conv_dim(), h);
            matrix(&mut w, &n("attn_gate.weight"), g.value_dim(), h);
            matrix(&mut w, &n("ssm_beta.weight"), g.v_heads, h);
            matrix(&mut w, &n("ssm_alpha.weight"), g.v_heads, h);
            matrix(&mut w, &n("ssm_out.weight"), h, g.value_dim());
        }
        matrix(&mut w, &n("ffn_gate.weight"), spec.intermediate, h);
        matrix(&mut w, &n("ffn_up.weight"), spec.intermediate, h);
        matrix(&mut w, &n("ffn_down.weight"), h, spec.intermediate);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed ^ 0x5eed);
    let vector = |w: &mut GgufWriter, name: &str, dims: &[u64], v: Vec<f32>| {
        let cols = dims[0] as usize;
        w.tensor(name, dims, f32_id, encode(DType::F32, &v, cols));
    };
    let mut near_one = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| 1.0 + rng.random_range(-0.1f32..0.1))
            .collect()
    };
    let mut norms = Vec::new();
    for i in 0..spec.layers {
        norms.push((format!("blk.{i}.attn_norm.weight"), h));
        norms.push((format!("blk.{i}.post_attention_norm.weight"), h));
        if (i + 1) % spec.full_attention_interval == 0 {
            norms.push((format!("blk.{i}.attn_q_norm.weight"), spec.head_dim));
            norms.push((format!("blk.{i}.attn_k_norm.weight"), spec.head_dim));
        } else {
            norms.push((format!("blk.{i}.ssm_norm.weight"), g.v_dim));
        }
    }
    norms.push(("output_norm.weight".into(), h));
    for (name, len) in norms {
        let v = near_one(len);
        vector(&mut w, &name, &[len as u64], v);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed ^ 0x9d7);
    for i in 0..spec.layers {
        if (i + 1) % spec.full_attention_interval == 0 {
            continue;
        }
        let hv = g.v_heads;
        let conv: Vec<f32> = (0..g.conv_dim() * g.conv_kernel)
            .map(|_| rng.random_range(-0.5f32..0.5))
            .collect();
        let dims = [g.conv_kernel as u64, g.conv_dim() as u64];
        vector(&mut w, &format!("blk.{i}.ssm_conv1d.weight"), &dims, conv);
        let a: Vec<f32> = (0..hv).map(|_| -rng.random_range(0.05f32..1.5)).collect();
        vector(&mut w, &format!("blk.{i}.ssm_a"), &[hv as u64], a);
        let dtb: Vec<f32> = (0..hv).map(|_| rng.random_range(-0.5f32..0.5)).collect();
        vector(&mut w, &format!("blk.{i}.ssm_dt.bias"), &[hv as u64], dtb);
    }
    w.to_bytes()
}

/// Writes a synthetic model to `path`.
pub fn write_synthetic(spec: &SyntheticSpec, path: &std::path::Path) -> std::io::Result<()> {
    std::fs::write(path, synthetic_gguf(spec))
}

/// Tensors held in memory (for synthetic drafters).
#[derive(Default)]
pub struct MemorySource {
    pub tensors: std::collections::HashMap<String, dflash_runtime::HostWeight>,
    /// Stored shapes of tensors of rank 3 or more (kept as `[product of leading, last]`).
    pub dims: std::collections::HashMap<String, Vec<usize>>,
}

impl crate::source::TensorSource for MemorySource {
    fn weight(
        &self,
        name: &str,
        expect: Option<[usize; 2]>,
    ) -> crate::Result<dflash_runtime::HostWeight> {
        let w = self
            .tensors
            .get(name)
            .ok_or_else(|| crate::ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        if let Some(e) = expect {
            if e != [w.rows, w.cols] {
                return Err(crate::ModelError::TensorShape {
                    name: name.to_string(),
                    expected: e.to_vec(),
                    found: vec![w.rows, w.cols],
                });
            }
        }
        Ok(w.clone())
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn dims(&self, name: &str) -> Option<Vec<usize>> {
        self.dims.get(name).cloned()
    }
}

/// Random weights for a DFlash drafter of `cfg`'s shape, stored as bf16 (norms f32).
pub fn random_drafter(cfg: &crate::dflash::DrafterConfig, seed: u64) -> MemorySource {
    use dflash_runtime::{HostWeight, WeightBytes};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut src = MemorySource::default();
    let mut put = |name: String,
                   rows: usize,
                   cols: usize,
                   dtype: DType,
                   rng: &mut rand::rngs::StdRng,
                   norm: bool| {
        let vals: Vec<f32> = if norm {
            (0..rows * cols)
                .map(|_| 1.0 + rng.random_range(-0.1f32..0.1))
                .collect()
        } else {
            random_matrix(rng, rows, cols, 1.0 / (cols as f32).sqrt())
        };
        let bytes = encode(dtype, &vals, cols);
        let w = HostWeight::new(
            name.clone(),
            dtype,
            rows,
            cols,
            WeightBytes::from_vec(bytes),
        )
        .expect("consistent synthetic shape");
        src.tensors.insert(name, w);
    };
    let (h, hd) = (cfg.hidden, cfg.head_dim);
    let (qd, kvd) = (cfg.heads * hd, cfg.kv_heads * hd);
    let taps = cfg.target_layer_ids.len();
    put(
        "fc.weight".into(),
        h,
        taps * h,
        DType::BF16,
        &mut rng,
        false,
    );
    put(
        "hidden_norm.weight".into(),
        1,
        h,
        DType::F32,
        &mut rng,
        true,
    );
    put("norm.weight".into(), 1, h, DType::F32, &mut rng, true);
    for i in 0..cfg.layers {
        let n = |s: &str| format!("layers.{i}.{s}");
        put(
            n("input_layernorm.weight"),
            1,
            h,
            DType::F32,
            &mut rng,
            true,
        );
        put(
            n("post_attention_layernorm.weight"),
            1,
            h,
            DType::F32,
            &mut rng,
            true,
        );
        put(
            n("self_attn.q_proj.weight"),
            qd,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("self_attn.k_proj.weight"),
            kvd,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("self_attn.v_proj.weight"),
            kvd,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("self_attn.o_proj.weight"),
            h,
            qd,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("self_attn.q_norm.weight"),
            1,
            hd,
            DType::F32,
            &mut rng,
            true,
        );
        put(
            n("self_attn.k_norm.weight"),
            1,
            hd,
            DType::F32,
            &mut rng,
            true,
        );
        put(
            n("mlp.gate_proj.weight"),
            cfg.intermediate,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("mlp.up_proj.weight"),
            cfg.intermediate,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
        put(
            n("mlp.down_proj.weight"),
            h,
            cfg.intermediate,
            DType::BF16,
            &mut rng,
            false,
        );
    }
    let mut shaped = Vec::new();
    if let Some(p) = &cfg.dflash2 {
        let (taps, groups) = (p.conv_kernel_size, h / p.conv_group_size);
        for i in 0..cfg.layers {
            for conv in ["attention_conv", "mlp_conv"] {
                let n = format!("layers.{i}.{conv}.base_kernel");
                // Near-identity static taps: 1 on the current token, small on the others.
                let vals: Vec<f32> = (0..2 * taps * h)
                    .map(|j| {
                        let tap = (j / h) % taps;
                        let noise = rng.random_range(-0.2f32..0.2);
                        if tap == 0 {
                            1.0 + noise
                        } else {
                            noise
                        }
                    })
                    .collect();
                let w = HostWeight::new(
                    n.clone(),
                    DType::F32,
                    2 * taps,
                    h,
                    WeightBytes::from_vec(encode(DType::F32, &vals, h)),
                )
                .expect("consistent synthetic shape");
                shaped.push((n, w, vec![2, taps, h]));
                put(
                    format!("layers.{i}.{conv}.kernel_projection.weight"),
                    2 * taps * groups,
                    h,
                    DType::BF16,
                    &mut rng,
                    false,
                );
            }
        }
        let r = p.selector_rank;
        for book in ["predecessor_codebook", "successor_codebook"] {
            put(
                format!("candidate_selector.{book}"),
                p.vocab_size,
                r,
                DType::BF16,
                &mut rng,
                false,
            );
        }
        put(
            "candidate_selector.hidden_projection.weight".into(),
            r,
            h,
            DType::BF16,
            &mut rng,
            false,
        );
    }
    for (n, w, dims) in shaped {
        src.dims.insert(n.clone(), dims);
        src.tensors.insert(n, w);
    }
    src
}

/// A drafter configuration matching a target's shape (for random drafters in tests).
/// Positional on purpose: test tables read as one line per shape.
#[allow(clippy::too_many_arguments)]
pub fn drafter_config_for(
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    target_layers: usize,
    draft_layers: usize,
    block_size: usize,
    mask_token_id: u32,
) -> crate::dflash::DrafterConfig {
    crate::dflash::DrafterConfig {
        block_size,
        mask_token_id,
        target_layer_ids: crate::dflash::build_target_layer_ids(target_layers, draft_layers.max(2)),
        num_target_layers: Some(target_layers),
        hidden,
        intermediate,
        layers: draft_layers,
        heads,
        kv_heads,
        head_dim: hidden / heads,
        rms_eps: 1e-6,
        rope_theta: 10000.0,
        input_embedding_scale: 1.0,
        attention: vec![crate::dflash::LayerAttention::FULL; draft_layers],
        dflash2: None,
    }
}

/// A DFlash2 drafter configuration for a target of `vocab` tokens: `base` plus two-tap
/// convolutions over groups of 16 channels (or the hidden size when smaller), a rank-16
/// selector over 8 candidates and non-causal sliding layers of window `window`.
pub fn dflash2_config_for(
    base: crate::dflash::DrafterConfig,
    vocab: usize,
    window: usize,
) -> crate::dflash::DrafterConfig {
    use crate::dflash::{Dflash2Params, LayerAttention};
    let layers = base.layers;
    crate::dflash::DrafterConfig {
        attention: vec![
            LayerAttention {
                window: Some(window),
                causal: false,
            };
            layers
        ],
        dflash2: Some(Dflash2Params {
            conv_kernel_size: 2,
            conv_group_size: 16.min(base.hidden),
            selector_rank: 16,
            selector_top_k: 8.min(vocab),
            vocab_size: vocab,
            output_multiplier: 1.0,
            final_logit_softcapping: None,
        }),
        ..base
    }
}

/// Writes a random drafter of `cfg`'s shape as a drafter directory (config.json +
/// model.safetensors in the published format).
pub fn write_drafter_dir(
    cfg: &crate::dflash::DrafterConfig,
    seed: u64,
    dir: &std::path::Path,
) -> std::io::Result<()> {
    use safetensors::tensor::{Dtype, TensorView};
    let src = random_drafter(cfg, seed);
    let mut names: Vec<&String> = src.tensors.keys().collect();
    names.sort();
    let views: Vec<(String, TensorView<'_>)> = names
        .into_iter()
        .map(|name| {
            let w = &src.tensors[name];
            let dtype = match w.dtype {
                DType::BF16 => Dtype::BF16,
                DType::F16 => Dtype::F16,
                _ => Dtype::F32,
            };
            let shape = match src.dims.get(name.as_str()) {
                Some(d) => d.clone(),
                None if w.rows == 1 => vec![w.cols],
                None => vec![w.rows, w.cols],
            };
            let view = TensorView::new(dtype, shape, w.bytes.as_slice()).expect("consistent shape");
            (name.clone(), view)
        })
        .collect();
    std::fs::create_dir_all(dir)?;
    let bytes =
        safetensors::serialize(views, None).map_err(|e| std::io::Error::other(e.to_string()))?;
    std::fs::write(dir.join("model.safetensors"), bytes)?;
    let mut config = serde_json::json!({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.target_layer_ids,
        },
        "num_target_layers": cfg.num_target_layers,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
    });
    if let Some(p) = &cfg.dflash2 {
        config["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
        config["vocab_size"] = p.vocab_size.into();
        let dc = &mut config["dflash_config"];
        dc["conv_kernel_size"] = p.conv_kernel_size.into();
        dc["conv_group_size"] = p.conv_group_size.into();
        dc["selector_rank"] = p.selector_rank.into();
        dc["selector_top_k"] = p.selector_top_k.into();
        let window = cfg.attention.iter().find_map(|a| a.window);
        config["layer_types"] = cfg
            .attention
            .iter()
            .map(|a| {
                if a.window.is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            })
            .collect();
        config["sliding_window"] = window.into();
        config["is_causal"] = cfg.attention.iter().any(|a| a.causal).into();
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::gguf::GgufFile;

    #[test]
    fn head_dtype_stores_the_embedding_and_head_apart_from_the_layers() {
        let dir = tempfile::tempdir().unwrap();
        for tied in [true, false] {
            let spec = SyntheticSpec {
                dtype: DType::Q4_1,
                head_dtype: Some(DType::Q8_0),
                tied_embeddings: tied,
                ..SyntheticSpec::tiny()
            };
            let path = dir.path().join(format!("tiny_{tied}.gguf"));
            write_synthetic(&spec, &path).unwrap();
            let g = GgufFile::open(&path).unwrap();
            let ty = |name: &str| g.tensors[name].ggml_type;
            assert_eq!(ty("token_embd.weight"), DType::Q8_0.ggml_id());
            assert_eq!(ty("blk.0.attn_q.weight"), DType::Q4_1.ggml_id());
            assert_eq!(ty("blk.3.ffn_down.weight"), DType::Q4_1.ggml_id());
            assert_eq!(g.tensors.contains_key("output.weight"), !tied);
            if !tied {
                assert_eq!(ty("output.weight"), DType::Q8_0.ggml_id());
            }
        }
    }
}
