"""Trainer step time by attention form, on the GPU, and which form the streaming run should use.

    python -m dflash_train.bench_train [--variants dense,flex,flex+compile] [--steps 20]
        [--json OUT.json] [--choice-file CHOICE] [--profile PROFILE.txt]

The model is a randomly initialised SmolLM2-135M-shaped Llama target (step time does not depend
on the weights) and a drafter built by the streaming trainer itself (``StreamTrainer`` with the
same defaults as ``stream_train``: 4 layers, batch 8 conversations x 256 anchors, block 16).
Batches are random conversations of 300..1,040 tokens with a response part, collated once and
fed identically to every variant. For each variant: warm-up steps (compile time reported
separately), then ``--steps`` timed full training steps (target features, drafter forward and
backward, clip, AdamW), median ms per step and block tokens per second. The fastest variant's
stream_train arguments go to ``--choice-file``; ``--profile`` writes the top CUDA kernels of a few
steps of the first and the fastest variant.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from . import train as train_mod
from .batch import collate
from .bench_gen import random_smollm2, sync
from .drafter import batch_to_torch
from .stream_train import StreamTrainer, add_args

VARIANT_ARGS = {"dense": ["--attn", "dense"], "flex": ["--attn", "flex"],
                "flex+compile": ["--attn", "flex", "--compile"], "dense+compile": ["--attn", "dense", "--compile"]}


def trainer_args(extra, work: str, a) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    train_mod.add_args(ap)
    add_args(ap)
    ap.set_defaults(draft_layers=4, gamma=4.0, max_seq_len=1040, reserve_s=30)
    argv = ["--data-dir", work, "--work", work, "--batch-size", str(a.batch_size), "--num-anchors",
            str(a.num_anchors), "--mask-token-id", "16", *extra]
    args = ap.parse_args(argv)
    args.resume = None
    return args


def random_batches(n: int, a, rng: np.random.Generator):
    out = []
    for _ in range(n):
        seqs = []
        for _ in range(a.batch_size):
            s = int(rng.integers(300, a.max_len + 1))
            p = int(rng.integers(20, s // 2))
            ids = rng.integers(100, 49000, size=s)
            lm = np.zeros(s, dtype=bool)
            lm[p:] = True
            seqs.append((ids, lm))
        out.append(collate(seqs, num_anchors=a.num_anchors, block_size=16, mask_token_id=16, gamma=4.0,
                           rng=rng))
    return out


def step(tr: StreamTrainer, bt) -> None:
    loss, _, _ = tr._forward(bt, train=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tr.drafter.parameters(), 1.0)
    tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)


def run_variant(name: str, target, batches, a, work: str, prof_path=None) -> dict:
    torch.manual_seed(0)
    tr = StreamTrainer(trainer_args(VARIANT_ARGS[name], work, a), target, None, work, log_fn=lambda s: None)
    bts = [batch_to_torch(nb, tr.device) for nb in batches]
    torch.cuda.reset_peak_memory_stats()
    sync()
    t = time.time()
    for bt in bts[:a.warmup]:
        step(tr, bt)
    sync()
    warm_s = time.time() - t
    times = []
    for i in range(a.steps):
        bt = bts[a.warmup + i % (len(bts) - a.warmup)]
        sync()
        t = time.time()
        step(tr, bt)
        sync()
        times.append(time.time() - t)
    ms = 1000 * float(np.median(times))
    blk = float(np.mean([nb["block_valid"].sum() * 16 for nb in batches]))
    res = {"variant": name, "warmup_s": round(warm_s, 2), "ms_per_step_median": round(ms, 2),
           "ms_per_step_min": round(1000 * min(times), 2), "ms_per_step_max": round(1000 * max(times), 2),
           "block_tok_per_s": round(blk / (ms / 1000)), "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if prof_path:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for bt in bts[a.warmup:a.warmup + 3]:
                step(tr, bt)
            sync()
        with open(prof_path, "a") as f:
            f.write(f"==== {name}: 3 steps\n")
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="dense,flex,flex+compile")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-anchors", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1040)
    ap.add_argument("--target-dtype", default="float32")
    ap.add_argument("--work", default="/tmp/bench_train")
    ap.add_argument("--json", default=None)
    ap.add_argument("--choice-file", default=None)
    ap.add_argument("--profile", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_train measures the GPU trainer: no CUDA device here")
    torch.backends.cuda.matmul.allow_tf32 = True
    target = random_smollm2(getattr(torch, a.target_dtype), "cuda")
    batches = random_batches(a.warmup + 8, a, np.random.default_rng(0))
    results = []
    variants = [v for v in a.variants.split(",") if v]
    for i, name in enumerate(variants):
        try:
            r = run_variant(name, target, batches, a, a.work, a.profile if i == 0 else None)
        except Exception as e:  # a variant that cannot run here is reported, not fatal
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(r), flush=True)
        results.append(r)
        write_summary(results, a)  # after every variant: a timeout keeps what was measured
    best = write_summary(results, a)
    if best and a.profile and best != variants[0]:
        run_variant(best, target, batches, a, a.work, a.profile)
    print(json.dumps({"best": best}), flush=True)


def write_summary(results, a):
    ok = [r for r in results if "ms_per_step_median" in r]
    best = min(ok, key=lambda r: r["ms_per_step_median"])["variant"] if ok else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "best": best}, f, indent=1)
    if a.choice_file and best:
        with open(a.choice_file, "w") as f:
            f.write(" ".join(VARIANT_ARGS[best]) + "\n")
    return best


if __name__ == "__main__":
    main()
