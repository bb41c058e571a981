"""Export the drafter in the published DFlash format, and check an export.

    python -m dflash_train.export --ckpt RUN/ckpt --out RUN/export   # re-export a checkpoint
    python -m dflash_train.export --check RUN/export                 # verify names/shapes/config

``load_drafter(dir)`` reads an export (ours or a published drafter) back into a
``DFlashDrafter``.

Layout: config.json, README.md (model card), and either model.safetensors or
(when the bf16 weights exceed the shard limit, default 15 MiB so every file
stays below 16 MB) model-0000k-of-0000N.safetensors + model.safetensors.index.json
(HF sharding convention).  Tensors are bf16, named exactly as published; the
embedding and lm_head are the target's and are not stored.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Dict, List, Optional

import torch

from .config import DrafterConfig

DEFAULT_SHARD_BYTES = 15 * 1024 * 1024


def expected_tensor_shapes(cfg: DrafterConfig) -> Dict[str, List[int]]:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {
        "fc.weight": [h, cfg.num_taps * h],
        "hidden_norm.weight": [h],
        "norm.weight": [h],
    }
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        shapes.update({
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [nh * hd, h],
            p + "self_attn.k_proj.weight": [nkv * hd, h],
            p + "self_attn.v_proj.weight": [nkv * hd, h],
            p + "self_attn.o_proj.weight": [h, nh * hd],
            p + "self_attn.q_norm.weight": [hd],
            p + "self_attn.k_norm.weight": [hd],
            p + "mlp.gate_proj.weight": [i, h],
            p + "mlp.up_proj.weight": [i, h],
            p + "mlp.down_proj.weight": [h, i],
        })
        if cfg.is_dflash2:
            groups = h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + conv + ".base_kernel"] = [2, cfg.conv_kernel_size, h]
                shapes[p + conv + ".kernel_projection.weight"] = [2 * cfg.conv_kernel_size * groups, h]
    if cfg.is_dflash2:
        # The published format stores the codebooks without ".weight".
        shapes["candidate_selector.predecessor_codebook"] = [cfg.vocab_size, cfg.selector_rank]
        shapes["candidate_selector.successor_codebook"] = [cfg.vocab_size, cfg.selector_rank]
        shapes["candidate_selector.hidden_projection.weight"] = [cfg.selector_rank, h]
    return shapes


def save_sharded(tensors: Dict[str, torch.Tensor], out_dir: str, *, prefix: str = "model",
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                 metadata: Optional[Dict[str, str]] = None, write_index: bool = True) -> List[str]:
    """Save tensors as one ``{prefix}.safetensors`` or HF-style shards.  Returns file names."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    meta = {"format": "pt"}
    meta.update(metadata or {})
    items = [(k, v.detach().contiguous().cpu()) for k, v in tensors.items()]
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(nbytes(t) for _, t in items)
    if total <= max_shard_bytes:
        name = f"{prefix}.safetensors"
        save_file(dict(items), os.path.join(out_dir, name), metadata=meta)
        return [name]
    shards: List[List] = [[]]
    size = 0
    for k, t in items:
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((k, t))
        size += nbytes(t)
    n = len(shards)
    names, weight_map = [], {}
    for j, sh in enumerate(shards):
        name = f"{prefix}-{j + 1:05d}-of-{n:05d}.safetensors"
        save_file(dict(sh), os.path.join(out_dir, name), metadata=meta)
        names.append(name)
        for k, _ in sh:
            weight_map[k] = name
    if write_index:
        with open(os.path.join(out_dir, f"{prefix}.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def load_sharded(in_dir: str, prefix: str = "model") -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    single = os.path.join(in_dir, f"{prefix}.safetensors")
    if os.path.exists(single):
        return load_file(single)
    out: Dict[str, torch.Tensor] = {}
    files = sorted(f for f in os.listdir(in_dir)
                   if f.startswith(prefix + "-") and f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no {prefix}*.safetensors in {in_dir}")
    for f in files:
        out.update(load_file(os.path.join(in_dir, f)))
    return out


def load_drafter(export_dir: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """Read an exported drafter directory (config.json + model.safetensors or
    HF-style shards, published tensor names; e.g. our own export or a published
    z-lab drafter) back into a ``DFlashDrafter``.  Returns ``(drafter, cfg)``;
    the drafter is in eval mode.  Names and shapes must match exactly."""
    from .drafter import DFlashDrafter

    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = DrafterConfig.from_hf_dict(json.load(f))
    sd = load_sharded(export_dir)
    exp = expected_tensor_shapes(cfg)
    missing = sorted(set(exp) - set(sd))
    extra = sorted(set(sd) - set(exp))
    bad = sorted(k for k in exp if k in sd and list(sd[k].shape) != exp[k])
    if missing or extra or bad:
        raise ValueError(f"{export_dir}: missing {missing[:5]} extra {extra[:5]} wrong shape {bad[:5]}")
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=True)
    return drafter.to(device=device, dtype=dtype).eval(), cfg


def model_card(cfg: DrafterConfig, info: Dict) -> str:
    kind, arch = ("DFlash2", "DFlash2DraftModel") if cfg.is_dflash2 else ("DFlash", "DFlashDraftModel")
    lines = [
        f"# {kind} drafter for {info.get('target_name', 'the target model')}",
        "",
        f"Block-diffusion speculative-decoding drafter ({kind} format, `{arch}`),",
        "trained with `dflash_train` (dflash-rs repository, `training/`).",
        "",
        "| | |",
        "|---|---|",
        f"| target | `{info.get('target_name', '?')}` ({cfg.num_target_layers} layers, hidden {cfg.hidden_size}) |",
        f"| draft layers | {cfg.num_hidden_layers} |",
        f"| tapped target layers | {cfg.target_layer_ids} |",
        f"| block size | {cfg.block_size} |",
        f"| mask token id | {cfg.mask_token_id} {info.get('mask_token_text', '')} |",
        f"| data | {info.get('data', '?')} |",
        f"| training sequences | {info.get('train_sequences', '?')} |",
        f"| optimizer steps | {info.get('step', '?')} |",
        f"| train loss (last log window) | {info.get('train_loss', '?')} |",
        f"| validation loss | {info.get('val_loss', '?')} |",
        f"| teacher-forced acceptance length (val, greedy samples) | {info.get('val_tau_greedy', '?')} |",
        f"| measured acceptance length tau | {info.get('tau', 'not measured yet')} |",
        "",
        "The drafter shares the target's token embedding and lm_head (not stored here).",
        "Context features: outputs of the tapped target layers (before the final norm),",
        "concatenated -> `fc` -> `hidden_norm`, injected as extra K/V into every draft layer.",
        "Block = [last committed token, mask x (B-1)]; bidirectional inside the block;",
        "context strictly before the block start.",
    ]
    if cfg.is_dflash2:
        lines += [
            f"DFlash2: {cfg.conv_kernel_size}-tap grouped dynamic convolutions (groups of "
            f"{cfg.conv_group_size} channels) around every sublayer; a rank-{cfg.selector_rank} candidate "
            f"selector re-ranks the top {cfg.selector_top_k} tokens of each slot given the previous slot's "
            f"choice (trained with its teacher-forced cross entropy, weight {info.get('selector_alpha', 1.0)}).",
        ]
        if cfg.sliding_window is not None:
            lines.append(f"Sliding non-causal attention window: {cfg.sliding_window} positions.")
    if info.get("extra"):
        lines += ["", str(info["extra"])]
    return "\n".join(lines) + "\n"


def export_drafter(state_dict: Dict[str, torch.Tensor], cfg: DrafterConfig, out_dir: str,
                   info: Optional[Dict] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write config.json, README.md and bf16 safetensors (sharded if needed)."""
    if os.path.isdir(out_dir):
        for f in os.listdir(out_dir):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(out_dir, f))
    os.makedirs(out_dir, exist_ok=True)
    exp = expected_tensor_shapes(cfg)
    missing = set(exp) - set(state_dict)
    extra = set(state_dict) - set(exp)
    if missing or extra:
        raise ValueError(f"state dict mismatch: missing {sorted(missing)[:5]} extra {sorted(extra)[:5]}")
    tensors = {k: state_dict[k].detach().to(torch.bfloat16) for k in exp}
    names = save_sharded(tensors, out_dir, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(cfg.to_json() + "\n")
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write(model_card(cfg, info or {}))
    return names


# The target's token ids ranked by frequency, beside a drafter (`--draft-vocab N`: the
# drafter's head over the first N ids; tools/rank_draft_vocab.py). It describes the target,
# not the drafter's weights, so a drafter trained from another keeps that one's file.
DRAFT_VOCAB = "draft_vocab.safetensors"


def carry_draft_vocab(init_dir: Optional[str], out_dir: str) -> bool:
    """Copies ``init_dir``'s draft vocabulary into the export ``out_dir`` (the engine's CPU
    default drafts over its first 4,096 ids; an export without it drafts over the whole
    vocabulary, ~1.7x slower a draft on 2 CPU cores). Returns whether a file was copied."""
    src = os.path.join(init_dir, DRAFT_VOCAB) if init_dir else None
    if not src or not os.path.isfile(src):
        return False
    shutil.copyfile(src, os.path.join(out_dir, DRAFT_VOCAB))
    return True


def check_export(out_dir: str, max_file_bytes: int = 16 * 1000 * 1000) -> Dict:
    """Verify an export: config fields, tensor names/shapes/dtypes, file sizes."""
    from safetensors import safe_open

    with open(os.path.join(out_dir, "config.json")) as f:
        d = json.load(f)
    problems = []
    for k in ("architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
              "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "vocab_size", "tie_word_embeddings", "attention_bias"):
        if k not in d:
            problems.append(f"config.json lacks {k}")
    cfg = DrafterConfig.from_hf_dict(d)
    arch = "DFlash2DraftModel" if cfg.is_dflash2 else "DFlashDraftModel"
    if d.get("architectures") != [arch] or d.get("model_type") != "qwen3":
        problems.append("architectures/model_type wrong")
    keys = ["mask_token_id", "target_layer_ids"]
    if cfg.is_dflash2:
        keys += ["conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"]
    for k in keys:
        if k not in (d.get("dflash_config") or {}):
            problems.append(f"dflash_config lacks {k}")
    exp = expected_tensor_shapes(cfg)
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors") and f != DRAFT_VOCAB)
    got: Dict[str, List[int]] = {}
    dtypes = set()
    for fn in files:
        p = os.path.join(out_dir, fn)
        if os.path.getsize(p) > max_file_bytes:
            problems.append(f"{fn} is larger than {max_file_bytes} bytes")
        with safe_open(p, framework="pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                got[k] = list(t.get_shape())
                dtypes.add(str(t.get_dtype()))
    if len(files) > 1:
        idx_p = os.path.join(out_dir, "model.safetensors.index.json")
        if not os.path.exists(idx_p):
            problems.append("sharded export without model.safetensors.index.json")
        else:
            with open(idx_p) as f:
                wm = json.load(f)["weight_map"]
            if set(wm) != set(got):
                problems.append("index weight_map does not match the shard contents")
    if set(got) != set(exp):
        problems.append(f"tensor names differ: missing {sorted(set(exp) - set(got))[:5]}, "
                        f"extra {sorted(set(got) - set(exp))[:5]}")
    for k, s in exp.items():
        if k in got and got[k] != s:
            problems.append(f"{k}: shape {got[k]} != {s}")
    if dtypes - {"BF16"}:
        problems.append(f"non-bf16 tensors: {dtypes}")
    total = sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)
    return {"ok": not problems, "problems": problems, "files": files, "tensors": len(got),
            "bytes": total, "config": {"block_size": cfg.block_size,
                                       "mask_token_id": cfg.mask_token_id,
                                       "target_layer_ids": cfg.target_layer_ids,
                                       "num_hidden_layers": cfg.num_hidden_layers}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="checkpoint dir (from train.py) to export")
    ap.add_argument("--out", help="export dir")
    ap.add_argument("--check", help="export dir to verify")
    ap.add_argument("--max-shard-mib", type=float, default=15.0)
    args = ap.parse_args(argv)
    if args.ckpt:
        from .checkpoint import read_checkpoint_weights

        sd, cfg, state = read_checkpoint_weights(args.ckpt)
        info = dict(state.get("card", {}))
        export_drafter(sd, cfg, args.out, info, max_shard_bytes=int(args.max_shard_mib * 2**20))
        src_card = os.path.join(args.ckpt, "drafter", "README.md")
        if os.path.exists(src_card):
            shutil.copyfile(src_card, os.path.join(args.out, "README.md"))
        print(json.dumps(check_export(args.out), indent=1))
    elif args.check:
        rep = check_export(args.check)
        print(json.dumps(rep, indent=1))
        sys.exit(0 if rep["ok"] else 1)
    else:
        ap.error("give --ckpt/--out or --check")


if __name__ == "__main__":
    main()
