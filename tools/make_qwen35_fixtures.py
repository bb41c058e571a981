#!/usr/bin/env python3
"""Build tiny random Qwen 3.5 hybrid models + golden outputs from transformers' `qwen3_5`.

Two HF directories and one GGUF file, each with an `expected.json` of float32 outputs of
transformers' own implementation (`Qwen3_5ForCausalLM`, eager attention, the pure-torch
Gated DeltaNet path: torch_chunk_gated_delta_rule for multi-token forwards,
torch_recurrent_gated_delta_rule for single-token decode):

  tiny_qwen35/       Qwen3_5ForCausalLM (text-only `save_pretrained` layout, keys `model.*`),
                     6 layers [L L F L L F] given as `layer_types`, GQA in attention (4 q / 2 kv
                     heads) and in the GDN layers (2 k heads, 4 v heads), tied head, bf16
                     weights with A_log and linear_attn.norm in f32 (as official checkpoints)
  tiny_qwen35_vlm/   the `Qwen3_5ForConditionalGeneration` checkpoint layout: wrapper config
                     with `text_config` + `vision_config`, keys `model.language_model.*`,
                     untied `lm_head.weight`, plus `model.visual.*` and `mtp.*` tensors the
                     loader must ignore; 4 layers from `full_attention_interval: 2`, 3 v heads
                     per k head (d_v 16); f32 weights
  tiny_qwen35.gguf   tiny_qwen35's weights (upcast to f32) written as llama.cpp's converter
                     writes `qwen35` (tensor names and metadata keys from gguf.constants; v heads
                     reordered grouped -> tiled; A = -exp(A_log); zero-centred norms stored as
                     1 + w; conv kernel squeezed) -- must give the same logits as the HF dir

Per model, on one prompt of 100 tokens (two 64-token chunks of the chunked form), in
`expected.json` (ids, checks, versions) and `expected.safetensors` (f32 logits):
  prefill_all    logits of every prompt position from one forward over the prompt
  decode         greedy decoding after the prefill, one token per forward with the cache:
                 the ids and the full logits of each step (step s predicts ids[s])
  verify         after prompt + the first VERIFY_AT greedy ids (cached), one multi-token
                 forward over a block (the next greedy ids with some replaced by other ids):
                 the block ids and every position's logits -- transformers >= 5.7 is needed
                 (multi-token forwards on a warm cache ignored the cached state before)

The shared byte-level BPE tokenizer is copied from tiny_qwen3 (made by
make_tiny_hf_fixtures.py). Weights are random but non-degenerate (see INIT below).

Usage: python3 tools/make_qwen35_fixtures.py [--out-dir crates/models/tests/fixtures]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import sys

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "crates", "models", "tests", "fixtures")
TOKENIZER_SRC = os.path.join(DEFAULT_OUT, "tiny_qwen3")

SEED = 35
PROMPT_LEN = 100
N_STEPS = 24
VERIFY_AT = 8
BLOCK = 7
WRONG_SLOTS = (3, 5)  # block slots whose greedy id is replaced by another id

TEXT = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs "
    "into the forest. There is a small house at the end of the road, where the old man lives."
)

INIT = {
    "embed_tokens": "N(0,1) rows rescaled to norm 1 (so the layers, not the input token, dominate the tied head)",
    "linear weights": "N(0,1)/sqrt(fan_in); o_proj, out_proj, down_proj x 0.5",
    "zero-centred norms (input/post/final/q/k)": "0.1*N(0,1) (scale 1 + w)",
    "linear_attn.norm": "1 + 0.1*N(0,1)",
    "conv1d": "N(0,1)*0.5",
    "A_log": "log U(0.05, 1.5)",
    "dt_bias": "0.5*N(0,1)",
    "in_proj_b": "N(0,1)/sqrt(fan_in) x 2 (beta spread over (0,1))",
}


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for p in ("torch", "transformers", "gguf", "safetensors", "numpy"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def text_config(kind: str, vocab: int, eos: int):
    from transformers import Qwen3_5TextConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_num_key_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        eos_token_id=eos,
        bos_token_id=None,
        pad_token_id=None,
    )
    if kind == "text":
        return Qwen3_5TextConfig(
            **common,
            num_hidden_layers=6,
            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
            linear_num_value_heads=4,
            linear_value_head_dim=8,
            tie_word_embeddings=True,
        )
    return Qwen3_5TextConfig(
        **common,
        num_hidden_layers=4,
        full_attention_interval=2,
        linear_num_value_heads=6,
        linear_value_head_dim=16,
        tie_word_embeddings=False,
    )


def build(cfg, seed: int):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    m = Qwen3_5ForCausalLM(cfg).eval().float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("embed_tokens.weight"):
                # Rows of one norm: with a tied head, rows of random norms make the longest
                # row win every step.
                e = torch.randn(p.shape, generator=g)
                p.copy_(e / e.norm(dim=1, keepdim=True))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:
                w = torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5
                if any(k in name for k in ("o_proj", "out_proj", "down_proj")):
                    w *= 0.5
                if "in_proj_b" in name:
                    w *= 2
                p.copy_(w)
            else:
                raise ValueError(f"uninitialised parameter {name}")
    if cfg.tie_word_embeddings:
        assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    return m


@torch.no_grad()
def golden(m, prompt: list[int]) -> dict:
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    full = m(input_ids=ids).logits[0].float()
    # Greedy decoding with the cache: prefill, then one token per forward.
    cache = DynamicCache(config=m.config)
    out = m(input_ids=ids, past_key_values=cache, use_cache=True)
    assert torch.allclose(out.logits[0], full, atol=1e-5), "cached prefill differs"
    logits = [out.logits[0, -1].float()]
    toks = [int(logits[-1].argmax())]
    for _ in range(N_STEPS - 1):
        out = m(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
        toks.append(int(logits[-1].argmax()))
    decode = torch.stack(logits)
    # The same sequence without a cache (one forward over everything) must agree.
    seq = torch.tensor([prompt + toks[:-1]])
    cf = m(input_ids=seq).logits[0, len(prompt) - 1 :].float()
    cache_free_diff = float((cf - decode).abs().max())
    assert cache_free_diff < 1e-3, cache_free_diff

    # Verify block: prompt + toks[:VERIFY_AT] in the cache, then BLOCK tokens at once.
    cache = DynamicCache(config=m.config)
    m(input_ids=torch.tensor([prompt + toks[:VERIFY_AT]]), past_key_values=cache, use_cache=True)
    block = list(toks[VERIFY_AT : VERIFY_AT + BLOCK])
    for s in WRONG_SLOTS:
        block[s] = (block[s] + 7) % m.config.vocab_size
    vout = m(input_ids=torch.tensor([block]), past_key_values=cache, use_cache=True)
    verify = vout.logits[0].float()
    # Reference for the block: one cache-free forward over the whole sequence.
    vref = m(input_ids=torch.tensor([prompt + toks[:VERIFY_AT] + block])).logits[0, -BLOCK:]
    verify_cache_free_diff = float((vref - verify).abs().max())
    assert verify_cache_free_diff < 1e-3, verify_cache_free_diff
    top2 = torch.topk(decode, 2, dim=-1).values
    arrays = {
        "prefill_all": full.contiguous(),
        "decode_logits": decode.contiguous(),
        "verify_logits": verify.contiguous(),
    }
    return arrays, {
        "prompt_ids": prompt,
        "decode_ids": toks,
        "verify_prefix_greedy": VERIFY_AT,
        "verify_block": block,
        "check": {
            "decode_max_abs_diff_cached_vs_cache_free": cache_free_diff,
            "verify_max_abs_diff_cached_vs_cache_free": verify_cache_free_diff,
            "min_margin_top1_top2": float((top2[:, 0] - top2[:, 1]).min()),
            "n_distinct_greedy_ids": len(set(toks)),
            "logit_std_last_prompt": float(full[-1].std()),
        },
    }


def copy_tokenizer(d: str) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_SRC, f), os.path.join(d, f))


def prompt_ids(vocab: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(TOKENIZER_SRC, "tokenizer.json"))
    ids = tok.encode(TEXT * 3).ids[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN and max(ids) < vocab
    return ids


def save_text_dir(m, d: str, keep_f32: tuple[str, ...]) -> dict:
    """save_pretrained layout (keys model.*), bf16 except the f32 tensors named."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    sd = {}
    for k, v in m.state_dict().items():
        if k == "lm_head.weight" and m.config.tie_word_embeddings:
            continue
        sd[k] = v.contiguous() if k.endswith(keep_f32) else v.to(torch.bfloat16).contiguous()
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    m.config.architectures = ["Qwen3_5ForCausalLM"]
    m.config.save_pretrained(d)
    copy_tokenizer(d)
    return {k: str(v.dtype).replace("torch.", "") for k, v in sd.items()}


def save_vlm_dir(m, d: str) -> dict:
    """The Qwen3_5ForConditionalGeneration checkpoint layout around m's text weights."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(SEED + 1)
    sd = {}
    for k, v in m.state_dict().items():
        name = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        sd[name] = v.contiguous()
    h = m.config.hidden_size
    sd["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 4, 4, generator=g)
    sd["model.visual.merger.linear_fc1.weight"] = torch.randn(16, 32, generator=g)
    sd["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g)
    sd["mtp.norm.weight"] = torch.zeros(h)
    sd["mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(128, h, generator=g)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    text = m.config.to_diff_dict()
    for k in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype", "output_hidden_states", "return_dict", "use_return_dict", "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "tie_word_embeddings", "_attn_implementation_autoset"):
        text.pop(k, None)
    # The layer pattern as `full_attention_interval` only (the loader must derive it).
    assert text.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    text["full_attention_interval"] = 2
    text["attn_output_gate"] = True
    text["mamba_ssm_dtype"] = "float32"
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8, "out_hidden_size": h},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "transformers_version": versions()["transformers"],
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    copy_tokenizer(d)
    return {k: str(v.dtype).replace("torch.", "") for k, v in sd.items()}


def write_gguf(m, path: str) -> None:
    """m as llama.cpp's converter writes `qwen35` (facts: notes/qwen35_gdn.md; llama.cpp
    conversion/qwen.py: Qwen3NextModel.modify_tensors and _LinearAttentionVReorderBase)."""
    import gguf
    from tokenizers import Tokenizer

    c = m.config
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN35]
    names = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-qwen35")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_rope_dimension_sections(list(c.rope_parameters["mrope_section"]) + [0])
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    kinds = c.layer_types
    interval = [i for i, k in enumerate(kinds) if k == "full_attention"][0] + 1
    assert all((k == "full_attention") == ((i + 1) % interval == 0) for i, k in enumerate(kinds))
    w.add_full_attention_interval(interval)
    tok = json.load(open(os.path.join(TOKENIZER_SRC, "tokenizer.json")))
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    for a in tok["added_tokens"]:
        vocab[a["id"]] = a["content"]
    tokens = [vocab[i] for i in range(len(vocab))]
    specials = {a["id"] for a in tok["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([" ".join(x) if isinstance(x, list) else x for x in merges])
    t = Tokenizer.from_file(os.path.join(TOKENIZER_SRC, "tokenizer.json"))
    w.add_eos_token_id(t.token_to_id("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(json.load(open(os.path.join(TOKENIZER_SRC, "tokenizer_config.json")))["chat_template"])

    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    r = hv // hk

    def tiled(x: torch.Tensor, dim: int, head: int) -> torch.Tensor:
        """Grouped v heads (k-head major) -> tiled (v-within-group major) along dim."""
        shape = list(x.shape)
        x = x.reshape(shape[:dim] + [hk, r, head] + shape[dim + 1 :])
        return x.transpose(dim, dim + 1).contiguous().reshape(shape)

    def put(name: str, x: torch.Tensor) -> None:
        w.add_tensor(name, x.detach().float().contiguous().numpy())

    sd = {k: v.float() for k, v in m.state_dict().items()}
    put(names[T.TOKEN_EMBD] + ".weight", sd["model.embed_tokens.weight"])
    put(names[T.OUTPUT_NORM] + ".weight", sd["model.norm.weight"] + 1)
    if not c.tie_word_embeddings:
        put(names[T.OUTPUT] + ".weight", sd["lm_head.weight"])
    for i, kind in enumerate(kinds):
        p = f"model.layers.{i}."
        n = lambda t, suffix=".weight": names[t].format(bid=i) + suffix
        put(n(T.ATTN_NORM), sd[p + "input_layernorm.weight"] + 1)
        put(n(T.ATTN_POST_NORM), sd[p + "post_attention_layernorm.weight"] + 1)
        put(n(T.FFN_GATE), sd[p + "mlp.gate_proj.weight"])
        put(n(T.FFN_UP), sd[p + "mlp.up_proj.weight"])
        put(n(T.FFN_DOWN), sd[p + "mlp.down_proj.weight"])
        if kind == "full_attention":
            a = p + "self_attn."
            put(n(T.ATTN_Q), sd[a + "q_proj.weight"])
            put(n(T.ATTN_K), sd[a + "k_proj.weight"])
            put(n(T.ATTN_V), sd[a + "v_proj.weight"])
            put(n(T.ATTN_OUT), sd[a + "o_proj.weight"])
            put(n(T.ATTN_Q_NORM), sd[a + "q_norm.weight"] + 1)
            put(n(T.ATTN_K_NORM), sd[a + "k_norm.weight"] + 1)
        else:
            a = p + "linear_attn."
            qkv = sd[a + "in_proj_qkv.weight"]
            kd = hk * dk
            qkv = torch.cat([qkv[: 2 * kd], tiled(qkv[2 * kd :], 0, dv)])
            conv = sd[a + "conv1d.weight"].squeeze(1)
            conv = torch.cat([conv[: 2 * kd], tiled(conv[2 * kd :], 0, dv)])
            put(n(T.ATTN_QKV), qkv)
            put(n(T.ATTN_GATE), tiled(sd[a + "in_proj_z.weight"], 0, dv))
            put(n(T.SSM_BETA), tiled(sd[a + "in_proj_b.weight"], 0, 1))
            put(n(T.SSM_ALPHA), tiled(sd[a + "in_proj_a.weight"], 0, 1))
            put(n(T.SSM_CONV1D), conv)
            put(n(T.SSM_DT, ".bias"), tiled(sd[a + "dt_bias"].unsqueeze(-1), 0, 1).squeeze(-1))
            put(n(T.SSM_A, ""), tiled((-torch.exp(sd[a + "A_log"])).unsqueeze(-1), 0, 1).squeeze(-1))
            put(n(T.SSM_NORM), sd[a + "norm.weight"])
            put(n(T.SSM_OUT), tiled(sd[a + "out_proj.weight"], 1, dv))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_expected(d: str, arrays: dict, exp: dict) -> None:
    from safetensors.torch import save_file

    save_file(arrays, os.path.join(d, "expected.safetensors"))
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(exp, f, indent=1)
        f.write("\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=DEFAULT_OUT)
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    tok = json.load(open(os.path.join(TOKENIZER_SRC, "tokenizer.json")))
    vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    eos = {a["content"]: a["id"] for a in tok["added_tokens"]}["<|im_end|>"]
    prompt = prompt_ids(vocab)
    meta = {"versions": versions(), "seed": SEED, "init": INIT, "compute_dtype": "float32", "attn_implementation": "eager"}

    # Text-only: bf16 weights (A_log, linear_attn.norm f32); goldens from the saved weights.
    m = build(text_config("text", vocab, eos), SEED)
    d = os.path.join(args.out_dir, "tiny_qwen35")
    if os.path.isdir(d):
        shutil.rmtree(d)
    dtypes = save_text_dir(m, d, keep_f32=("A_log", "linear_attn.norm.weight"))
    from transformers import Qwen3_5ForCausalLM

    m = Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    arrays, exp = golden(m, prompt)
    exp.update(meta, architecture="Qwen3_5ForCausalLM", tensor_dtypes=dtypes, layer_types=m.config.layer_types)
    write_expected(d, arrays, exp)
    gguf_path = os.path.join(args.out_dir, "tiny_qwen35.gguf")
    write_gguf(m, gguf_path)
    print(f"tiny_qwen35: {exp['check']}; greedy {exp['decode_ids']}")

    # Multimodal-wrapper layout, f32, untied head.
    m = build(text_config("vlm", vocab, eos), SEED + 2)
    d = os.path.join(args.out_dir, "tiny_qwen35_vlm")
    if os.path.isdir(d):
        shutil.rmtree(d)
    dtypes = save_vlm_dir(m, d)
    arrays, exp = golden(m, prompt)
    exp.update(meta, architecture="Qwen3_5ForConditionalGeneration (text weights of Qwen3_5ForCausalLM)", tensor_dtypes=dtypes, layer_types=m.config.layer_types)
    write_expected(d, arrays, exp)
    print(f"tiny_qwen35_vlm: {exp['check']}; greedy {exp['decode_ids']}")
    for p in (os.path.join(args.out_dir, x) for x in ("tiny_qwen35", "tiny_qwen35_vlm", "tiny_qwen35.gguf")):
        size = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p)) if os.path.isdir(p) else os.path.getsize(p)
        print(f"{p}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
