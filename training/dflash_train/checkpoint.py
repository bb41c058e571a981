"""Small resumable checkpoints.

Layout of a checkpoint directory:
  drafter/                 the export itself (config.json, README.md, bf16
                           safetensors, sharded <= 15 MiB per file)
  optim/optim-0000k-of-0000N.safetensors   AdamW moments (sharded <= 15 MiB)
  trainer_state.json       step, training seconds, schedule, data stats, card info

Weights are kept in bf16 (a resume continues from the bf16-rounded weights;
the one-off rounding is far below the size of an update).  AdamW moments are
stored in one of three formats (``--optim-state``):
  int8 (default): exp_avg as int8 with one fp32 absmax scale per 256 values;
                  exp_avg_sq as 8-bit log2 codes with a per-tensor range
                  (relative error <= ~9% on v, <= ~4.5% on sqrt(v)).
                  1 byte per parameter per moment.
  bf16:           both moments in bf16 (2 bytes per parameter per moment).
  none:           no moments (a resume re-warms the optimizer).
For the default 3-layer SmolLM2 drafter (12.3 M parameters): weights 24.5 MB
+ int8 moments 24.8 MB, i.e. 4 files of <= 15 MiB plus small JSON files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional, Tuple

import torch

from .config import DrafterConfig
from .export import DEFAULT_SHARD_BYTES, export_drafter, load_sharded, save_sharded

QBLOCK = 256


# ------------------------------------------------------------------ moment codecs
def quant_int8_blockwise(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    flat = x.detach().float().reshape(-1)
    n = flat.numel()
    pad = (-n) % QBLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    blk = flat.view(-1, QBLOCK)
    scale = blk.abs().amax(dim=1).clamp_min(1e-30) / 127.0
    q = torch.round(blk / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(-1)[:n].contiguous(), scale.contiguous()


def dequant_int8_blockwise(q: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    n = q.numel()
    pad = (-n) % QBLOCK
    qf = q.float()
    if pad:
        qf = torch.cat([qf, qf.new_zeros(pad)])
    return (qf.view(-1, QBLOCK) * scale[:, None].float()).reshape(-1)[:n].view(shape)


def quant_log8(v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Non-negative tensor -> uint8 codes (0 = exact zero) + [lo, step] (fp32)."""
    flat = v.detach().float().reshape(-1).clamp_min(0)
    pos = flat > 0
    if not bool(pos.any()):
        return torch.zeros_like(flat, dtype=torch.uint8), torch.tensor([0.0, 1.0])
    lv = torch.log2(flat[pos])
    lo, hi = float(lv.min()), float(lv.max())
    step = max((hi - lo) / 254.0, 1e-6)
    codes = torch.zeros_like(flat, dtype=torch.uint8)
    codes[pos] = (1 + torch.round((lv - lo) / step)).clamp_(1, 255).to(torch.uint8)
    return codes, torch.tensor([lo, step], dtype=torch.float32)


def dequant_log8(codes: torch.Tensor, params: torch.Tensor, shape) -> torch.Tensor:
    lo, step = float(params[0]), float(params[1])
    c = codes.float()
    out = torch.exp2(lo + (c - 1) * step)
    out[codes == 0] = 0.0
    return out.view(shape)


# ------------------------------------------------------------------ save / load
def save_checkpoint(ckpt_dir: str, drafter, optimizer, state: Dict, optim_state: str = "int8",
                    card: Optional[Dict] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Atomically (re)write ``ckpt_dir``."""
    tmp = ckpt_dir.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    sd = {k: v for k, v in drafter.state_dict().items()}
    export_drafter(sd, drafter.cfg, os.path.join(tmp, "drafter"), card, max_shard_bytes=max_shard_bytes)
    step = int(state.get("step", 0))
    if optimizer is not None and optim_state != "none":
        tensors: Dict[str, torch.Tensor] = {}
        name_of = {id(p): n for n, p in drafter.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if not st or "exp_avg" not in st:
                    continue
                n = name_of[id(p)]
                m, v = st["exp_avg"], st["exp_avg_sq"]
                if optim_state == "int8":
                    q, s = quant_int8_blockwise(m)
                    tensors[n + ".m_q"], tensors[n + ".m_scale"] = q.cpu(), s.cpu()
                    c, prm = quant_log8(v)
                    tensors[n + ".v_log8"], tensors[n + ".v_range"] = c.cpu(), prm
                elif optim_state == "bf16":
                    tensors[n + ".m"] = m.detach().to(torch.bfloat16).cpu()
                    tensors[n + ".v"] = v.detach().to(torch.bfloat16).cpu()
                else:
                    raise ValueError(f"unknown optim_state {optim_state}")
        if tensors:
            save_sharded(tensors, os.path.join(tmp, "optim"), prefix="optim",
                         max_shard_bytes=max_shard_bytes,
                         metadata={"optim_state": optim_state, "step": str(step)}, write_index=False)
    st = dict(state)
    st["optim_state"] = optim_state if optimizer is not None else "none"
    st["card"] = card or {}
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump(st, f, indent=1)
    if os.path.exists(ckpt_dir):
        old = ckpt_dir.rstrip("/") + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(ckpt_dir, old)
        os.replace(tmp, ckpt_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, ckpt_dir)


def read_checkpoint_weights(ckpt_dir: str):
    """(state_dict fp32, DrafterConfig, trainer_state).  ``ckpt_dir`` may also be
    a bare export directory (then trainer_state is {})."""
    d = os.path.join(ckpt_dir, "drafter")
    if not os.path.isdir(d):
        d = ckpt_dir
    with open(os.path.join(d, "config.json")) as f:
        cfg = DrafterConfig.from_hf_dict(json.load(f))
    sd = {k: v.float() for k, v in load_sharded(d).items()}
    st_p = os.path.join(ckpt_dir, "trainer_state.json")
    state = json.load(open(st_p)) if os.path.exists(st_p) else {}
    return sd, cfg, state


def load_optimizer_state(ckpt_dir: str, drafter, optimizer) -> bool:
    """Restore AdamW moments if present.  Returns True when restored."""
    od = os.path.join(ckpt_dir, "optim")
    st_p = os.path.join(ckpt_dir, "trainer_state.json")
    if not os.path.isdir(od) or not os.path.exists(st_p):
        return False
    state = json.load(open(st_p))
    fmt = state.get("optim_state", "none")
    if fmt == "none":
        return False
    tens = load_sharded(od, prefix="optim")
    step = float(state.get("step", 0))
    sd = optimizer.state_dict()
    params = dict(drafter.named_parameters())
    idx_of = {}
    k = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            idx_of[id(p)] = k
            k += 1
    new_state = {}
    for n, p in params.items():
        if fmt == "int8":
            if n + ".m_q" not in tens:
                continue
            m = dequant_int8_blockwise(tens[n + ".m_q"], tens[n + ".m_scale"], p.shape)
            v = dequant_log8(tens[n + ".v_log8"], tens[n + ".v_range"], p.shape)
        else:
            if n + ".m" not in tens:
                continue
            m, v = tens[n + ".m"].float().view(p.shape), tens[n + ".v"].float().view(p.shape)
        new_state[idx_of[id(p)]] = {"step": torch.tensor(step), "exp_avg": m.to(p.device, p.dtype),
                                    "exp_avg_sq": v.to(p.device, p.dtype)}
    if not new_state:
        return False
    sd["state"] = new_state
    optimizer.load_state_dict(sd)
    return True


def checkpoint_bytes(ckpt_dir: str) -> int:
    tot = 0
    for root, _, files in os.walk(ckpt_dir):
        for f in files:
            tot += os.path.getsize(os.path.join(root, f))
    return tot
