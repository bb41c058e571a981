"""Train a DFlash drafter on regenerated sequences (online target features).

    python -m dflash_train.train --target /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --data-dirs RUN/regen --out-dir RUN --time-limit-s 300 [--resume RUN/ckpt]

Every step: a batch of sequences -> frozen target forward (tapped layer
outputs, bf16, stopped after the deepest tap) -> N random anchors per sequence
(anchors.py) -> blocks [token_a, MASK x (B-1)] -> drafter with the block mask
(masks.py) -> decayed, span-masked CE (loss.py) through the frozen target lm_head.

Outputs in --out-dir:
  ckpt/            checkpoint = export (ckpt/drafter) + AdamW moments + trainer_state.json
  train_log.txt    one human-readable line per --log-every steps (also on stdout)
  train_log.jsonl  the same as JSON (step, loss, lr, per-position accuracy,
                   teacher-forced acceptance length, tokens/s, ...)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import queue
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import torch

from .batch import collate, length_bucketed_batches
from .checkpoint import load_optimizer_state, read_checkpoint_weights, save_checkpoint
from .config import DrafterConfig, default_gamma, drafter_config_from_target
from .drafter import DFlashDrafter, batch_to_torch, block_loss
from .store import load_sequences
from .target import (embedding_weight, lm_head_weight, load_target, load_tokenizer,
                     pick_mask_token_id, target_features, target_hf_config)


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("training")
    g.add_argument("--data-dirs", nargs="*", default=[], help="regen shard dirs/files")
    g.add_argument("--resume", default=None, help="checkpoint dir to resume from ('auto' = OUT/ckpt if present)")
    g.add_argument("--draft-layers", type=int, default=3)
    g.add_argument("--grow-layers", type=int, default=0,
                   help="train a drafter of this many layers grown from the resumed one: its layers, then "
                        "copies of its last layer whose output projections start at zero, so the grown "
                        "drafter starts out computing what the resumed one does (0 = the resumed layers)")
    g.add_argument("--num-taps", type=int, default=5)
    g.add_argument("--target-layer-ids", default=None, help="comma list; default: published rule")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gamma", type=float, default=None, help="default 7 (B=16) / 4 (B=8)")
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument("--dflash2", action="store_true",
                   help="train a DFlash2 drafter (convolutions + candidate selector)")
    g.add_argument("--conv-kernel-size", type=int, default=2, help="DFlash2 convolution taps")
    g.add_argument("--conv-group-size", type=int, default=16, help="DFlash2 channels per dynamic coefficient")
    g.add_argument("--selector-rank", type=int, default=32, help="DFlash2 selector codebook width")
    g.add_argument("--selector-top-k", type=int, default=16, help="DFlash2 candidates per slot")
    g.add_argument("--selector-alpha", type=float, default=1.0, help="weight of the selector's CE")
    g.add_argument("--sliding-window", type=int, default=None,
                   help="non-causal sliding-window attention of this many positions (default: full)")
    g.add_argument("--num-anchors", type=int, default=128, help="anchors per sequence")
    g.add_argument("--short-blocks", type=float, default=0.0,
                   help="share of training blocks made short, of a length from --short-block-lens: the "
                        "engine's smaller blocks (a drafter trained on full blocks only predicts worse when "
                        "fed fewer masks); 0 = full blocks only")
    g.add_argument("--short-block-lens", default="2,3,4",
                   help="comma list of short block lengths, each 2..block size - 1")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    g.add_argument("--max-seq-len", type=int, default=1408)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr-ratio", type=float, default=0.1)
    g.add_argument("--warmup-frac", type=float, default=0.04)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--total-steps", type=int, default=0,
                   help="step-based cosine schedule; 0 = time-based (see --schedule-s)")
    g.add_argument("--schedule-s", type=float, default=0,
                   help="training seconds the cosine spans (cumulative over resumes); "
                        "0 = all the time this run has (plus what a resumed run already used)")
    g.add_argument("--max-steps", type=int, default=0, help="hard stop after this many steps (0 = none)")
    g.add_argument("--save-every-s", type=float, default=180)
    g.add_argument("--reserve-s", type=float, default=25, help="seconds kept for val/save/export at the end")
    g.add_argument("--log-every", type=int, default=20)
    g.add_argument("--val-seqs", type=int, default=128)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--optim-state", choices=["int8", "bf16", "none"], default="int8")
    g.add_argument("--chunk-rows", type=int, default=8192, help="lm_head rows per CE chunk")
    g.add_argument("--no-amp", action="store_true", help="disable bf16 autocast on CUDA")


def short_block_lens(a, cfg: Optional[DrafterConfig] = None) -> List[int]:
    """The short block lengths of ``--short-block-lens``, checked against ``--short-blocks`` and,
    given ``cfg``, the drafter (a DFlash2 drafter's convolutions and selector are sized for its
    whole block). Raises ValueError with the flag's name."""
    if not 0.0 <= a.short_blocks <= 1.0:
        raise ValueError(f"--short-blocks {a.short_blocks}: expected a share in 0..1")
    try:
        lens = [int(x) for x in a.short_block_lens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--short-block-lens {a.short_block_lens!r}: expected a comma list of integers")
    if a.short_blocks > 0 and cfg is not None:
        if cfg.is_dflash2:
            raise ValueError("--short-blocks: a DFlash2 drafter runs at its whole block only")
        if not lens or min(lens) < 2 or max(lens) >= cfg.block_size:
            raise ValueError(f"--short-block-lens {a.short_block_lens!r}: each must be in 2..{cfg.block_size - 1}")
    return lens


def lr_factor(progress: float, warmup: float, min_ratio: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return max(progress / warmup, 0.01)
    t = (progress - warmup) / max(1e-9, 1.0 - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


def acceptance_lengths_torch(correct: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Torch twin of loss.acceptance_lengths: [.., B] -> [..]."""
    ok = (correct[..., 1:] & (weights[..., 1:] > 0)).to(torch.int32)
    return 1 + torch.cumprod(ok, dim=-1).sum(-1)


class Prefetcher:
    """Background thread producing collated numpy batches."""

    def __init__(self, seqs, args, cfg: DrafterConfig, gamma: float, seed: int, depth: int = 6):
        self.seqs, self.args, self.cfg, self.gamma = seqs, args, cfg, gamma
        self.short_lens = short_block_lens(args, cfg)
        self.rng = np.random.default_rng(seed)
        self.q: "queue.Queue" = queue.Queue(maxsize=depth)
        self.epoch = 0
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        lengths = [s[0].shape[0] for s in self.seqs]
        while not self.stop:
            batches = length_bucketed_batches(lengths, self.args.batch_size, self.rng)
            for bi, idx in enumerate(batches):
                if self.stop:
                    return
                nb = collate([self.seqs[i][:2] for i in idx], num_anchors=self.args.num_anchors,
                             block_size=self.cfg.block_size, mask_token_id=self.cfg.mask_token_id,
                             gamma=self.gamma, rng=self.rng, pad_token_id=0,
                             short_frac=self.args.short_blocks, short_lens=self.short_lens)
                self.q.put((self.epoch + (bi + 1) / len(batches), nb))
            self.epoch += 1

    def get(self):
        return self.q.get()

    def close(self):
        self.stop = True
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass


def as_dflash2(cfg: DrafterConfig, a) -> DrafterConfig:
    """``cfg`` (a DFlash drafter's) with the DFlash2 fields of the command line."""
    return dataclasses.replace(cfg, conv_kernel_size=a.conv_kernel_size, conv_group_size=a.conv_group_size,
                               selector_rank=a.selector_rank, selector_top_k=a.selector_top_k)


def load_backbone(drafter: DFlashDrafter, sd: Dict[str, torch.Tensor], layers: Optional[int] = None) -> None:
    """A resumed drafter's weights ``sd`` into ``drafter``: a DFlash2 drafter's own parts (the
    block convolutions and the candidate selector) absent from ``sd`` keep their no-op
    initialisation, and with ``layers`` (how many layers ``sd`` holds) ``drafter``'s layers past
    them are grown (`grow_layers`)."""
    res = drafter.load_state_dict(sd, strict=False)
    own = ("attention_conv.", "mlp_conv.", "candidate_selector.")
    n_old = len(drafter.layers) if layers is None else layers
    new = tuple(f"layers.{i}." for i in range(n_old, len(drafter.layers)))
    missing = [k for k in res.missing_keys if not any(o in k for o in own) and not k.startswith(new)]
    if missing or res.unexpected_keys:
        raise ValueError(f"the resumed drafter does not fit this shape: missing {missing[:4]}, "
                         f"unexpected {res.unexpected_keys[:4]}")
    if n_old < len(drafter.layers):
        grow_layers(drafter, n_old)


def grown_config(cfg: DrafterConfig, layers: int) -> DrafterConfig:
    """``cfg`` with ``layers`` layers (--grow-layers), the new ones of its last layer's kind."""
    if layers < cfg.num_hidden_layers:
        raise ValueError(f"--grow-layers {layers}: the drafter already has {cfg.num_hidden_layers} layers")
    types = cfg.layer_types
    if types is not None:
        types = list(types) + [types[-1]] * (layers - len(types))
    return dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=types)


def grow_layers(drafter: DFlashDrafter, n_old: int) -> None:
    """Layers ``n_old..`` of ``drafter`` become copies of layer ``n_old - 1`` with the attention's
    and the MLP's output projections zero: each adds nothing to the residual stream, so the
    drafter computes what its first ``n_old`` layers do, and training grows them from there."""
    last = drafter.layers[n_old - 1].state_dict()
    with torch.no_grad():
        for layer in drafter.layers[n_old:]:
            layer.load_state_dict(last)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


class Trainer:
    def __init__(self, args, target, tok, out_dir: str, log_fn=None, target_name: str = "?"):
        self.args, self.target, self.tok, self.out_dir = args, target, tok, out_dir
        self.device = next(target.parameters()).device
        self.cuda = self.device.type == "cuda"
        os.makedirs(out_dir, exist_ok=True)
        self.log_txt = open(os.path.join(out_dir, "train_log.txt"), "a")
        self.log_jsonl = open(os.path.join(out_dir, "train_log.jsonl"), "a")
        self._print = log_fn or (lambda s: print(s, flush=True))
        self.target_name = target_name
        self.state: Dict = {"step": 0, "train_seconds": 0.0, "block_tokens": 0, "target_tokens": 0,
                            "epochs": 0.0}
        self._build()

    def log(self, s: str):
        self._print(s)
        self.log_txt.write(s + "\n")
        self.log_txt.flush()

    # ------------------------------------------------------------------ setup
    def _build(self):
        a = self.args
        emb = embedding_weight(self.target)
        resume = a.resume
        if resume == "auto":
            p = os.path.join(self.out_dir, "ckpt")
            resume = p if os.path.exists(os.path.join(p, "drafter", "config.json")) else None
        self.resume_dir = resume
        grown = False
        if resume:
            sd, cfg, st = read_checkpoint_weights(resume)
            self.state.update({k: st[k] for k in self.state if k in st})
            self.state["mask_token_text"] = st.get("mask_token_text", "")
            self.log(f"[train] resuming from {resume} at step {self.state['step']}")
            if a.dflash2 and not cfg.is_dflash2:
                cfg, grown = as_dflash2(cfg, a), True
                self.log(f"[train] {resume} is a DFlash drafter: its weights start a DFlash2 drafter "
                         f"(the convolutions and the selector start as no-ops)")
        else:
            taps = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
            if a.mask_token_id is not None:
                mask_id, mask_txt = a.mask_token_id, ""
            else:
                mask_id, mask_txt = pick_mask_token_id(self.tok, emb.shape[0])
            v2 = ({"conv_kernel_size": a.conv_kernel_size, "conv_group_size": a.conv_group_size,
                   "selector_rank": a.selector_rank, "selector_top_k": a.selector_top_k}
                  if a.dflash2 else None)
            cfg = drafter_config_from_target(target_hf_config(self.target), num_draft_layers=a.draft_layers,
                                             num_taps=a.num_taps, mask_token_id=mask_id,
                                             block_size=a.block_size, target_layer_ids=taps,
                                             dflash2=v2, sliding_window=a.sliding_window)
            self.state["mask_token_text"] = mask_txt
            sd = None
        if cfg.vocab_size != emb.shape[0]:
            self.log(f"[train] note: config vocab {cfg.vocab_size} vs embedding rows {emb.shape[0]}")
        n_old = cfg.num_hidden_layers
        if getattr(a, "grow_layers", 0):
            cfg = grown_config(cfg, a.grow_layers)
            if sd is not None and cfg.num_hidden_layers > n_old:
                self.log(f"[train] {n_old} layers grown to {cfg.num_hidden_layers} (the new ones start as no-ops)")
        self.cfg = cfg
        short_block_lens(a, cfg)  # the short-block flags fit this drafter (fails before any data loads)
        self.gamma = a.gamma if a.gamma is not None else default_gamma(cfg.block_size)
        self.drafter = DFlashDrafter(cfg)
        self.selector_stats: Dict = {}
        if sd is None:
            self.drafter.reset_parameters(seed=a.seed)
        elif grown or cfg.num_hidden_layers > n_old:
            self.drafter.reset_parameters(seed=a.seed)
            load_backbone(self.drafter, sd, layers=n_old)
        else:
            self.drafter.load_state_dict(sd)
        self.drafter.to(self.device)
        n_params = sum(p.numel() for p in self.drafter.parameters())
        self.log(f"[train] drafter: {cfg.num_hidden_layers} layers, taps {cfg.target_layer_ids}, "
                 f"block {cfg.block_size}, mask id {cfg.mask_token_id} "
                 f"{self.state.get('mask_token_text', '')}, gamma {self.gamma}, params {n_params / 1e6:.2f} M")
        decay, no_decay = [], []
        for n, p in self.drafter.named_parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        kw = {"fused": True} if self.cuda else {}
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=a.lr, betas=(0.9, a.beta2), eps=1e-8, **kw)
        self.opt_restored = bool(resume) and load_optimizer_state(resume, self.drafter, self.opt)
        if resume:
            self.log(f"[train] optimizer moments restored: {self.opt_restored}")
        self.emb_w = emb.detach()
        self.head_w = lm_head_weight(self.target).detach()

    def load_data(self, dirs: List[str]):
        a = self.args
        seqs, stats = load_sequences(dirs, max_len=a.max_seq_len)
        if not seqs:
            raise RuntimeError(f"no training sequences found in {dirs}")
        rng = np.random.default_rng(12345)
        order = rng.permutation(len(seqs))
        n_val = min(a.val_seqs, len(seqs) // 10)
        self.val = [seqs[i] for i in order[:n_val]]
        self.train_seqs = [seqs[i] for i in order[n_val:]]
        stats["val_sequences"] = len(self.val)
        stats["train_sequences"] = len(self.train_seqs)
        self.data_stats = stats
        self.log(f"[train] data: {json.dumps(stats)}")

    # ------------------------------------------------------------------ steps
    def _autocast(self):
        if self.cuda and not self.args.no_amp:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    def _forward(self, bt, train: bool):
        feats = target_features(self.target, bt["input_ids"], bt["attention_mask"].long(),
                                self.cfg.target_layer_ids)
        with self._autocast():
            loss, correct, w = block_loss(self.drafter, self.emb_w, self.head_w, feats, bt,
                                          chunk_rows=self.args.chunk_rows, checkpoint_ce=train,
                                          selector_alpha=self.args.selector_alpha,
                                          stats=self.selector_stats)
        return loss, correct, w

    def progress(self, schedule_s: float) -> float:
        a = self.args
        if a.total_steps:
            return self.state["step"] / a.total_steps
        return self.state["train_seconds"] / max(schedule_s, 1e-6)

    @torch.no_grad()
    def evaluate(self, max_batches: int = 1000) -> Dict:
        if not self.val:
            return {}
        self.drafter.eval()
        rng = np.random.default_rng(777)
        B = self.cfg.block_size
        pos_c = np.zeros(B)
        pos_t = np.zeros(B)
        loss_sum = w_sum = 0.0
        taus, taus_g = [], []
        bs = max(1, self.args.batch_size)
        for st in range(0, min(len(self.val), bs * max_batches), bs):
            part = self.val[st:st + bs]
            nb = collate([s[:2] for s in part], num_anchors=self.args.num_anchors, block_size=B,
                         mask_token_id=self.cfg.mask_token_id, gamma=self.gamma, rng=rng)
            bt = batch_to_torch(nb, self.device)
            loss, correct, w = self._forward(bt, train=False)
            ws = float(w.sum())
            loss_sum += float(loss) * ws
            w_sum += ws
            c = correct.cpu().numpy()
            wn = w.cpu().numpy()
            pos_c += (c & (wn > 0)).sum((0, 1))
            pos_t += (wn > 0).sum((0, 1))
            tau = acceptance_lengths_torch(correct, w).cpu().numpy()
            valid = nb["block_valid"]
            for i, s in enumerate(part):
                t = tau[i][valid[i]]
                taus.extend(t.tolist())
                if not s[2]:
                    taus_g.extend(t.tolist())
        self.drafter.train()
        acc = (pos_c[1:] / np.maximum(pos_t[1:], 1)).round(4).tolist()
        return {"val_loss": round(loss_sum / max(w_sum, 1e-9), 4), "val_acc": acc,
                "val_tau": round(float(np.mean(taus)), 3) if taus else None,
                "val_tau_greedy": round(float(np.mean(taus_g)), 3) if taus_g else None}

    def card(self, extra: Optional[Dict] = None) -> Dict:
        c = {"target_name": self.target_name, "step": self.state["step"],
             "mask_token_text": self.state.get("mask_token_text", ""),
             "data": "ShareGPT prompts (first turns + later turns with context), responses "
                     "regenerated by the target (75% greedy, 25% sampled T=0.8 top-p 0.95)",
             "train_sequences": getattr(self, "data_stats", {}).get("train_sequences", "?")}
        for k in ("train_loss", "val_loss", "val_tau", "val_tau_greedy"):
            if k in self.state:
                c[k] = self.state[k]
        if self.cfg.is_dflash2:
            c["selector_alpha"] = self.args.selector_alpha
        c.update(extra or {})
        return c

    def save(self):
        t0 = time.time()
        st = dict(self.state)
        st["args"] = {k: v for k, v in vars(self.args).items() if isinstance(v, (int, float, str, bool, type(None), list))}
        st["data_stats"] = getattr(self, "data_stats", {})
        save_checkpoint(os.path.join(self.out_dir, "ckpt"), self.drafter, self.opt, st,
                        optim_state=self.args.optim_state, card=self.card())
        self.log(f"[train] checkpoint saved at step {self.state['step']} ({time.time() - t0:.1f}s)")

    def train(self, deadline: float) -> Dict:
        a = self.args
        B = self.cfg.block_size
        now = time.time()
        run_budget = max(0.0, deadline - now - a.reserve_s)
        schedule_s = a.schedule_s or (self.state["train_seconds"] + run_budget)
        warmup = a.warmup_frac
        rewarm_steps = 0
        if self.resume_dir and not self.opt_restored:
            rewarm_steps = 50
        self.log(f"[train] budget {run_budget:.0f}s, schedule {'%d steps' % a.total_steps if a.total_steps else '%.0fs' % schedule_s}, "
                 f"lr {a.lr}, batch {a.batch_size} x {a.num_anchors} anchors x B={B}")
        pf = Prefetcher(self.train_seqs, a, self.cfg, self.gamma, seed=a.seed + self.state["step"])
        self.drafter.train()
        win = {"loss": 0.0, "n": 0, "pos_c": torch.zeros(B, device=self.device),
               "pos_t": torch.zeros(B, device=self.device), "tau_sum": torch.zeros((), device=self.device),
               "tau_n": torch.zeros((), device=self.device), "blk": 0, "tgt": 0, "t0": time.time()}
        loss_acc = torch.zeros((), device=self.device)
        last_save = time.time()
        steps_this_run = 0
        step_times: List[float] = []
        while True:
            if a.max_steps and steps_this_run >= a.max_steps:
                break
            if a.total_steps and self.state["step"] >= a.total_steps:
                break
            # expected duration of the next step: 3x the recent median (robust to
            # the occasional synchronising log step)
            est = (float(np.median(step_times[-16:])) * 3.0) if step_times else 0.0
            if time.time() + est > deadline - a.reserve_s:
                break
            t0 = time.time()
            epoch, nb = pf.get()
            bt = batch_to_torch(nb, self.device, pin=self.cuda)
            f = lr_factor(self.progress(schedule_s), warmup, a.min_lr_ratio)
            if rewarm_steps and steps_this_run < rewarm_steps:
                f *= (steps_this_run + 1) / rewarm_steps
            for g in self.opt.param_groups:
                g["lr"] = a.lr * f
            loss, correct, w = self._forward(bt, train=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), a.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                loss_acc += loss.detach()
                m = w > 0
                win["pos_c"] += (correct & m).sum((0, 1)).float()
                win["pos_t"] += m.sum((0, 1)).float()
                vb = bt["block_valid"]
                tau = acceptance_lengths_torch(correct, w)
                win["tau_sum"] += (tau * vb).sum().float()
                win["tau_n"] += vb.sum().float()
            win["n"] += 1
            win["blk"] += int(nb["block_valid"].sum()) * B
            win["tgt"] += int(nb["attention_mask"].sum())
            steps_this_run += 1
            self.state["step"] += 1
            self.state["epochs"] = float(epoch)
            if self.cuda and steps_this_run <= 3:
                torch.cuda.synchronize()
            dt = time.time() - t0
            step_times.append(dt)
            self.state["train_seconds"] += dt
            if self.state["step"] % a.log_every == 0 or steps_this_run == 1:
                if self.cuda:
                    torch.cuda.synchronize()
                el = time.time() - win["t0"]
                lv = float(loss_acc) / win["n"]
                acc = (win["pos_c"][1:] / win["pos_t"][1:].clamp_min(1)).tolist()
                rec = {"step": self.state["step"], "epoch": round(float(epoch), 3), "loss": round(lv, 4),
                       "lr": a.lr * f, "grad_norm": round(float(gn), 3),
                       "acc": [round(x, 3) for x in acc],
                       "tau_tf": round(float(win["tau_sum"] / win["tau_n"].clamp_min(1)), 3),
                       "block_tok_s": round(win["blk"] / max(el, 1e-6)),
                       "target_tok_s": round(win["tgt"] / max(el, 1e-6)),
                       "step_s": round(el / win["n"], 4), "train_s": round(self.state["train_seconds"], 1)}
                if self.selector_stats:
                    rec.update({k: round(v, 4) for k, v in self.selector_stats.items()})
                self.state["train_loss"] = rec["loss"]
                self.log_jsonl.write(json.dumps(rec) + "\n")
                self.log_jsonl.flush()
                self.log(f"step {rec['step']} ep {rec['epoch']} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                         f"gn {rec['grad_norm']} tau_tf {rec['tau_tf']} acc[1..] "
                         + ",".join(f"{x:.2f}" for x in acc) + f" | {rec['block_tok_s']} blk tok/s "
                         f"{rec['target_tok_s']} tgt tok/s {rec['step_s'] * 1000:.0f} ms/step"
                         + (f" | selector loss {rec['selector_loss']} coverage {rec['selector_coverage']}"
                            if "selector_loss" in rec else ""))
                loss_acc.zero_()
                win.update({"loss": 0.0, "n": 0, "blk": 0, "tgt": 0, "t0": time.time()})
                win["pos_c"].zero_(); win["pos_t"].zero_(); win["tau_sum"].zero_(); win["tau_n"].zero_()
            if time.time() - last_save > a.save_every_s:
                self.save()
                last_save = time.time()
        pf.close()
        ev = self.evaluate()
        self.state.update(ev)
        if ev:
            self.log(f"[train] validation: {json.dumps(ev)}")
            self.log_jsonl.write(json.dumps({"step": self.state["step"], **ev}) + "\n")
            self.log_jsonl.flush()
        self.save()
        return {"steps_this_run": steps_this_run, **self.state}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--time-limit-s", type=float, default=540)
    ap.add_argument("--dtype", default="bfloat16", help="target dtype")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_args(ap)
    args = ap.parse_args(argv)
    try:
        short_block_lens(args)
    except ValueError as e:
        ap.error(str(e))
    if args.grow_layers < 0:
        ap.error(f"--grow-layers {args.grow_layers}: expected a layer count (0 = the resumed drafter's)")
    deadline = time.time() + args.time_limit_s
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    tok = load_tokenizer(args.target, args.gguf_file)
    target = load_target(args.target, args.gguf_file, args.dtype, args.device)
    try:
        tr = Trainer(args, target, tok, args.out_dir, target_name=os.path.basename(args.target.rstrip("/")))
    except ValueError as e:  # a resumed drafter that does not fit the flags (--grow-layers, --dflash2)
        ap.error(str(e))
    tr.load_data(args.data_dirs)
    res = tr.train(deadline)
    print(json.dumps({k: v for k, v in res.items() if k != "args"}, default=str))


if __name__ == "__main__":
    main()
