"""Streaming trainer: consumes conversation shards (gen_data.py) as they appear.

    python -m dflash_train.stream_train --target T.gguf --data-dir RUN/data --work RUN/train \
        --time-limit-s 480 --device cuda:1

* data: every ``conv_*.npz`` in --data-dir, polled while training; a conversation is used at
  most --max-passes times (fresh ones first); conversations whose id hashes below --val-frac
  are the validation split (never trained on);
* schedule: warmup-stable-decay.  Warmup over --warmup-steps, then the constant lr; the last
  --decay-s seconds of the call decay it linearly to --min-lr-ratio.  At the start of the decay
  the stable state (fp32 weights, AdamW moments, step, per-conversation use counts) is saved
  to WORK/stable.pt; the next call resumes from it, so every call continues the same stable
  run and ends with its own decayed weights;
* at the end of the call: teacher-forced validation and the walk tau (walk.py) on held-out
  greedy conversations; the decayed weights are exported to WORK/export (published format); if
  their walk tau beats WORK/best/ (best.json), they are copied there: WORK/best is the drafter
  to ship;
* distillation: --kd-alpha a > 0 trains on (1 - a) CE + a KL(target || drafter) per slot.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import shutil
import threading
import time
import zlib
from typing import Dict, List, Optional

import numpy as np
import torch

from . import train as train_mod
from .batch import collate
from .drafter import batch_to_torch, block_loss
from .export import carry_draft_vocab, check_export, export_drafter
from .flexattn import padded_context_len
from .loss import IGNORE_INDEX
from .store import conv_shard_paths, read_conv_shard
from .target import load_target, load_tokenizer, target_features
from .walk import walk_tau


def is_val(cid: int, frac: float) -> bool:
    return zlib.crc32(f"val:{cid}".encode()) / 2**32 < frac


class StreamData:
    """Conversation records from a growing shard directory, with use counts."""

    def __init__(self, data_dir: str, max_len: int, val_frac: float, val_cap: int, max_passes: int,
                 seed: int, uses: Optional[Dict[int, int]] = None):
        self.dir, self.max_len, self.val_frac, self.val_cap = data_dir, max_len, val_frac, val_cap
        self.max_passes = max_passes
        self.rng = np.random.default_rng(seed)
        self.uses: Dict[int, int] = dict(uses or {})
        self.files: set = set()
        self.cids: set = set()
        self.fresh: collections.deque = collections.deque()
        self.used: List[dict] = []
        self.val: List[dict] = []
        self.lock = threading.Lock()
        self.stats = {"shards": 0, "conversations": 0, "response_tokens": 0, "tokens": 0, "val": 0,
                      "trained_conversations": 0, "trained_response_tokens": 0, "second_passes": 0}

    def poll(self) -> int:
        new = 0
        for p in conv_shard_paths(self.dir):
            if p in self.files:
                continue
            try:
                recs = read_conv_shard(p, self.max_len)
            except (OSError, ValueError, KeyError):
                continue  # being replaced; read again later
            self.files.add(p)
            order = self.rng.permutation(len(recs))
            with self.lock:
                self.stats["shards"] += 1
                for i in order:
                    r = recs[i]
                    if r["cid"] in self.cids:
                        continue
                    self.cids.add(r["cid"])
                    self.stats["conversations"] += 1
                    self.stats["tokens"] += int(r["ids"].size)
                    self.stats["response_tokens"] += int(r["loss_mask"].sum())
                    if is_val(r["cid"], self.val_frac):
                        if len(self.val) < self.val_cap:
                            self.val.append(r)
                            self.stats["val"] += 1
                        continue
                    u = self.uses.get(r["cid"], 0)
                    if u >= self.max_passes:
                        continue
                    (self.fresh if u == 0 else self.used).append(r)
                    new += 1
        return new

    def take(self, n: int) -> Optional[List[dict]]:
        with self.lock:
            if len(self.fresh) + len(self.used) < n:
                return None
            out = [self.fresh.popleft() for _ in range(min(n, len(self.fresh)))]
            if len(out) < n:
                idx = self.rng.choice(len(self.used), size=n - len(out), replace=False)
                pick = set(int(i) for i in idx)
                out += [self.used[i] for i in sorted(pick)]
                self.used = [r for i, r in enumerate(self.used) if i not in pick]
                self.stats["second_passes"] += len(pick)
            for r in out:
                u = self.uses.get(r["cid"], 0) + 1
                self.uses[r["cid"]] = u
                if u == 1:
                    self.stats["trained_conversations"] += 1
                    self.stats["trained_response_tokens"] += int(r["loss_mask"].sum())
                if u < self.max_passes:
                    self.used.append(r)
            return out


class StreamPrefetcher:
    """Background thread: poll the shard dir, form length-sorted windows, collate batches."""

    def __init__(self, data: StreamData, args, cfg, gamma: float, seed: int, depth: int = 8):
        self.data, self.args, self.cfg, self.gamma = data, args, cfg, gamma
        self.short_lens = train_mod.short_block_lens(args, cfg)
        self.rng = np.random.default_rng(seed)
        self.q: "queue.Queue" = queue.Queue(maxsize=depth)
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        a = self.args
        last_poll = 0.0
        while not self.stop:
            if time.time() - last_poll > a.poll_s:
                self.data.poll()
                last_poll = time.time()
            win = self.data.take(a.batch_size * a.window_batches)
            if win is None:
                win = self.data.take(a.batch_size)
            if win is None:
                time.sleep(0.5)
                self.data.poll()
                last_poll = time.time()
                continue
            win.sort(key=lambda r: r["ids"].size)
            batches = [win[i:i + a.batch_size] for i in range(0, len(win), a.batch_size)]
            for k in self.rng.permutation(len(batches)):
                nb = collate([(r["ids"], r["loss_mask"]) for r in batches[k]], num_anchors=a.num_anchors,
                             block_size=self.cfg.block_size, mask_token_id=self.cfg.mask_token_id,
                             gamma=self.gamma, rng=self.rng, pad_token_id=0, short_frac=a.short_blocks,
                             short_lens=self.short_lens)
                if a.min_weight > 0:
                    drop = nb["weights"] < a.min_weight
                    nb["weights"][drop] = 0.0
                    nb["labels"][drop] = IGNORE_INDEX
                while not self.stop:
                    try:
                        self.q.put(nb, timeout=0.5)
                        break
                    except queue.Full:
                        continue

    def get(self, timeout: float) -> Optional[dict]:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self):
        self.stop = True


class StreamTrainer(train_mod.Trainer):
    """Trainer with distillation, block-sparse attention (--attn flex) and compiled drafter
    layers (--compile) for training steps; evaluation runs the dense form eagerly."""

    def _build(self):
        super()._build()
        a = self.args
        self.ctx_pad = padded_context_len(a.max_seq_len) if a.attn == "flex" else 0
        if a.compile:
            for layer in self.drafter.layers:
                layer.compile(dynamic=False)

    def _forward(self, bt, train: bool):
        a = self.args
        kd = a.kd_alpha > 0 and train
        out = target_features(self.target, bt["input_ids"], bt["attention_mask"].long(),
                              self.cfg.target_layer_ids, return_final=kd)
        feats, final = out if kd else (out, None)
        with self._autocast(), torch.compiler.set_stance("default" if train else "force_eager"):
            return block_loss(self.drafter, self.emb_w, self.head_w, feats, bt, chunk_rows=a.chunk_rows,
                              checkpoint_ce=train, selector_alpha=a.selector_alpha, stats=self.selector_stats,
                              target_final=final, kd_alpha=a.kd_alpha if kd else 0.0,
                              ctx_pad=self.ctx_pad if train else 0)


def lr_wsd(step: int, now: float, decay_start: float, decay_s: float, warmup_steps: int, min_ratio: float) -> float:
    f = min(1.0, (step + 1) / max(1, warmup_steps))
    if now >= decay_start:
        frac = min(1.0, (now - decay_start) / max(decay_s, 1e-6))
        f *= 1.0 - (1.0 - min_ratio) * frac
    return f


def add_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("streaming")
    g.add_argument("--data-dir", required=True)
    g.add_argument("--work", required=True, help="stable state, logs, exports")
    g.add_argument("--decay-s", type=float, default=60)
    g.add_argument("--warmup-steps", type=int, default=200)
    g.add_argument("--kd-alpha", type=float, default=0.0, help="distillation weight (0 = CE only)")
    g.add_argument("--attn", choices=["dense", "flex"], default="dense",
                   help="training attention: dense mask (SDPA) or block-sparse FlexAttention")
    g.add_argument("--compile", action="store_true", help="torch.compile the drafter layers (training steps)")
    g.add_argument("--init-drafter", default=None,
                   help="exported drafter to start from when WORK has no stable state (fresh optimizer)")
    g.add_argument("--val-frac", type=float, default=0.02)
    g.add_argument("--val-seqs-max", type=int, default=256)
    g.add_argument("--walk-seqs", type=int, default=128)
    g.add_argument("--walk-max-new", type=int, default=256)
    g.add_argument("--walk-small-block", type=int, default=4,
                   help="also walk at this block size (the GPU's default block; 0 = off); logged, "
                        "the best export is still chosen by the walk at the trained block size")
    g.add_argument("--max-passes", type=int, default=2)
    g.add_argument("--min-weight", type=float, default=0.1, help="slot weights below this are dropped")
    g.add_argument("--window-batches", type=int, default=16)
    g.add_argument("--poll-s", type=float, default=5)
    g.add_argument("--eval-every-s", type=float, default=0, help="walk tau during the stable phase (0 = off)")
    g.add_argument("--wait-data-s", type=float, default=240, help="give up when no batch comes for this long")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--time-limit-s", type=float, default=480)
    ap.add_argument("--dtype", default="float32", help="target dtype (features)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train_mod.add_args(ap)
    add_args(ap)
    ap.set_defaults(draft_layers=4, gamma=4.0, max_seq_len=1040, reserve_s=30)
    args = ap.parse_args(argv)
    if args.walk_small_block < 0 or args.walk_small_block == 1:
        ap.error(f"--walk-small-block {args.walk_small_block}: expected 0 (off) or a block size of at least 2")
    try:
        train_mod.short_block_lens(args)
    except ValueError as e:
        ap.error(str(e))
    if args.grow_layers < 0:
        ap.error(f"--grow-layers {args.grow_layers}: expected a layer count (0 = the resumed drafter's)")
    t0 = time.time()
    deadline = t0 + args.time_limit_s
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    os.makedirs(args.work, exist_ok=True)
    tok = load_tokenizer(args.target, args.gguf_file)
    target = load_target(args.target, args.gguf_file, args.dtype, args.device)
    stable = os.path.join(args.work, "stable.pt")
    args.resume = args.init_drafter if args.init_drafter and not os.path.exists(stable) else None
    try:
        tr = StreamTrainer(args, target, tok, args.work, target_name=os.path.basename(args.target.rstrip("/")))
    except ValueError as e:  # a resumed drafter that does not fit the flags (--grow-layers, --dflash2)
        ap.error(str(e))
    uses: Dict[int, int] = {}
    calls = 0
    if os.path.exists(stable):
        ck = torch.load(stable, map_location=args.device, weights_only=False)
        tr.drafter.load_state_dict(ck["drafter"])
        tr.opt.load_state_dict(ck["opt"])
        tr.state.update(ck["state"])
        uses = {int(k): int(v) for k, v in zip(ck["use_cid"], ck["use_n"])}
        calls = int(ck.get("calls", 0))
        tr.log(f"[stream] resumed the stable state at step {tr.state['step']} ({len(uses)} conversations used)")
    calls += 1
    data = StreamData(args.data_dir, args.max_seq_len, args.val_frac, args.val_seqs_max, args.max_passes,
                      seed=args.seed + 7919 * calls, uses=uses)
    pf = StreamPrefetcher(data, args, tr.cfg, tr.gamma, seed=args.seed + calls)
    decay_start = deadline - args.reserve_s - args.decay_s
    tr.log(f"[stream] call {calls}: {args.time_limit_s:.0f}s, decay from +{decay_start - t0:.0f}s for "
           f"{args.decay_s:.0f}s, lr {args.lr}, kd {args.kd_alpha}, gamma {tr.gamma}, "
           f"batch {args.batch_size} x {args.num_anchors} anchors"
           + (f", short blocks {args.short_blocks} of {args.short_block_lens}" if args.short_blocks else ""))
    B = tr.cfg.block_size
    if args.walk_small_block >= B:
        ap.error(f"--walk-small-block {args.walk_small_block}: must be below the drafter's block size {B} "
                 "(0 turns it off)")
    if args.walk_small_block and tr.cfg.is_dflash2:
        tr.log(f"[stream] no walk at block {args.walk_small_block}: a DFlash2 drafter walks at its block size only")
        args.walk_small_block = 0
    dev = tr.device
    win = {"n": 0, "loss": torch.zeros((), device=dev), "pos_c": torch.zeros(B, device=dev),
           "pos_t": torch.zeros(B, device=dev), "blk": 0, "t0": time.time(), "resp": 0}
    saved_stable = False
    steps_call = 0
    step_times: List[float] = []
    last_batch = time.time()
    tr.drafter.train()

    def save_stable():
        with data.lock:
            snap_uses = dict(data.uses)
        torch.save({"drafter": tr.drafter.state_dict(), "opt": tr.opt.state_dict(), "state": dict(tr.state),
                    "use_cid": np.array(list(snap_uses.keys()), dtype=np.int64),
                    "use_n": np.array(list(snap_uses.values()), dtype=np.int64), "calls": calls},
                   stable + ".tmp")
        os.replace(stable + ".tmp", stable)
        tr.log(f"[stream] stable state saved at step {tr.state['step']}")

    while True:
        now = time.time()
        est = float(np.median(step_times[-16:])) * 2 if step_times else 0.0
        if now + est > deadline - args.reserve_s:
            break
        if not saved_stable and now >= decay_start:
            save_stable()
            saved_stable = True
        nb = pf.get(timeout=1.0)
        if nb is None:
            if time.time() - last_batch > args.wait_data_s:
                tr.log("[stream] no data: stopping")
                break
            continue
        last_batch = time.time()
        ts = time.time()
        bt = batch_to_torch(nb, dev, pin=tr.cuda)
        f = lr_wsd(tr.state["step"], time.time(), decay_start, args.decay_s, args.warmup_steps, args.min_lr_ratio)
        for grp in tr.opt.param_groups:
            grp["lr"] = args.lr * f
        loss, correct, w = tr._forward(bt, train=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(tr.drafter.parameters(), args.grad_clip)
        tr.opt.step()
        tr.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            m = w > 0
            win["loss"] += loss.detach()
            win["pos_c"] += (correct & m).sum((0, 1)).float()
            win["pos_t"] += m.sum((0, 1)).float()
        win["n"] += 1
        win["blk"] += int(nb["block_valid"].sum()) * B
        tr.state["step"] += 1
        steps_call += 1
        if tr.cuda and steps_call <= 3:
            torch.cuda.synchronize()
        dt = time.time() - ts
        step_times.append(dt)
        tr.state["train_seconds"] += dt
        if tr.state["step"] % args.log_every == 0:
            if tr.cuda:
                torch.cuda.synchronize()
            el = time.time() - win["t0"]
            acc = (win["pos_c"][1:] / win["pos_t"][1:].clamp_min(1)).tolist()
            rec = {"step": tr.state["step"], "loss": round(float(win["loss"]) / win["n"], 4), "lr": args.lr * f,
                   "grad_norm": round(float(gn), 3), "acc": [round(x, 3) for x in acc[:10]],
                   "blk_tok_s": round(win["blk"] / max(el, 1e-6)), "step_ms": round(1000 * el / win["n"], 1),
                   "t": round(time.time() - t0, 1), **{k: v for k, v in data.stats.items()}}
            tr.state["train_loss"] = rec["loss"]
            tr.log_jsonl.write(json.dumps(rec) + "\n")
            tr.log_jsonl.flush()
            tr.log(f"step {rec['step']} loss {rec['loss']:.4f} lr {rec['lr']:.2e} gn {rec['grad_norm']} acc[1..] "
                   + ",".join(f"{x:.2f}" for x in acc[:8]) + f" | {rec['step_ms']} ms/step | data: "
                   f"{data.stats['conversations']} convs {data.stats['response_tokens'] / 1e6:.2f} M resp tok, "
                   f"trained {data.stats['trained_conversations']} convs "
                   f"{data.stats['trained_response_tokens'] / 1e6:.2f} M, 2nd passes {data.stats['second_passes']}")
            win.update({"n": 0, "blk": 0, "t0": time.time()})
            win["loss"].zero_()
            win["pos_c"].zero_()
            win["pos_t"].zero_()
    pf.close()
    if not saved_stable:
        save_stable()
    # ---- evaluation of the decayed weights, export, best
    tr.val = [(r["ids"], r["loss_mask"], r["sampled"]) for r in data.val]
    walk_set = [r for r in data.val if not r["sampled"]][:args.walk_seqs]
    ev = tr.evaluate(max_batches=max(1, len(tr.val) // max(1, args.batch_size)))
    with torch.compiler.set_stance("force_eager"):
        wk = walk_tau(tr.drafter, tr.target, tr.emb_w, tr.head_w, walk_set, max_new=args.walk_max_new,
                      autocast=tr._autocast) if walk_set else {}
        small = args.walk_small_block
        if walk_set and small:
            ws = walk_tau(tr.drafter, tr.target, tr.emb_w, tr.head_w, walk_set, max_new=args.walk_max_new,
                          autocast=tr._autocast, block=small)
            wk.update({f"walk_tau_b{small}": ws["walk_tau"], f"walk_accept_by_slot_b{small}": ws["walk_accept_by_slot"]})
    res = {"step": tr.state["step"], "call": calls, "steps_this_call": steps_call, **ev, **wk,
           "walk_seqs": len(walk_set), "data": data.stats}
    tr.state.update({k: v for k, v in ev.items()})
    tr.log("[stream] end of call: " + json.dumps(res))
    tr.log_jsonl.write(json.dumps({"eval": res}) + "\n")
    tr.log_jsonl.flush()
    card = tr.card({"data": "target-generated conversations (ShareGPT user turns + self-written Magpie "
                            "turns), every answer by the target; 80% greedy, 20% T=1",
                    "train_sequences": data.stats["trained_conversations"],
                    "extra": f"walk tau (held-out greedy conversations, block {B}): {wk.get('walk_tau')}"})
    exp = os.path.join(args.work, "export")
    export_drafter({k: v for k, v in tr.drafter.state_dict().items()}, tr.cfg, exp, card)
    carry_draft_vocab(args.init_drafter, exp)
    chk = check_export(exp)
    best_path = os.path.join(args.work, "best.json")
    best = json.load(open(best_path)) if os.path.exists(best_path) else {}
    if wk and wk.get("walk_tau", 0) > best.get("walk_tau", -1):
        bdir = os.path.join(args.work, "best")
        if os.path.exists(bdir):
            shutil.rmtree(bdir)
        shutil.copytree(exp, bdir)
        with open(best_path, "w") as f:
            json.dump(res, f, indent=1)
        tr.log(f"[stream] new best walk tau {wk['walk_tau']} -> {bdir}")
    with open(os.path.join(args.work, f"summary_call{calls}.json"), "w") as f:
        json.dump({**res, "export_check": chk}, f, indent=1, default=str)
    print(json.dumps(res, default=str), flush=True)


if __name__ == "__main__":
    main()
