"""Regenerate responses with the frozen target (batched HF generation).

    python -m dflash_train.regenerate --target /path/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts train_prompts.jsonl.gz --out-dir RUN/regen --time-limit-s 300

* prompts are processed in file order, in chunks (default 4096); inside a chunk
  they are split by mode (greedy / sampled) and sorted by length to limit
  padding; batch size = min(--max-batch, --token-budget // (longest prompt +
  max_new_tokens)); the batch is halved automatically on CUDA OOM;
* a deterministic share (--sample-frac, default 0.25) of prompts is sampled
  (T=0.8, top-p 0.95, no top-k), the rest greedy;
* output: regen_<tag>_<k>.npz shards (see store.py), flushed every --flush-s
  seconds and at the end; resumable: prompts already present in --out-dir (or
  in --done-dirs) are skipped;
* --time-limit-s: no new batch is started unless it is expected to finish
  before the limit (the estimate is the slowest recent batch x 1.15).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib
from typing import List, Optional, Sequence

import numpy as np
import torch

from .data import read_jsonl, record_messages
from .store import done_prompt_indices, write_shard
from .target import chat_prompt_ids, eos_token_ids, load_target, load_tokenizer


def is_sampled(idx: int, seed: int, frac: float) -> bool:
    """Deterministic per-prompt choice (stable across resumes)."""
    h = zlib.crc32(f"{seed}:{idx}".encode()) / 2**32
    return h < frac


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("regeneration")
    g.add_argument("--prompts", required=False, help="prompt .jsonl[.gz]")
    g.add_argument("--max-new-tokens", type=int, default=320)
    g.add_argument("--max-prompt-tokens", type=int, default=1024)
    g.add_argument("--sample-frac", type=float, default=0.25)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--max-batch", type=int, default=1024)
    g.add_argument("--token-budget", type=int, default=1_000_000,
                   help="batch * (longest prompt + max_new_tokens) cap")
    g.add_argument("--chunk", type=int, default=4096)
    g.add_argument("--flush-s", type=float, default=60.0)
    g.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0 = all)")
    g.add_argument("--regen-seed", type=int, default=0)


class Regenerator:
    def __init__(self, model, tok, args, out_dir: str, tag: Optional[str] = None, log=print):
        self.model, self.tok, self.args, self.out_dir = model, tok, args, out_dir
        self.tag = tag or time.strftime("%Y%m%d%H%M%S")
        self.eos = eos_token_ids(model, tok)
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos[0]
        self.device = next(model.parameters()).device
        self.pending: List = []
        self.shard_k = 0
        self.log = log
        self.stats = {"sequences": 0, "prompt_tokens": 0, "response_tokens": 0, "finished": 0,
                      "sampled": 0, "batches": 0, "skipped_long": 0, "oom_halvings": 0}
        os.makedirs(out_dir, exist_ok=True)

    # ---- persistence
    def flush(self):
        if not self.pending:
            return
        while True:
            name = os.path.join(self.out_dir, f"regen_{self.tag}_{self.shard_k:05d}.npz")
            self.shard_k += 1
            if not os.path.exists(name):
                break
        meta = {"max_new_tokens": self.args.max_new_tokens, "temperature": self.args.temperature,
                "top_p": self.args.top_p, "eos": self.eos}
        write_shard(name, self.pending, meta)
        self.pending = []

    # ---- generation
    def _generate(self, batch_ids: Sequence[List[int]], sampled: bool, seed: int):
        from transformers import GenerationConfig

        L = max(len(x) for x in batch_ids)
        ids = torch.full((len(batch_ids), L), self.pad, dtype=torch.long)
        att = torch.zeros((len(batch_ids), L), dtype=torch.long)
        for i, x in enumerate(batch_ids):  # left padding
            ids[i, L - len(x):] = torch.tensor(x, dtype=torch.long)
            att[i, L - len(x):] = 1
        ids, att = ids.to(self.device), att.to(self.device)
        a = self.args
        if sampled:
            gc = GenerationConfig(max_new_tokens=a.max_new_tokens, do_sample=True,
                                  temperature=a.temperature, top_p=a.top_p, top_k=0,
                                  eos_token_id=self.eos, pad_token_id=self.pad)
        else:
            gc = GenerationConfig(max_new_tokens=a.max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos, pad_token_id=self.pad)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=att, generation_config=gc)
        gen = out[:, L:].cpu().numpy()
        eos = np.array(self.eos)
        res = []
        for i in range(gen.shape[0]):
            row = gen[i]
            hit = np.nonzero(np.isin(row, eos))[0]
            if hit.size:
                res.append((row[:hit[0] + 1].tolist(), True))
            else:
                res.append((row.tolist(), False))
        return res

    def run(self, prompts: List[dict], deadline: float, done: Optional[set] = None) -> dict:
        a = self.args
        done = set(done or ())
        todo = [i for i in range(len(prompts)) if i not in done]
        if a.limit:
            todo = [i for i in todo if i < a.limit]
        self.log(f"[regen] {len(todo)} prompts to do ({len(done)} already done), eos={self.eos}")
        t_last_flush = time.time()
        recent: List[float] = []
        max_batch = a.max_batch
        stop = False
        for c0 in range(0, len(todo), a.chunk):
            if stop:
                break
            chunk = todo[c0:c0 + a.chunk]
            enc = []
            for i in chunk:
                ids = chat_prompt_ids(self.tok, record_messages(prompts[i]))
                if len(ids) > a.max_prompt_tokens:
                    self.stats["skipped_long"] += 1
                    continue
                enc.append((i, ids, is_sampled(i, a.regen_seed, a.sample_frac)))
            for mode in (False, True):
                items = sorted([e for e in enc if e[2] == mode], key=lambda e: -len(e[1]))
                j = 0
                while j < len(items):
                    longest = len(items[j][1])
                    bs = max(1, min(max_batch, a.token_budget // (longest + a.max_new_tokens)))
                    batch = items[j:j + bs]
                    est = max(recent[-4:]) * 1.15 if recent else 0.0
                    if time.time() + est > deadline:
                        self.log("[regen] time limit reached")
                        stop = True
                        break
                    t0 = time.time()
                    try:
                        res = self._generate([b[1] for b in batch], mode,
                                             seed=a.regen_seed * 1000003 + batch[0][0])
                    except torch.cuda.OutOfMemoryError:
                        torch.cuda.empty_cache()
                        max_batch = max(1, bs // 2)
                        self.stats["oom_halvings"] += 1
                        self.log(f"[regen] CUDA OOM at batch {bs}; max batch -> {max_batch}")
                        continue
                    dt = time.time() - t0
                    recent.append(dt)
                    ntok = 0
                    for (i, pids, smp), (resp, fin) in zip(batch, res):
                        self.pending.append((i, pids, resp, smp, fin))
                        self.stats["sequences"] += 1
                        self.stats["prompt_tokens"] += len(pids)
                        self.stats["response_tokens"] += len(resp)
                        self.stats["finished"] += int(fin)
                        self.stats["sampled"] += int(smp)
                        ntok += len(resp)
                    self.stats["batches"] += 1
                    self.log(f"[regen] batch {self.stats['batches']} mode={'sample' if mode else 'greedy'} "
                             f"bs={len(batch)} prompt_len<={longest} {dt:.1f}s "
                             f"{ntok / max(dt, 1e-6):.0f} new tok/s total_seqs={self.stats['sequences']}")
                    j += len(batch)
                    if time.time() - t_last_flush > a.flush_s:
                        self.flush()
                        t_last_flush = time.time()
                if stop:
                    break
        self.flush()
        return self.stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF dir or .gguf file")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--done-dirs", nargs="*", default=[], help="other regen dirs whose prompts count as done")
    ap.add_argument("--time-limit-s", type=float, default=540)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_args(ap)
    args = ap.parse_args(argv)
    t_start = time.time()
    deadline = t_start + args.time_limit_s
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = load_tokenizer(args.target, args.gguf_file)
    model = load_target(args.target, args.gguf_file, args.dtype, args.device)
    prompts = read_jsonl(args.prompts)
    done = done_prompt_indices([args.out_dir] + list(args.done_dirs))
    r = Regenerator(model, tok, args, args.out_dir)
    stats = r.run(prompts, deadline, done)
    stats["seconds"] = round(time.time() - t_start, 1)
    print(json.dumps(stats))


if __name__ == "__main__":
    main()
