#!/usr/bin/env python3
"""Walk τ of a drafter at small blocks, drafted as such and as its trained block (issues 11, 14).

The engine drafts a block of B tokens as [anchor, MASK x (B - 1)]: a drafter trained on blocks
of 16 then sees fewer masks than in training. This tool makes the CPU engine write greedy
answers to the first N MT-Bench prompts (its default numeric path, as in live decoding), then
walks the drafter over them (`training/dflash_train/walk.py`: the decoding loop simulated on a
known greedy answer) for pairs DRAFT:VERIFY, a round feeding DRAFT positions and keeping at
most VERIFY - 1 drafts: `2:2` is what the engine does at block 2, `16:2` the same verification
with the drafter fed its whole trained block. Prints walk τ and the acceptance by slot.

Usage: python3 tools/walk_blocks.py [--dflash target/release/dflash] [--model GGUF]
       [--drafter DIR] [--prompts N] [--max-new T] [--pairs 2:2,16:2,...]
       (needs torch, transformers, gguf, accelerate)
"""

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "training"))

from dflash_train.export import load_drafter  # noqa: E402
from dflash_train.target import (chat_prompt_ids, embedding_weight, lm_head_weight, load_target,  # noqa: E402
                                 load_tokenizer)
from dflash_train.walk import walk_tau  # noqa: E402
from walk_cpu_paths import answers, parse_walk_args, walk_args  # noqa: E402  (tools/)


def pairs_arg(text):
    """"2:2,16:2" -> [(2, 2), (16, 2)], each VERIFY <= DRAFT."""
    out = []
    for item in text.split(","):
        try:
            d, v = (int(x) for x in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected DRAFT:VERIFY, e.g. 16:2")
        if not 2 <= v <= d:
            raise argparse.ArgumentTypeError(f"{item!r}: VERIFY must be 2..DRAFT")
        out.append((d, v))
    return out


def main():
    ap = walk_args(__doc__, prompts=24)
    ap.add_argument("--pairs", type=pairs_arg, default=pairs_arg("2:2,16:2,4:4,16:4,16:16"))
    a = parse_walk_args(ap)
    torch.set_num_threads(os.cpu_count() or 1)
    with open(os.path.join(REPO, "data/mt_bench_first_turns.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    t = time.time()
    texts = answers(a.dflash, a.model, prompts, "auto", a.max_new)  # the default numeric path
    print(f"{len(texts)} greedy answers, {sum(map(len, texts))} tokens ({time.time() - t:.0f} s)", flush=True)
    target = load_target(a.model, None, "float32", "cpu")
    tok = load_tokenizer(a.model)
    emb, head = embedding_weight(target), lm_head_weight(target)
    drafter, _ = load_drafter(a.drafter, torch.float32, "cpu")
    if max(d for d, _ in a.pairs) > drafter.cfg.block_size:
        sys.exit(f"walk_blocks: the drafter's block is {drafter.cfg.block_size}; DRAFT cannot exceed it")
    recs = []
    for p, ans in zip(prompts, texts):
        ids = chat_prompt_ids(tok, [{"role": "user", "content": p}])
        recs.append({"ids": np.array(ids + ans, dtype=np.int64), "first_span": (len(ids), len(ids) + len(ans))})
    print("| drafted | verified | walk τ | rounds | acceptance by slot 1..4 |")
    print("|---:|---:|---:|---:|---|")
    for d, v in a.pairs:
        w = walk_tau(drafter, target, emb, head, recs, max_new=a.max_new, batch=8, block=d, verify=v)
        print(f"| {d} | {v} | {w['walk_tau']:.4f} | {w['walk_rounds']} | "
              f"{' '.join(f'{x:.3f}' for x in w['walk_accept_by_slot'][:4])} |", flush=True)


if __name__ == "__main__":
    main()
