#!/usr/bin/env python3
"""Produce golden reference fixtures for dflash-rs from Hugging Face transformers.

The reference implementation is transformers' own PyTorch Llama code, loading the
*same* GGUF file our engine loads (transformers de-quantizes every tensor to
float32 through the `gguf` Python package, then runs its eager float32 Llama
forward on CPU). Nothing from dflash-rs is used, so the fixture is an independent
oracle for:

  * tokenizer_cases       text -> ids (+ decode) for ~45 tricky strings
  * chat_template_cases   messages -> rendered prompt string (+ ids)
  * generation_cases      prompt ids -> 32 greedy tokens and top-5 logits at
                          selected decode steps

Tokenizer note (important): transformers' GGUF tokenizer converter builds a plain
ByteLevel(use_regex=True) pre-tokenizer and ignores `tokenizer.ggml.pre = smollm`.
The original SmolLM2 tokenizer.json and llama.cpp's "smollm" pre-tokenizer both
split every numeric character (\\p{N}) into its own piece *before* the GPT-2
regex. The two disagree e.g. on "a  1" (runs of whitespace before a digit) or
"x\\n 5". `ids` in the fixture therefore comes from the transformers tokenizer
with its pre-tokenizer restored to Sequence[Digits(individual_digits=True),
ByteLevel] (the original SmolLM2 configuration). The unpatched converter output is
kept alongside as `ids_gguf_converter`, and every case is also cross-checked
against a small pure-Python re-implementation of the llama.cpp algorithm
(`_ref_bpe_encode`), which must agree with `ids`.

Greedy decoding is done by hand: one prefill forward over the prompt, then one
forward per token with the model's DynamicCache (no EOS stopping, so exactly
`--steps` tokens are produced even past <|im_end|>). "Step s" means the logits
that predict greedy_ids[s], i.e. computed from prompt_ids + greedy_ids[:s].
Step 0 is the last prompt position. Each case is additionally re-run as one
cache-free forward over prompt + greedy_ids[:-1]; the max |diff| between the two
paths is recorded in `check`.

Usage:
    python3 tools/make_golden_fixtures.py \\
        --model /work/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out crates/models/tests/fixtures/smollm2_q4_1_golden.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib.metadata as _md
import json
import os
import platform
import shlex
import sys

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = "/work/models/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(
    REPO_ROOT, "crates", "models", "tests", "fixtures", "smollm2_q4_1_golden.json"
)

GEN_STEPS = 32
TOP_LOGIT_STEPS = [0, 1, 8, 16, 31]
TOP_K = 5

# --------------------------------------------------------------------------
# Test inputs
# --------------------------------------------------------------------------

TOKENIZER_TEXTS = [
    # plain English
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Hello",
    " Hello",
    # whitespace handling
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple   internal    spaces",
    "   ",
    " ",
    "line one\nline two\n",
    "\n\nparagraph break\n\n\nthree newlines",
    "tab\tseparated\tvalues",
    "mixed \t\n whitespace \r\n windows",
    # digits (SmolLM2 splits every digit)
    "12345",
    "The year 2024 had 366 days.",
    "pi is 3.14159265358979 and e is 2.71828",
    "a  1",
    "x\n 5",
    "version 1.2.3   42",
    "9876543210123456789",
    "$1,000,000.00 or 1e-9",
    # punctuation & contractions
    "Wait... what?! (Really) [yes] {no} <maybe>",
    "It's John's book; they're here, we've gone, I'm sure, you'll see, he'd know.",
    "IT'S LOUD, THEY'RE LOUD",
    "don't can't won't",
    "email@example.com https://example.org/path?q=1&r=2#frag",
    "---===***###",
    # code
    'def add(a, b):\n    """Add two numbers."""\n    return a + b\n',
    'fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!("{:?}", v);\n}\n',
    '{"name": "dflash", "layers": 30, "tied": true, "eps": 1e-05, "list": [1, 2, 3]}',
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    # unicode
    "café naïve résumé Zürich façade",
    "日本語のテキストです。中文文本。한국어 텍스트",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷🇯🇵",
    "family: 👨\u200d👩\u200d👧\u200d👦 (ZWJ sequence)",
    "مرحبا بالعالم، كيف حالك؟",
    "e\u0301 vs \u00e9 (combining acute vs precomposed)",
    "Ελληνικά και русский текст",
    "zero\u200bwidth\u200bspace and non\u00a0breaking",
    "math: ∑ x² ≤ ∞, ½ + ¾ = 1¼",
    # special tokens written inside text
    "<|im_start|>user\nHi<|im_end|>\n",
    "text before<|im_end|>text after",
    "<|endoftext|>",
    "not special: <|im_start |> <im_start>",
    # empty
    "",
]

CHAT_TEMPLATE_CASES = [
    {"name": "single_user", "messages": [{"role": "user", "content": "Hello!"}]},
    {
        "name": "system_user",
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "user", "content": "Give me a number."},
            {"role": "assistant", "content": "42"},
            {"role": "user", "content": "Now double it."},
        ],
    },
    {
        "name": "unicode_content",
        "messages": [
            {"role": "user", "content": "Traduis « bonjour » en japonais 🇯🇵 — こんにちは?"},
        ],
    },
    {
        "name": "system_multi_turn_whitespace",
        "messages": [
            {"role": "system", "content": "  Indented system prompt.\n"},
            {"role": "user", "content": "Line one\nLine two"},
            {"role": "assistant", "content": "Understood.\n\n"},
            {"role": "user", "content": "\tTabbed?"},
        ],
    },
    {"name": "empty_user", "messages": [{"role": "user", "content": ""}]},
]

LONG_PARAGRAPH = (
    "The history of computing is a story of abstraction layered upon abstraction. "
    "In the earliest days, programmers wired plugboards by hand and toggled switches "
    "on front panels to enter binary instructions one word at a time. The invention of "
    "assembly language let them write mnemonic names instead of raw numbers, and the "
    "first compilers, which appeared in the 1950s, translated algebraic formulas into "
    "machine code automatically. Each new layer hid details that had previously demanded "
    "careful attention, freeing people to think about larger problems. Operating systems "
    "took over the management of memory, files, and devices; high-level languages such "
    "as Fortran, Lisp, and C made programs portable across machines; and networks tied "
    "individual computers together into systems that spanned buildings, then cities, "
    "then the whole planet. By the end of the twentieth century, a student with a "
    "personal computer could write software that would have required a team of engineers "
    "and a room full of equipment only a few decades earlier. Yet every abstraction has a "
    "cost. Layers add overhead, and when something goes wrong deep inside the stack, the "
    "engineer must peel them back one by one to find the cause. Performance engineering "
    "in particular often means understanding exactly what the hardware is doing: how "
    "caches are organized, how instructions are scheduled, and how data moves between "
    "memory and the processor. Modern machine learning systems are a vivid example. A "
    "researcher may describe a neural network in a few lines of Python, but executing it "
    "efficiently requires kernels tuned for specific accelerators, careful choices about "
    "numerical precision, and clever strategies for batching requests and reusing "
    "intermediate results. Quantization, for instance, stores weights in four or eight "
    "bits instead of thirty-two, trading a small loss of accuracy for large savings in "
    "memory bandwidth. Speculative decoding uses a small draft model to propose several "
    "tokens at once, which a larger model then verifies in parallel, so that the expensive "
    "model runs fewer sequential steps. Techniques like these show that the boundary "
    "between algorithm and implementation is never entirely fixed. The people who build "
    "fast systems must move fluidly between the two, keeping the high-level goal in mind "
    "while attending to the smallest details of how bits flow through silicon. In the "
    "end, the most important"
)

GENERATION_CASES = [
    {"name": "chat_greeting", "chat": True,
     "messages": [{"role": "user", "content": "Hello! How are you today?"}]},
    {"name": "chat_explain", "chat": True,
     "messages": [{"role": "user", "content": "Explain why the sky is blue."}]},
    {"name": "chat_code", "chat": True,
     "messages": [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]},
    {"name": "chat_multilingual", "chat": True,
     "messages": [{"role": "user", "content": "Translate \"thank you\" into French, Spanish and Japanese (ありがとう). 🙏"}]},
    {"name": "chat_math", "chat": True,
     "messages": [{"role": "user", "content": "What is 12 + 35? Answer with the number."}]},
    {"name": "chat_system_multi_turn", "chat": True,
     "messages": [
         {"role": "system", "content": "You are a helpful assistant who answers briefly."},
         {"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."},
         {"role": "user", "content": "And of Germany?"},
     ]},
    {"name": "raw_code_prefix", "chat": False,
     "text": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "raw_long_paragraph", "chat": False, "text": LONG_PARAGRAPH},
    {"name": "raw_list_continuation", "chat": False,
     "text": "Here is a list of common fruits:\n1. Apple\n2. Banana\n3. Cherry\n4."},
    {"name": "raw_single_token", "chat": False, "text": "The"},
]


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------

def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pkg_version(name: str) -> str | None:
    try:
        return _md.version(name)
    except _md.PackageNotFoundError:
        return None


def read_gguf_kv(path: str) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(path)
    out = {}
    for key in (
        "general.architecture", "general.name", "general.file_type",
        "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id", "tokenizer.chat_template",
    ):
        f = r.fields.get(key)
        out[key] = None if f is None else f.contents()
    out["_tokens"] = r.fields["tokenizer.ggml.tokens"].contents()
    out["_merges"] = r.fields["tokenizer.ggml.merges"].contents()
    out["_token_type"] = r.fields["tokenizer.ggml.token_type"].contents()
    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    out["_tensor_types"] = types
    out["_token_embd_type"] = next(
        t.tensor_type.name for t in r.tensors if t.name == "token_embd.weight"
    )
    out["_has_output_weight"] = any(t.name == "output.weight" for t in r.tensors)
    return out


# ---- pure-Python reference of llama.cpp's "smollm" BPE (cross-check only) ----

def _bytes_to_unicode() -> dict[int, str]:
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class RefBpe:
    """Digits split -> GPT-2 regex -> byte-level BPE by merge rank; special
    (control) tokens matched verbatim first, longest first."""

    GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, tokens, merges, token_type):
        import regex

        self.re = regex
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.b2u = _bytes_to_unicode()
        # token_type 3 == CONTROL in GGUF
        self.specials = sorted((t for t, ty in zip(tokens, token_type) if ty == 3),
                               key=len, reverse=True)
        self.pat = regex.compile(self.GPT2_PAT)

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        return parts

    def _encode_plain(self, text: str) -> list[int]:
        ids = []
        # Digits(individual_digits=True): every \p{N} char is its own piece
        pieces = [p for p in self.re.split(r"(\p{N})", text) if p]
        for piece in pieces:
            for m in self.pat.findall(piece):
                word = "".join(self.b2u[b] for b in m.encode("utf-8"))
                ids.extend(self.vocab[p] for p in self._bpe(word))
        return ids

    def encode(self, text: str) -> list[int]:
        ids = []
        i = 0
        start = 0
        while i < len(text):
            hit = next((s for s in self.specials if text.startswith(s, i)), None)
            if hit is not None:
                ids.extend(self._encode_plain(text[start:i]))
                ids.append(self.vocab[hit])
                i += len(hit)
                start = i
            else:
                i += 1
        ids.extend(self._encode_plain(text[start:]))
        return ids


def topk_entry(step: int, logits: torch.Tensor) -> dict:
    logits = logits.float()
    vals, idx = torch.topk(logits, TOP_K)
    vals = vals.tolist()
    return {
        "step": step,
        "top_ids": [int(i) for i in idx.tolist()],
        "top_logits": [float(np.float32(v)) for v in vals],
        "margin_top1_top2": float(np.float32(vals[0] - vals[1])),
    }


@torch.inference_mode()
def greedy_decode(model, prompt_ids: list[int], steps: int):
    """Manual greedy loop with KV cache. Returns (greedy_ids, per-step logits)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    inp = torch.tensor([prompt_ids], dtype=torch.long)
    out = model(input_ids=inp, past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    step_logits = [out.logits[0, -1].clone()]
    greedy = []
    for s in range(steps):
        nxt = int(torch.argmax(step_logits[-1]).item())
        greedy.append(nxt)
        if s == steps - 1:
            break
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long),
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        step_logits.append(out.logits[0, -1].clone())
    return greedy, step_logits


@torch.inference_mode()
def full_forward_logits(model, prompt_ids: list[int], greedy: list[int]):
    ids = prompt_ids + greedy[:-1]
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    n = len(prompt_ids)
    return out.logits[0, n - 1:]  # row s predicts greedy[s]


# --------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="path to the .gguf file")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output JSON path")
    ap.add_argument("--steps", type=int, default=GEN_STEPS, help="greedy tokens per case")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float32)

    import transformers
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = os.path.abspath(args.model)
    model_dir, model_file = os.path.split(model_path)
    print(f"[golden] hashing {model_path}", flush=True)
    sha = sha256_file(model_path)
    kv = read_gguf_kv(model_path)

    # ---------------- tokenizers ----------------
    tok_conv = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_file)
    conv_pre = json.loads(tok_conv.backend_tokenizer.to_str())["pre_tokenizer"]
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    fixed_pre = json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]
    ref = RefBpe(kv["_tokens"], kv["_merges"], kv["_token_type"])

    def encode(t: str) -> list[int]:
        return list(tok(t, add_special_tokens=False)["input_ids"])

    # does add_special_tokens=True add anything (BOS)?
    bos_probe = {
        "text": "Hello world",
        "ids_add_special_tokens_true": list(tok("Hello world", add_special_tokens=True)["input_ids"]),
        "ids_add_special_tokens_false": encode("Hello world"),
    }

    tokenizer_cases = []
    n_conv_diff = 0
    for text in TOKENIZER_TEXTS:
        ids = encode(text)
        ids_conv = list(tok_conv(text, add_special_tokens=False)["input_ids"])
        ids_ref = ref.encode(text)
        if ids != ids_ref:
            raise SystemExit(f"reference BPE disagrees on {text!r}: hf={ids} ref={ids_ref}")
        decoded = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        case = {
            "text": text,
            "ids": ids,
            "decoded": decoded,
            "tokens": tok.convert_ids_to_tokens(ids),
            "roundtrip": decoded == text,
            "ids_gguf_converter": ids_conv,
            "gguf_converter_agrees": ids_conv == ids,
        }
        n_conv_diff += ids_conv != ids
        tokenizer_cases.append(case)
        flag = "" if ids_conv == ids else "   <-- converter differs " + str(ids_conv)
        print(f"[tok] {text[:40]!r:45} {len(ids):3d} ids{flag}")

    # ---------------- chat template ----------------
    gguf_template = kv["tokenizer.chat_template"]
    if tok.chat_template != gguf_template:
        raise SystemExit("tokenizer.chat_template differs from the GGUF metadata string")
    chat_cases = []
    for c in CHAT_TEMPLATE_CASES:
        rendered = tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
        chat_cases.append({
            "name": c["name"],
            "messages": c["messages"],
            "add_generation_prompt": True,
            "rendered": rendered,
            "rendered_ids": encode(rendered),
        })

    # ---------------- model ----------------
    print("[golden] loading model (de-quantizing GGUF to float32)", flush=True)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=model_file, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    for p in model.parameters():
        assert p.dtype == torch.float32
    tied = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    gen_cases = []
    all_margins = []
    max_path_diff = 0.0
    for c in GENERATION_CASES:
        if c["chat"]:
            prompt_text = tok.apply_chat_template(c["messages"], tokenize=False,
                                                  add_generation_prompt=True)
        else:
            prompt_text = c["text"]
        prompt_ids = encode(prompt_text)
        assert prompt_ids == ref.encode(prompt_text)
        greedy, step_logits = greedy_decode(model, prompt_ids, args.steps)
        full = full_forward_logits(model, prompt_ids, greedy)
        stacked = torch.stack(step_logits)
        path_diff = float((stacked - full).abs().max())
        argmax_agree = bool((full.argmax(-1) == torch.tensor(greedy)).all())
        max_path_diff = max(max_path_diff, path_diff)
        margins = []
        for s in range(args.steps):
            v = torch.topk(step_logits[s], 2).values
            margins.append(float(np.float32(v[0] - v[1])))
        all_margins.extend(margins)
        top = [topk_entry(s, step_logits[s]) for s in TOP_LOGIT_STEPS if s < args.steps]
        entry = {"name": c["name"], "chat": c["chat"]}
        if c["chat"]:
            entry["messages"] = c["messages"]
            entry["add_generation_prompt"] = True
        else:
            entry["text"] = c["text"]
        greedy_text = tok.decode(greedy, skip_special_tokens=False)
        entry.update({
            "prompt_text": prompt_text,
            "prompt_ids": prompt_ids,
            "n_prompt": len(prompt_ids),
            "greedy_ids": greedy,
            "greedy_text": greedy_text,
            "top_logits": top,
            "margin_top1_top2_all_steps": margins,
            "check": {
                "max_abs_diff_cached_vs_full_forward": path_diff,
                "full_forward_argmax_matches_greedy": argmax_agree,
            },
        })
        gen_cases.append(entry)
        print(f"\n[gen] {c['name']} (prompt {len(prompt_ids)} tok, min margin "
              f"{min(margins):.4f}, cache/full diff {path_diff:.2e})\n{greedy_text!r}", flush=True)

    recorded_margins = [t["margin_top1_top2"] for g in gen_cases for t in g["top_logits"]]

    cmd = "python3 " + " ".join(shlex.quote(a) for a in
                                [os.path.relpath(os.path.abspath(sys.argv[0]), REPO_ROOT)]
                                + sys.argv[1:])
    fixture = {
        "meta": {
            "description": "Golden reference fixtures for dflash-rs, produced by "
                           "tools/make_golden_fixtures.py with Hugging Face transformers "
                           "(PyTorch, CPU, float32) reading the GGUF directly.",
            "generator": "tools/make_golden_fixtures.py",
            "command": cmd,
            "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "gguf": pkg_version("gguf"),
                "tokenizers": pkg_version("tokenizers"),
                "numpy": np.__version__,
            },
            "model_file": model_file,
            "model_sha256": sha,
            "model_bytes": os.path.getsize(model_path),
            "gguf": {
                "general.name": kv["general.name"],
                "general.architecture": kv["general.architecture"],
                "tensor_types": kv["_tensor_types"],
                "token_embd_type": kv["_token_embd_type"],
                "has_output_weight": kv["_has_output_weight"],
                "tokenizer.ggml.model": kv["tokenizer.ggml.model"],
                "tokenizer.ggml.pre": kv["tokenizer.ggml.pre"],
                "tokenizer.ggml.add_bos_token": kv["tokenizer.ggml.add_bos_token"],
                "tokenizer.ggml.add_space_prefix": kv["tokenizer.ggml.add_space_prefix"],
                "bos_token_id": kv["tokenizer.ggml.bos_token_id"],
                "eos_token_id": kv["tokenizer.ggml.eos_token_id"],
                "unk_token_id": kv["tokenizer.ggml.unknown_token_id"],
                "pad_token_id": kv["tokenizer.ggml.padding_token_id"],
            },
            "dtype": "float32",
            "device": "cpu",
            "torch_threads": args.threads,
            "seed": 0,
            "attn_implementation": "eager",
            "lm_head_tied_to_token_embd": tied,
            "config": {k: getattr(model.config, k) for k in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings")} | {
                "rope_theta": (getattr(model.config, "rope_parameters", None) or {}).get(
                    "rope_theta", getattr(model.config, "rope_theta", None))},
            "special_tokens": {
                "bos": [tok.bos_token, tok.bos_token_id],
                "eos": [tok.eos_token, tok.eos_token_id],
                "unk": [tok.unk_token, tok.unk_token_id],
                "pad": [tok.pad_token, tok.pad_token_id],
            },
        },
        "tokenizer_notes": {
            "ids_source": "transformers tokenizer loaded from the GGUF, encode(text, "
                          "add_special_tokens=False), with the pre-tokenizer restored to the "
                          "original SmolLM2 / llama.cpp 'smollm' behaviour (see below). Special "
                          "(control) tokens written in the text, e.g. <|im_start|>, are matched "
                          "verbatim and become single ids. Cross-checked against an in-script "
                          "pure-Python BPE (digit split + GPT-2 regex + merge ranks).",
            "gguf_converter_pre_tokenizer": conv_pre,
            "pre_tokenizer_used": fixed_pre,
            "gguf_converter_disagreements": n_conv_diff,
            "bos_probe": bos_probe,
            "decoded": "tokenizer.decode(ids, skip_special_tokens=False, "
                       "clean_up_tokenization_spaces=False)",
        },
        "tokenizer_cases": tokenizer_cases,
        "chat_template": gguf_template,
        "chat_template_cases": chat_cases,
        "generation": {
            "method": "manual greedy loop: prefill forward over prompt_ids, then one "
                      "forward per token with transformers DynamicCache; argmax over "
                      "float32 logits (ties -> lowest id, torch.argmax); no EOS stopping, "
                      "exactly `steps` tokens even past <|im_end|>; no BOS is prepended "
                      "(add_bos_token=false).",
            "steps": args.steps,
            "top_logit_steps": TOP_LOGIT_STEPS,
            "top_k": TOP_K,
            "step_definition": "step s = logits predicting greedy_ids[s], computed from "
                               "prompt_ids + greedy_ids[:s]; step 0 = last prompt position",
            "min_margin_recorded_positions": min(recorded_margins),
            "min_margin_all_steps": min(all_margins),
            "max_abs_diff_cached_vs_full_forward": max_path_diff,
        },
        "generation_cases": gen_cases,
    }

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    size = os.path.getsize(args.out)
    print(f"\n[golden] wrote {args.out} ({size / 1024:.1f} KiB)")
    print(f"[golden] min top1-top2 margin: recorded positions {min(recorded_margins):.5f}, "
          f"all steps {min(all_margins):.5f}; max cached-vs-full diff {max_path_diff:.2e}; "
          f"converter disagreements {n_conv_diff}/{len(tokenizer_cases)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
