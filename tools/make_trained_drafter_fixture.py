#!/usr/bin/env python3
"""Teacher-forced drafts of the shipped drafter, computed by the training package in PyTorch.

For a few regenerated sequences (training/data/regen), the target's tapped features come from
transformers (the GGUF dequantized, float32), the drafter from `dflash_train` loading the shipped
export; for anchors inside the response, the block [token_a, MASK x 15] is drafted with the
context strictly before a. The Rust test feeds the same tokens through our target and drafter
and must produce the same drafts (crates/models/tests/trained_drafter.rs).

Usage: python3 tools/make_trained_drafter_fixture.py [--model GGUF] [--out JSON]
"""

import argparse
import glob
import json
import os
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "training"))

from dflash_train.export import load_drafter  # noqa: E402
from dflash_train.target import embedding_weight, lm_head_weight, load_target, target_features  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/dflash/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--drafter", default=os.path.join(REPO, "models/drafters/smollm2-135m-instruct-dflash"))
    ap.add_argument("--out", default=os.path.join(REPO, "crates/models/tests/fixtures/trained_drafter_tf.json"))
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--anchors", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    shard = sorted(glob.glob(os.path.join(REPO, "training/data/regen/*.npz")))[-1]
    d = np.load(shard, allow_pickle=True)
    model = load_target(args.model, dtype="float32", device="cpu")
    drafter, cfg = load_drafter(args.drafter)
    drafter.eval()
    emb, head = embedding_weight(model).float(), lm_head_weight(model).float()
    bs, mask_id = cfg.block_size, cfg.mask_token_id
    cases = []
    for si in range(args.sequences):
        toks = d["tokens"][d["offsets"][si]:d["offsets"][si + 1]].astype(np.int64)
        pl = int(d["prompt_lens"][si])
        feats = target_features(model, torch.tensor(toks)[None], None, cfg.target_layer_ids, early_exit=False)
        anchors = list(range(pl, len(toks) - bs, 11))[: args.anchors]
        for a in anchors:
            blk = torch.tensor([int(toks[a])] + [mask_id] * (bs - 1))[None]
            with torch.no_grad():
                h = drafter(torch.nn.functional.embedding(blk, emb), torch.arange(a, a + bs)[None],
                            feats[:, :a], torch.arange(a)[None], None)
                logits = h[0, 1:] @ head.T
            top = torch.topk(logits, 2, dim=-1)
            cases.append({
                "tokens": toks[: a + 1].tolist(),
                "drafts": top.indices[:, 0].tolist(),
                "margins": (top.values[:, 0] - top.values[:, 1]).tolist(),
            })
    meta = {
        "generator": "tools/make_trained_drafter_fixture.py",
        "drafter": os.path.relpath(args.drafter, REPO),
        "data": os.path.relpath(shard, REPO),
        "torch": torch.__version__,
        "target_dtype": "float32",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "block_size": bs, "cases": cases}, f)
    print(f"wrote {len(cases)} cases to {args.out}")


if __name__ == "__main__":
    main()
