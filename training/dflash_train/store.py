"""Storage of regenerated training sequences (pure numpy).

A regeneration run writes shards ``regen_<tag>_<k>.npz`` (np.savez_compressed)
into a directory.  Each shard holds n sequences:
  tokens      uint16 (int32 if the vocab needs it)  all sequences concatenated
  offsets     int64  [n+1]  sequence i = tokens[offsets[i]:offsets[i+1]]
  prompt_lens int32  [n]    loss mask = positions >= prompt_len (the assistant span)
  prompt_idx  int64  [n]    line index in the prompt file (resume key)
  sampled     uint8  [n]    1 = sampled response, 0 = greedy
  finished    uint8  [n]    1 = response ended with an EOS token
  meta        str           JSON (target, max_new_tokens, ...)
Sequence = prompt ids (chat template incl. the assistant header) + response ids
(incl. the final EOS when produced).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np


def write_shard(path: str, records: Sequence[Tuple[int, Sequence[int], Sequence[int], bool, bool]],
                meta: Optional[Dict] = None) -> int:
    """records: (prompt_idx, prompt_ids, response_ids, sampled, finished).
    Writes atomically; returns the number of tokens written."""
    seqs = [np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64)])
            for _, p, r, _, _ in records]
    lens = np.array([s.size for s in seqs], dtype=np.int64)
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    tokens = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if (tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < 65536)) else np.int32
    tmp = path + ".tmp.npz"
    np.savez_compressed(
        tmp,
        tokens=tokens.astype(dtype),
        offsets=offsets,
        prompt_lens=np.array([len(p) for _, p, _, _, _ in records], dtype=np.int32),
        prompt_idx=np.array([r[0] for r in records], dtype=np.int64),
        sampled=np.array([bool(r[3]) for r in records], dtype=np.uint8),
        finished=np.array([bool(r[4]) for r in records], dtype=np.uint8),
        meta=np.array(json.dumps(meta or {})),
    )
    os.replace(tmp, path)
    return int(tokens.size)


def shard_paths(dirs: Iterable[str]) -> List[str]:
    out: List[str] = []
    for d in dirs:
        if d and os.path.isdir(d):
            out.extend(sorted(glob.glob(os.path.join(d, "regen_*.npz"))))
        elif d and os.path.isfile(d):
            out.append(d)
    # the same shard may be reachable twice (carried in and re-listed); dedupe by name
    seen, uniq = set(), []
    for p in out:
        b = os.path.basename(p)
        if b not in seen and not b.endswith(".tmp.npz"):
            seen.add(b)
            uniq.append(p)
    return uniq


def load_sequences(dirs: Iterable[str], max_len: Optional[int] = None, min_response: int = 2):
    """Load all shards.  Returns (list of (ids int64 [S], loss_mask bool [S], sampled bool), stats).
    Sequences longer than ``max_len`` are truncated on the right (the response is cut);
    sequences with fewer than ``min_response`` response tokens are dropped."""
    seqs: List[Tuple[np.ndarray, np.ndarray, bool]] = []
    seen_idx = set()
    n_sampled = n_tokens = n_resp = 0
    for p in shard_paths(dirs):
        with np.load(p, allow_pickle=False) as z:
            tok = z["tokens"].astype(np.int64)
            off, pl, pidx, smp = z["offsets"], z["prompt_lens"], z["prompt_idx"], z["sampled"]
        for i in range(pl.shape[0]):
            key = int(pidx[i])
            if key in seen_idx:
                continue
            seen_idx.add(key)
            ids = tok[off[i]:off[i + 1]]
            if max_len is not None and ids.size > max_len:
                ids = ids[:max_len]
            plen = int(pl[i])
            if ids.size - plen < min_response:
                continue
            lm = np.zeros(ids.size, dtype=bool)
            lm[plen:] = True
            seqs.append((ids, lm, bool(smp[i])))
            n_sampled += int(smp[i])
            n_tokens += ids.size
            n_resp += ids.size - plen
    stats = {"sequences": len(seqs), "sampled": n_sampled, "tokens": n_tokens,
             "response_tokens": n_resp}
    return seqs, stats


def done_prompt_indices(dirs: Iterable[str]) -> set:
    done = set()
    for p in shard_paths(dirs):
        with np.load(p, allow_pickle=False) as z:
            done.update(int(x) for x in z["prompt_idx"])
    return done


# ---------------------------------------------------------------------------- conversation shards
# gen_data.py writes one record per conversation: the whole token sequence (chat template, user
# turns, the target's answers) and the [start, end) spans of the target's answers (the loss
# mask).  Arrays: tokens, offsets [n+1], spans int32 [m, 2], span_offsets [n+1], conv_id int64,
# sampled uint8 (T=1 answers), finished uint8 (last answer ended with EOS), magpie uint8, meta.
def write_conv_shard(path: str, records: Sequence[dict], meta: Optional[Dict] = None) -> int:
    """records: dicts with ids, spans [(s, e)], cid, sampled, finished, magpie.  Atomic."""
    lens = np.array([len(r["ids"]) for r in records], dtype=np.int64)
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    nsp = np.array([len(r["spans"]) for r in records], dtype=np.int64)
    span_off = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum(nsp, out=span_off[1:])
    spans = np.array([s for r in records for s in r["spans"]], dtype=np.int32).reshape(-1, 2)
    tokens = (np.concatenate([np.asarray(r["ids"], dtype=np.int64) for r in records])
              if records else np.zeros(0, dtype=np.int64))
    dtype = np.uint16 if (tokens.size == 0 or tokens.max() < 65536) else np.int32
    tmp = path + ".tmp.npz"
    np.savez_compressed(
        tmp, tokens=tokens.astype(dtype), offsets=offsets, spans=spans, span_offsets=span_off,
        conv_id=np.array([r["cid"] for r in records], dtype=np.int64),
        sampled=np.array([bool(r["sampled"]) for r in records], dtype=np.uint8),
        finished=np.array([bool(r["finished"]) for r in records], dtype=np.uint8),
        magpie=np.array([bool(r["magpie"]) for r in records], dtype=np.uint8),
        meta=np.array(json.dumps(meta or {})))
    os.replace(tmp, path)
    return int(tokens.size)


def conv_shard_paths(d: str) -> List[str]:
    if not os.path.isdir(d):
        return []
    return sorted(p for p in glob.glob(os.path.join(d, "conv_*.npz")) if not p.endswith(".tmp.npz"))


def read_conv_shard(path: str, max_len: Optional[int] = None) -> List[dict]:
    """-> [{ids int64, loss_mask bool, first_span (s, e), cid, sampled, finished, magpie}];
    sequences are cut at ``max_len``; records without a response token left are dropped."""
    out = []
    with np.load(path, allow_pickle=False) as z:
        tok = z["tokens"].astype(np.int64)
        off, spans, soff = z["offsets"], z["spans"], z["span_offsets"]
        cid, smp, fin, mag = z["conv_id"], z["sampled"], z["finished"], z["magpie"]
    for i in range(cid.shape[0]):
        ids = tok[off[i]:off[i + 1]]
        if max_len is not None and ids.size > max_len:
            ids = ids[:max_len]
        lm = np.zeros(ids.size, dtype=bool)
        sp = spans[soff[i]:soff[i + 1]]
        for s, e in sp:
            lm[s:min(e, ids.size)] = True
        if lm.sum() < 2 or not len(sp):
            continue
        out.append({"ids": ids, "loss_mask": lm, "first_span": (int(sp[0][0]), int(sp[0][1])),
                    "cid": int(cid[i]), "sampled": bool(smp[i]), "finished": bool(fin[i]),
                    "magpie": bool(mag[i])})
    return out
