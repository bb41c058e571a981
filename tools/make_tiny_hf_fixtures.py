#!/usr/bin/env python3
"""Build tiny random Hugging Face model directories + golden outputs for dflash-rs.

Three Llama-family architectures are covered, each saved as a plain HF directory
(config.json, safetensors weights, tokenizer.json, tokenizer_config.json,
generation_config.json) plus an `expected.json` with golden float32 outputs:

  tiny_qwen3/   Qwen3ForCausalLM  - q/k RMSNorm, tied embeddings, bfloat16 weights,
                                    config in transformers-5 form (`rope_parameters`)
  tiny_qwen2/   Qwen2ForCausalLM  - q/k/v bias, untied lm_head, float32 weights,
                                    SHARDED (model.safetensors.index.json), legacy
                                    config form (top-level `rope_theta`, `rope_scaling: null`),
                                    `sliding_window: 8` present but `use_sliding_window: false`
                                    (must be ignored), generation_config eos_token_id is a list
  tiny_llama3/  LlamaForCausalLM  - Llama-3 rope scaling, untied lm_head, float16 weights,
                                    legacy config form (top-level `rope_theta` +
                                    `rope_scaling: {rope_type: llama3, ...}`), rms_norm_eps 1e-5

All three share one small byte-level BPE tokenizer trained here with the
`tokenizers` library (256 byte tokens + learned merges, then the special tokens
<|endoftext|>, <|im_start|>, <|im_end|> appended at the end of the vocab) and a
ChatML chat template in tokenizer_config.json.

Weights are random but deliberately non-degenerate: embeddings ~N(0,1), every
linear weight ~N(0, 1/fan_in) (so attention and MLP contribute O(1) to the
residual stream and attention is far from uniform), every RMSNorm weight
(including q_norm/k_norm) is 1 + 0.1*N(0,1), Qwen2 q/k/v biases ~N(0, 0.2^2).

Golden outputs are computed in float32 from the *saved* files (reloaded with
AutoModelForCausalLM.from_pretrained(dir, dtype=float32, attn_implementation="eager"),
i.e. bf16/f16 weights upcast). Greedy decoding is a hand-written loop: one prefill
forward, then one forward per token with DynamicCache, argmax, no EOS stopping.
"Step s" means the logits that predict greedy_ids[s], computed from
input_ids + greedy_ids[:s]; step 0 is the last prompt position.

Usage:
    python3 tools/make_tiny_hf_fixtures.py [--out-dir crates/models/tests/fixtures]
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as _md
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT_DIR = os.path.join(REPO_ROOT, "crates", "models", "tests", "fixtures")

SEED = 20240611
N_STEPS = 16
TOP_K = 5
TOP_STEPS = [0, 5, 15]
MIN_MARGIN = 0.1  # refuse fixtures whose greedy argmax is this close to a tie

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
N_MERGES = 40

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Fixed English text the BPE merges are learned from.
TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox
runs into the forest. There is a small house at the end of the road, where the old
man and the young woman live together. They read books, they write letters, and they
talk about the weather. In the morning the sun is warm; in the evening the wind is
cold. The children play in the garden with the cat and the dog. Hello, world! This is
a test of the tokenizer, and there are the numbers 1, 2, 3, 42 and 2024 in the text.
"""

# Prompt: merged words, a double space, digits, punctuation, a newline and a
# non-ASCII character (multi-byte UTF-8 -> several byte-level tokens).
PROMPT = "Hello world! The quick dog sat in the  garden, café 42.\nThey"


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "tokenizers", "safetensors", "numpy"):
        try:
            out[pkg] = _md.version(pkg)
        except _md.PackageNotFoundError:
            out[pkg] = None
    return out


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    assert len(alphabet) == 256
    trainer = trainers.BpeTrainer(
        vocab_size=256 + N_MERGES,
        min_frequency=2,
        initial_alphabet=alphabet,
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator([TRAIN_TEXT], trainer=trainer)
    assert tok.get_vocab_size() == 256 + N_MERGES, tok.get_vocab_size()
    # Specials go at the END of the vocab (Qwen layout; SmolLM puts them first).
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_tokenizer_files(tok, d: str) -> dict:
    tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    cfg = {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t in SPECIAL_TOKENS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 512,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return ids


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def make_config(kind: str, vocab: int, special_ids: dict):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    eos = special_ids["<|im_end|>"]
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
    )
    if kind == "qwen3":
        return Qwen3Config(
            **common,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=True,
            max_position_embeddings=256,
        )
    if kind == "qwen2":
        return Qwen2Config(
            **common,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            tie_word_embeddings=False,
            max_position_embeddings=256,
        )
    if kind == "llama3":
        return LlamaConfig(
            **common,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            attention_bias=False,
            mlp_bias=False,
            tie_word_embeddings=False,
            max_position_embeddings=512,
        )
    raise ValueError(kind)


def model_class(kind: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    return {"qwen3": Qwen3ForCausalLM, "qwen2": Qwen2ForCausalLM, "llama3": LlamaForCausalLM}[kind]


# Per-fixture init scales and seed. The layers' output projections (o_proj,
# down_proj) get `out_gain`/sqrt(fan_in) so attention + MLP dominate the residual
# stream (otherwise the current token's own embedding dominates and a tied model
# just repeats its input token). The untied lm_head gets `lm_gain`/sqrt(hidden) so
# logits have std ~3-4. Seeds were picked with --search-seeds so that greedy
# decoding is not a single repeated token and the top1-top2 margins stay large
# (robust to f32 summation-order differences).
INIT = {
    "qwen3": dict(emb_std=0.5, out_gain=3.0, lm_gain=None, seed=37),
    "qwen2": dict(emb_std=1.0, out_gain=2.0, lm_gain=4.0, seed=9),
    "llama3": dict(emb_std=1.0, out_gain=2.0, lm_gain=4.0, seed=7),
}
SAVE_DTYPE = {"qwen3": torch.bfloat16, "qwen2": torch.float32, "llama3": torch.float16}


@torch.no_grad()
def randomize(model, gen: torch.Generator, emb_std: float, out_gain: float, lm_gain) -> None:
    """Non-degenerate random init, in sorted-name order so it is reproducible."""
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        if name.endswith("embed_tokens.weight"):
            v = emb_std * torch.randn(p.shape, generator=gen)
        elif "norm" in name:  # input/post_attention layernorm, q_norm, k_norm, final norm
            v = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".bias"):
            v = 0.2 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".weight") and p.dim() == 2:  # every Linear incl. untied lm_head
            gain = 1.0
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                gain = out_gain
            elif name == "lm_head.weight":
                gain = lm_gain
            v = gain * torch.randn(p.shape, generator=gen) / (p.shape[1] ** 0.5)
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")
        p.copy_(v.to(p.dtype))


def build_model(kind: str, cfg, seed: int):
    """Random float32 model, rounded to the save dtype and back (returns both)."""
    init = INIT[kind]
    torch.manual_seed(SEED + seed)
    gen = torch.Generator().manual_seed(SEED + 1000 * (1 + list(INIT).index(kind)) + seed)
    model = model_class(kind)(cfg).float().eval()
    randomize(model, gen, init["emb_std"], init["out_gain"], init["lm_gain"])
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model = model.to(SAVE_DTYPE[kind])
    # Float32 twin on the rounded weights. A fresh model is built rather than
    # `model.float()`: `.to(bf16)` also rounds the rotary `inv_freq` buffer, which
    # a from-disk load recomputes in float32.
    ref = model_class(kind)(cfg).float().eval()
    missing, unexpected = ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    if cfg.tie_word_embeddings:
        assert torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    return model, ref


def legacy_rope_config(d: str) -> None:
    """Rewrite config.json into the pre-transformers-5 layout real Hub checkpoints
    use: top-level `rope_theta`, and `rope_scaling` (null or a dict without
    rope_theta) instead of `rope_parameters`."""
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    rp = dict(cfg.pop("rope_parameters"))
    out = {}
    for k, v in cfg.items():
        out["torch_dtype" if k == "dtype" else k] = v
    out["rope_theta"] = rp.pop("rope_theta")
    if out["model_type"] == "qwen2":
        # Like real Qwen2.5 configs: a sliding_window value is present but
        # use_sliding_window is false, so every layer is full attention. The window
        # is smaller than the prompts here, so applying it would change the logits.
        assert out["use_sliding_window"] is False
        out.pop("layer_types")
        out["sliding_window"] = 8
        out["max_window_layers"] = 1
    out["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    out = dict(sorted(out.items()))
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


# ---------------------------------------------------------------------------
# Golden outputs
# ---------------------------------------------------------------------------


@torch.no_grad()
def greedy(model, input_ids: list[int], steps: int):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([input_ids], dtype=torch.long)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = out.logits[0, -1].float().clone()
    all_logits, toks = [], []
    for s in range(steps):
        all_logits.append(logits)
        t = int(torch.argmax(logits))
        toks.append(t)
        if s + 1 == steps:
            break
        out = model(
            input_ids=torch.tensor([[t]], dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[0, -1].float().clone()
    return toks, torch.stack(all_logits)


@torch.no_grad()
def cache_free_logits(model, input_ids: list[int], toks: list[int]) -> torch.Tensor:
    full = torch.tensor([input_ids + toks[:-1]], dtype=torch.long)
    lg = model(input_ids=full, use_cache=False).logits[0].float()
    return lg[len(input_ids) - 1 :]


def summarize(step_logits: torch.Tensor, toks: list[int], tokenizer) -> dict:
    top2 = torch.topk(step_logits, 2, dim=-1)
    margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    tops = []
    for s in TOP_STEPS:
        tk = torch.topk(step_logits[s], TOP_K)
        tops.append(
            {
                "step": s,
                "top_ids": [int(i) for i in tk.indices],
                "top_logits": [float(v) for v in tk.values],
            }
        )
    return {
        "greedy_ids": toks,
        "greedy_text": tokenizer.decode(toks, skip_special_tokens=False),
        "last_prompt_logits": [float(v) for v in step_logits[0]],
        "top_logits": tops,
        "margins_top1_top2": [float(m) for m in margins],
        "min_margin_top1_top2": float(min(margins)),
    }


def _zero_qkv_bias(m):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(".bias"):
                p.zero_()
    return m


def _unit_qk_norm(m):
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(1.0)
    return m


def _default_rope(m):
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(m.config)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
    m2 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    m2.load_state_dict(m.state_dict())
    return m2


def _apply_sliding_window(m):
    # What a loader that wrongly honoured `sliding_window: 8` would compute.
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(m.config)
    cfg.use_sliding_window = True
    cfg.sliding_window = 8
    cfg.layer_types = ["full_attention"] + ["sliding_attention"] * (cfg.num_hidden_layers - 1)
    m2 = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    m2.load_state_dict(m.state_dict())
    return m2


# Sensitivity checks: each feature a fixture pins must move the logits visibly.
ABLATIONS = {
    "qwen3": {"unit_qk_norm_weights": _unit_qk_norm},
    "qwen2": {"zero_qkv_bias": _zero_qkv_bias, "sliding_window_8_applied": _apply_sliding_window},
    "llama3": {"default_rope_no_scaling": _default_rope},
}


def build_one(kind: str, d: str, tok, special_ids: dict, versions: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    vocab = tok.get_vocab_size()
    cfg = make_config(kind, vocab, special_ids)
    cfg._attn_implementation = "eager"
    save_dtype = SAVE_DTYPE[kind]
    model, ref_model = build_model(kind, cfg, INIT[kind]["seed"])
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=(
            [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]]
            if kind == "qwen2"
            else special_ids["<|im_end|>"]
        ),
        pad_token_id=special_ids["<|endoftext|>"],
        do_sample=False,
    )

    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    shard = {"qwen2": "150KB"}.get(kind, "50GB")
    model.save_pretrained(d, max_shard_size=shard)
    write_tokenizer_files(tok, d)

    if kind in ("qwen2", "llama3"):
        legacy_rope_config(d)

    # ---- reload everything from disk, exactly as a consumer would ----
    tokenizer = AutoTokenizer.from_pretrained(d)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(m).__name__ == type(ref_model).__name__, type(m)
    assert m.config.rope_parameters == ref_model.config.rope_parameters, (
        m.config.rope_parameters,
        ref_model.config.rope_parameters,
    )
    assert m.config.tie_word_embeddings == cfg.tie_word_embeddings
    sd_a, sd_b = m.state_dict(), ref_model.state_dict()
    assert sd_a.keys() == sd_b.keys()
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k

    # ---- tokenizer cross-checks ----
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert prompt_ids == tok.encode(PROMPT, add_special_tokens=False).ids
    assert tokenizer.decode(prompt_ids) == PROMPT
    messages = [{"role": "user", "content": PROMPT}]
    chat_rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expect_render = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    assert chat_rendered == expect_render, repr(chat_rendered)
    chat_ids = tokenizer(chat_rendered, add_special_tokens=False)["input_ids"]
    assert chat_ids == tok.encode(chat_rendered, add_special_tokens=False).ids
    assert chat_ids[0] == special_ids["<|im_start|>"]
    assert chat_ids.count(special_ids["<|im_end|>"]) == 1
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token is None

    # ---- generation + cross-checks ----
    results, check = {}, {}
    for name, ids in (("prompt", prompt_ids), ("chat", chat_ids)):
        toks, step_logits = greedy(m, ids, N_STEPS)
        toks_ref, step_logits_ref = greedy(ref_model, ids, N_STEPS)
        assert toks == toks_ref
        assert torch.equal(step_logits, step_logits_ref), (
            "reloaded model differs from in-memory model",
            float((step_logits - step_logits_ref).abs().max()),
        )
        cf = cache_free_logits(m, ids, toks)
        check[f"{name}_max_abs_diff_cached_vs_cache_free"] = float((cf - step_logits).abs().max())
        assert torch.equal(cf.argmax(-1), step_logits.argmax(-1))
        assert check[f"{name}_max_abs_diff_cached_vs_cache_free"] < 1e-3
        m_sdpa = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
        toks_sdpa, lg_sdpa = greedy(m_sdpa, ids, N_STEPS)
        assert toks_sdpa == toks
        check[f"{name}_max_abs_diff_eager_vs_sdpa"] = float((lg_sdpa - step_logits).abs().max())
        # The layers must matter: logits with all decoder layers skipped should differ a lot.
        with torch.no_grad():
            h = m.model.embed_tokens(torch.tensor([ids]))
            skip = m.lm_head(m.model.norm(h))[0, -1]
        check[f"{name}_max_abs_diff_vs_layers_skipped"] = float((skip - step_logits[0]).abs().max())
        for abl_name, abl in ABLATIONS.get(kind, {}).items():
            m_abl = abl(copy.deepcopy(m))
            with torch.no_grad():
                lg_abl = m_abl(input_ids=torch.tensor([ids])).logits[0, -1].float()
            check[f"{name}_max_abs_diff_vs_{abl_name}"] = float((lg_abl - step_logits[0]).abs().max())
            assert check[f"{name}_max_abs_diff_vs_{abl_name}"] > 0.5, (kind, abl_name)
        s = summarize(step_logits, toks, tokenizer)
        assert s["min_margin_top1_top2"] > MIN_MARGIN, (kind, name, s["min_margin_top1_top2"])
        s["logit_std_last_prompt"] = float(step_logits[0].std())
        s["n_distinct_greedy_ids"] = len(set(toks))
        results[name] = s

    files = sorted(os.listdir(d)) + ["expected.json"]
    weight_files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    from safetensors import safe_open

    tensors = {}
    for wf in weight_files:
        with safe_open(os.path.join(d, wf), "pt") as f:
            for k in sorted(f.keys()):
                sl = f.get_slice(k)
                tensors[k] = {"file": wf, "dtype": sl.get_dtype(), "shape": list(sl.get_shape())}

    pins = {
        "qwen3": [
            "bf16 safetensors reading (weights stored as BF16, upcast to f32)",
            "Qwen3 per-head q_norm/k_norm RMSNorm before RoPE",
            "tie_word_embeddings=true: no lm_head.weight tensor, logits use embed_tokens",
            "config.json in transformers-5 form: rope_parameters {rope_type, rope_theta}, no top-level rope_theta",
            "HF tokenizer.json (byte-level BPE, specials at end of vocab) + tokenizer_config chat_template",
        ],
        "qwen2": [
            "sharded checkpoint via model.safetensors.index.json (weight_map)",
            "f32 safetensors reading",
            "q/k/v projection biases (o_proj has none)",
            "untied lm_head.weight",
            "legacy config.json form: top-level rope_theta, rope_scaling null, torch_dtype, no layer_types",
            "sliding_window 8 with use_sliding_window false must be IGNORED (all layers full attention)",
            "generation_config.json eos_token_id given as a list",
            "HF tokenizer.json + tokenizer_config chat_template",
        ],
        "llama3": [
            "Llama-3 rope scaling (rope_type llama3; with head_dim 16 / theta 5e5 / orig ctx 64 the 8 "
            "frequencies hit all three regimes: kept, smoothed, divided by factor)",
            "f16 safetensors reading",
            "untied lm_head.weight",
            "rms_norm_eps 1e-5 (the Qwen fixtures use 1e-6)",
            "legacy config.json form: top-level rope_theta + rope_scaling dict, torch_dtype (as on real Llama-3 Hub checkpoints)",
            "HF tokenizer.json + tokenizer_config chat_template",
        ],
    }[kind]

    with open(os.path.join(d, "config.json")) as f:
        saved_cfg = json.load(f)

    expected = {
        "description": (
            "Golden float32 outputs of transformers' eager implementation for this tiny random "
            "model, computed from the saved files (weights upcast to float32). Step s = logits "
            "that predict greedy_ids[s] from input_ids + greedy_ids[:s]; step 0 = last prompt "
            "position. Greedy = prefill then one token per forward with DynamicCache, argmax, "
            "no EOS stopping."
        ),
        "architecture": type(m).__name__,
        "model_type": saved_cfg["model_type"],
        "pins": pins,
        "versions": versions,
        "seed": SEED,
        "init": {
            **INIT[kind],
            "embed_tokens": "emb_std * N(0,1)",
            "linear_weights": "N(0,1)/sqrt(fan_in); o_proj/down_proj x out_gain; untied lm_head x lm_gain",
            "rmsnorm_weights": "1 + 0.1*N(0,1) (all, incl. q_norm/k_norm)",
            "biases": "0.2*N(0,1)",
        },
        "weights_dtype": str(save_dtype).replace("torch.", ""),
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "files": files,
        "tensors": tensors,
        "vocab_size": vocab,
        "special_token_ids": special_ids,
        # transformers 5.24 forces Qwen2Tokenizer for model_type qwen2 (it swaps in
        # Qwen's NFC + regex pre-tokenizer); the ids above were asserted equal to
        # tokenizer.json's own (tokenizers library) encoding anyway.
        "autotokenizer_class": type(tokenizer).__name__,
        "eos_token_id": special_ids["<|im_end|>"],
        "n_steps": N_STEPS,
        "top_k": TOP_K,
        "top_logit_steps": TOP_STEPS,
        "prompt": PROMPT,
        "prompt_ids": prompt_ids,
        "chat_messages": messages,
        "chat_rendered": chat_rendered,
        "chat_ids": chat_ids,
        "generation": results["prompt"],
        "chat_generation": results["chat"],
        "check": check,
    }
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")
    return expected


def verify_dir(d: str) -> None:
    """Fresh load of a written directory; must reproduce expected.json exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(d, "expected.json")) as f:
        exp = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(d)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    assert tokenizer(exp["prompt"], add_special_tokens=False)["input_ids"] == exp["prompt_ids"]
    r = tokenizer.apply_chat_template(exp["chat_messages"], tokenize=False, add_generation_prompt=True)
    assert r == exp["chat_rendered"]
    assert tokenizer(r, add_special_tokens=False)["input_ids"] == exp["chat_ids"]
    for key, ids in (("generation", exp["prompt_ids"]), ("chat_generation", exp["chat_ids"])):
        toks, lg = greedy(m, ids, exp["n_steps"])
        g = exp[key]
        assert toks == g["greedy_ids"], (d, key)
        want = np.array(g["last_prompt_logits"], dtype=np.float32)
        assert np.array_equal(lg[0].numpy(), want), (d, key, np.abs(lg[0].numpy() - want).max())
        for t in g["top_logits"]:
            tk = torch.topk(lg[t["step"]], len(t["top_ids"]))
            assert [int(i) for i in tk.indices] == t["top_ids"]
            assert np.array_equal(tk.values.numpy(), np.array(t["top_logits"], dtype=np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ap.add_argument(
        "--search-seeds",
        type=int,
        default=0,
        metavar="N",
        help="only print greedy diversity / min margins for init seeds 0..N-1 and exit",
    )
    args = ap.parse_args()

    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    versions = _versions()

    tok = build_tokenizer()
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"tokenizer: vocab {tok.get_vocab_size()}, specials {special_ids}")

    if args.search_seeds:
        chat = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
        inputs = [tok.encode(PROMPT).ids, tok.encode(chat).ids]
        for kind in INIT:
            cfg = make_config(kind, tok.get_vocab_size(), special_ids)
            cfg._attn_implementation = "eager"
            for seed in range(args.search_seeds):
                _, ref = build_model(kind, cfg, seed)
                stats = []
                for ids in inputs:
                    toks, lg = greedy(ref, ids, N_STEPS)
                    top2 = torch.topk(lg, 2, dim=-1).values
                    stats.append((len(set(toks)), round(float((top2[:, 0] - top2[:, 1]).min()), 3)))
                score = min(m for _, m in stats) if min(n for n, _ in stats) >= 5 else 0.0
                print(f"{kind} seed {seed}: (distinct, min margin) prompt {stats[0]} chat {stats[1]} score {score}")
        return

    os.makedirs(args.out_dir, exist_ok=True)
    for kind in ("qwen3", "qwen2", "llama3"):
        d = os.path.join(args.out_dir, f"tiny_{kind}")
        exp = build_one(kind, d, tok, special_ids, versions)
        verify_dir(d)
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(
            f"{kind}: {d} ({size / 1024:.0f} KiB) files={exp['files']}\n"
            f"  prompt ids {len(exp['prompt_ids'])}, chat ids {len(exp['chat_ids'])}\n"
            f"  greedy {exp['generation']['greedy_ids']}\n"
            f"  chat greedy {exp['chat_generation']['greedy_ids']}\n"
            f"  min margin prompt {exp['generation']['min_margin_top1_top2']:.4f} "
            f"chat {exp['chat_generation']['min_margin_top1_top2']:.4f}; "
            f"logit std {exp['generation']['logit_std_last_prompt']:.2f}\n"
            f"  check {exp['check']}"
        )
        assert size < 1.2 * 1024 * 1024, size


if __name__ == "__main__":
    main()
