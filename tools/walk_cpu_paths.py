#!/usr/bin/env python3
"""Walk τ of a drafter on the texts the CPU engine's two numeric paths write (issue 14 / 11).

The CPU engine writes greedy answers to the first N MT-Bench prompts twice: with the f32
kernels (`DFLASH_MATMUL=reference`) and with the default int8 activations. The training
package then walks the drafter over each text (`training/dflash_train/walk.py`: the decoding
loop simulated on a known greedy answer) with the features of the float target, and of the
same target with the engine's int8 rounding on every projection's input (`int8_act.py`):
which of text and features costs the drafter τ on the int8 path.

Usage: python3 tools/walk_cpu_paths.py [--dflash target/release/dflash] [--model GGUF]
       [--drafter DIR] [--prompts N]      (needs torch, transformers, gguf, accelerate)
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "training"))

from dflash_train.export import load_drafter  # noqa: E402
from dflash_train.int8_act import round_projection_inputs  # noqa: E402
from dflash_train.target import (chat_prompt_ids, embedding_weight, lm_head_weight, load_target,  # noqa: E402
                                 load_tokenizer)
from dflash_train.walk import walk_tau  # noqa: E402

def answers(dflash, model, prompts, mode, max_new):
    env = dict(os.environ, DFLASH_MATMUL=mode)
    out = []
    for p in prompts:
        r = subprocess.run([dflash, "generate", "-m", model, "--device", "cpu", "--no-draft", "-n", str(max_new),
                            "--output-format", "json", p], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"walk_cpu_paths: dflash generate failed (DFLASH_MATMUL={mode}): {r.stderr.strip()[-500:]}")
        out.append(json.loads(r.stdout)["tokens"])
    return out


def walk_args(description, prompts):
    """The arguments of a walk over the CPU engine's answers: the binary, model and drafter (with
    this repository's defaults), the number of MT-Bench prompts and the answer length. Parse with
    `parse_walk_args`."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dflash", default=os.path.join(REPO, "target/release/dflash"))
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/dflash/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--drafter", default=os.path.join(REPO, "models/drafters/smollm2-135m-instruct-dflash"))
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-new", type=int, default=256)
    return ap


def parse_walk_args(ap):
    """The parsed arguments, with a clear error where the binary, model or drafter is missing."""
    a = ap.parse_args()
    for what, path in (("dflash binary (cargo build --release -p dflash-cli)", a.dflash), ("model", a.model),
                       ("drafter directory", a.drafter)):
        if not os.path.exists(path):
            ap.error(f"{what} not found: {path}")
    return a


def main():
    a = parse_walk_args(walk_args(__doc__, prompts=40))
    torch.set_num_threads(os.cpu_count() or 1)
    with open(os.path.join(REPO, "data/mt_bench_first_turns.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in f][:a.prompts]
    texts = {mode: answers(a.dflash, a.model, prompts, mode, a.max_new) for mode in ("reference", "auto")}
    same = [x == y for x, y in zip(texts["reference"], texts["auto"])]
    parts = sorted(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                   for x, y, s in zip(texts["reference"], texts["auto"], same) if not s)
    print(f"identical answers {sum(same)} of {len(prompts)}; the others part at token {parts}")
    target = load_target(a.model, None, "float32", "cpu")
    tok = load_tokenizer(a.model)
    emb, head = embedding_weight(target), lm_head_weight(target)
    drafter, _ = load_drafter(a.drafter, torch.float32, "cpu")
    recs = {}
    for mode, answers_ in texts.items():
        recs[mode] = []
        for p, ans in zip(prompts, answers_):
            ids = chat_prompt_ids(tok, [{"role": "user", "content": p}])
            recs[mode].append({"ids": np.array(ids + ans, dtype=np.int64), "first_span": (len(ids), len(ids) + len(ans))})

    for feats in ("float", "int8"):
        hooks = round_projection_inputs(target) if feats == "int8" else []
        for mode, rs in recs.items():
            t = time.time()
            w = walk_tau(drafter, target, emb, head, rs, max_new=a.max_new, batch=16)
            print(f"text {'f32' if mode == 'reference' else 'int8'} path, features {feats}: walk tau "
                  f"{w['walk_tau']:.4f} rounds {w['walk_rounds']} tokens {w['walk_tokens']} "
                  f"slots {w['walk_accept_by_slot'][:4]} ({time.time() - t:.0f} s)", flush=True)
        for h in hooks:
            h.remove()


if __name__ == "__main__":
    main()
