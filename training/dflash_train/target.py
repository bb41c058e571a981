"""Frozen target model helpers (torch + transformers).

Loads a Llama-family target from an HF directory or a GGUF file (transformers
de-quantizes GGUF through the ``gguf`` package), builds chat-template prompts,
and captures tapped layer outputs.

Tapped feature of layer ``l`` = output of decoder layer ``l`` (the residual
stream after that layer, before the final norm) = HF ``hidden_states[l+1]``.
We capture it with forward hooks on the decoder layers (no need to keep all
hidden states) and stop the forward after the deepest tapped layer.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import torch

CHATML_FALLBACK = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def resolve_target(path: str, gguf_file: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """(directory, gguf file name or None).  ``path`` may be a .gguf file."""
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return path, gguf_file


def load_tokenizer(path: str, gguf_file: Optional[str] = None):
    from transformers import AutoTokenizer

    d, g = resolve_target(path, gguf_file)
    kw = {"gguf_file": g} if g else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_FALLBACK
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_target(path: str, gguf_file: Optional[str] = None, dtype: str = "bfloat16",
                device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    d, g = resolve_target(path, gguf_file)
    kw = {"gguf_file": g} if g else {}
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch_dtype(dtype), **kw)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def target_hf_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def eos_token_ids(model, tok) -> List[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), target_hf_config(model)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    vocab = tok.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if name in vocab:
            ids.add(int(vocab[name]))
    return sorted(ids)


def chat_prompt_ids(tok, messages: Sequence[dict]) -> List[int]:
    """Token ids of the chat-templated prompt ending with the assistant header."""
    text = tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def decoder_layers(model) -> torch.nn.ModuleList:
    for path in ("model.layers", "model.model.layers", "model.language_model.layers",
                 "language_model.model.layers"):
        obj = model
        ok = True
        for p in path.split("."):
            if not hasattr(obj, p):
                ok = False
                break
            obj = getattr(obj, p)
        if ok and isinstance(obj, torch.nn.ModuleList):
            return obj
    raise AttributeError("cannot find the decoder layers of the target model")


def base_model(model):
    """The decoder stack without the lm_head (LlamaModel for LlamaForCausalLM)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def embedding_weight(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def lm_head_weight(model) -> torch.Tensor:
    return model.get_output_embeddings().weight


class _StopForward(Exception):
    pass


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    layer_ids: Sequence[int], early_exit: bool = True, return_final: bool = False):
    """[b, S, K*H]: concat of the tapped layer outputs in ``layer_ids`` order.  With
    ``return_final`` the whole stack runs and ``(features, final normed hidden [b, S, H])``
    is returned (the lm_head input: the target's next-token distribution at every position)."""
    if return_final:
        early_exit = False
    layers = decoder_layers(model)
    got: Dict[int, torch.Tensor] = {}
    last = max(layer_ids)
    handles = []

    def make_hook(idx):
        def hook(_mod, _inp, out):
            h = out[0] if isinstance(out, (tuple, list)) else out
            got[idx] = h
            if early_exit and idx == last:
                raise _StopForward()
        return hook

    for l in sorted(set(layer_ids)):
        handles.append(layers[l].register_forward_hook(make_hook(l)))
    final = None
    try:
        out = base_model(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        final = out.last_hidden_state
    except _StopForward:
        pass
    finally:
        for h in handles:
            h.remove()
    feats = torch.cat([got[l] for l in layer_ids], dim=-1)
    return (feats, final) if return_final else feats


# Preferred mask tokens, in order: a real <|MASK|>-like token if the vocab has one,
# else a reserved / never-used-in-chat control token.  For SmolLM2 the choice is
# "<empty_output>" (id 16): a control token of its code-pretraining format (Jupyter
# notebooks with no output), never produced or seen in chat text.
MASK_TOKEN_PREFERENCE = (
    "<|MASK|>", "<|mask|>", "<mask>", "[MASK]",
    "<empty_output>",
    "<|reserved_special_token_0|>", "<|reserved_special_token_2|>",
    "<|fim_pad|>",
)


def pick_mask_token_id(tok, vocab_rows: int) -> tuple:
    """(id, text) of the mask token: first of MASK_TOKEN_PREFERENCE present in the
    vocab (and < the embedding rows); else the highest-id added special token that
    is not bos/eos/pad/unk and not part of the chat template."""
    vocab = tok.get_vocab()
    for name in MASK_TOKEN_PREFERENCE:
        if name in vocab and vocab[name] < vocab_rows:
            return int(vocab[name]), name
    avoid = {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id}
    tmpl = str(getattr(tok, "chat_template", "") or "")
    cands = []
    for name, i in vocab.items():
        if i in avoid or i >= vocab_rows or name in tmpl:
            continue
        if name.startswith("<") and name.endswith(">") and len(name) > 2:
            cands.append((i, name))
    added = set(getattr(tok, "added_tokens_encoder", {}) or {})
    special = [c for c in cands if c[1] in added] or cands
    if not special:
        raise ValueError("no mask token candidate found; pass --mask-token-id")
    i, name = max(special)
    return int(i), name
