#!/usr/bin/env python3
"""Rank a target's tokens by how often the target writes them: the drafter's vocabulary
shortlist (draft_vocab.safetensors, read by `dflash --draft-vocab N`).

Two steps:

  prompts  Writes a `dflash generate --batch` file from the first user turns of the training
           conversations (ShareGPT user text; the held-out split and MT-Bench are never used).
  rank     Counts the token ids of the target's answers (the `tokens` of
           `dflash generate --batch FILE --no-draft --output-format jsonl` lines) and writes the
           ranked ids: the target's end tokens first (from the GGUF: eos / eot), then every
           counted token by count (ties by id), then the unseen ones by id (BPE ids follow the
           merge order, roughly the tokenizer corpus's frequency). Only the first --keep ids
           are written (one I32 tensor `ids`).

Example (the shipped ranking):

  python3 tools/rank_draft_vocab.py prompts --convs /work/data/train_convs.jsonl.gz \\
      --count 960 --per-file 120 --out-dir /tmp/rank
  for f in /tmp/rank/prompts_*.jsonl; do
    dflash generate --device cpu --no-draft --batch "$f" --output-format jsonl > "${f/prompts/out}"
  done
  python3 tools/rank_draft_vocab.py rank --model SmolLM2-135M-Instruct.Q4_1.gguf \\
      --out models/drafters/smollm2-135m-instruct-dflash/draft_vocab.safetensors /tmp/rank/out_*.jsonl
"""

import argparse
import collections
import gzip
import json
import pathlib
import sys

import numpy as np
from safetensors.numpy import save_file


def cmd_prompts(a):
    rows = []
    with gzip.open(a.convs, "rt") as f:
        for line in f:
            turns = json.loads(line).get("turns") or []
            if not turns:
                continue
            p = turns[0].strip()
            if a.min_chars < len(p) <= a.max_chars:
                rows.append(p)
            if len(rows) >= a.count:
                break
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(rows), a.per_file):
        with open(out / f"prompts_{i // a.per_file}.jsonl", "w") as o:
            for p in rows[i : i + a.per_file]:
                o.write(json.dumps({"prompt": p, "max_tokens": a.max_tokens}) + "\n")
    print(f"{len(rows)} prompts in {out}", file=sys.stderr)


def end_tokens(model):
    from gguf import GGUFReader

    r = GGUFReader(model)
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    ends = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        f = r.fields.get(key)
        if f is not None:
            v = int(f.parts[f.data[0]][0])
            if v < vocab and v not in ends:
                ends.append(v)
    return vocab, ends


def cmd_rank(a):
    vocab, ends = end_tokens(a.model)
    ends += [i for i in a.always if i not in ends]
    counts = collections.Counter()
    answers = 0
    for path in a.outputs:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    counts.update(json.loads(line)["tokens"])
                    answers += 1
    total = sum(counts.values())
    if total == 0:
        sys.exit("no tokens counted: pass the jsonl output of `dflash generate --batch`")
    bad = [i for i in list(counts) + ends if not 0 <= i < vocab]
    if bad:
        sys.exit(f"token ids {bad[:5]} are outside the model's {vocab}-token vocabulary")
    head = list(ends)
    seen = set(head)
    for i, _ in sorted(counts.items(), key=lambda x: (-x[1], x[0])):
        if i not in seen:
            head.append(i)
            seen.add(i)
    head += [i for i in range(vocab) if i not in seen]
    keep = min(a.keep, vocab)
    ids = np.array(head[:keep], dtype=np.int32)
    meta = {
        "source": "token counts of target (AR) answers to training-split prompts",
        "answers": str(answers),
        "counted_tokens": str(total),
        "distinct_tokens": str(len(counts)),
        "end_tokens": json.dumps(ends),
        "vocab": str(vocab),
    }
    save_file({"ids": ids}, a.out, metadata=meta)
    print(f"{answers} answers, {total} tokens, {len(counts)} distinct; wrote {keep} ids to {a.out}")
    for k in (1024, 2048, 4096, 8192, 16384):
        if k <= keep:
            covered = sum(counts[i] for i in head[:k])
            print(f"top {k:>5}: {100.0 * covered / total:.2f}% of counted tokens")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("prompts", help="write generate --batch files of training prompts")
    q.add_argument("--convs", required=True, help="training conversations (jsonl.gz, `turns`)")
    q.add_argument("--count", type=int, default=960)
    q.add_argument("--per-file", type=int, default=120)
    q.add_argument("--min-chars", type=int, default=10)
    q.add_argument("--max-chars", type=int, default=1200)
    q.add_argument("--max-tokens", type=int, default=192)
    q.add_argument("--out-dir", required=True)
    r = sub.add_parser("rank", help="rank token ids of the target's answers")
    r.add_argument("--model", required=True, help="the target GGUF (vocabulary, end tokens)")
    r.add_argument("--out", required=True, help="draft_vocab.safetensors to write")
    r.add_argument("--keep", type=int, default=16384, help="ids written (most frequent first)")
    r.add_argument("--always", type=int, nargs="*", default=[], help="more ids ranked first")
    r.add_argument("outputs", nargs="+", help="jsonl of `dflash generate --batch`")
    a = p.parse_args()
    (cmd_prompts if a.cmd == "prompts" else cmd_rank)(a)


if __name__ == "__main__":
    main()
