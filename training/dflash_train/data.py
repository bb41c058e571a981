"""Prompt data: ShareGPT parsing, filtering, dedupe, split (no torch needed).

Prompt records (one JSON object per line):
  {"prompt": "..."}                                   single user turn
  {"messages": [{"role": "user", "content": ...},
                {"role": "assistant", "content": ...},
                ..., {"role": "user", "content": ...}]}  later turn with its context
The target regenerates the assistant reply to the final user turn; only that
reply is trained on (the context's assistant turns are ShareGPT's, not the
target's, and never get loss).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import zipfile
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import numpy as np

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "assistant": "assistant", "model": "assistant",
    "system": "system",
}

SHAREGPT_MEMBER_SUFFIX = ".json"


# ---------------------------------------------------------------------------- reading
def _read_sharegpt_text(path: str) -> str:
    """The ShareGPT JSON text, from a .json file or from inside a wheel/zip."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(SHAREGPT_MEMBER_SUFFIX)
                     and "/data/" in n]
            if not names:
                raise FileNotFoundError(f"no data/*.json member in {path}")
            names.sort(key=lambda n: -zf.getinfo(n).file_size)
            with zf.open(names[0]) as f:
                return io.TextIOWrapper(f, encoding="utf-8").read()
    with open(path, "r", encoding="utf-8") as f:
        return f.read()


def iter_json_array(text: str) -> Iterator[dict]:
    """Yield the objects of a top-level JSON array one by one.  Stops cleanly
    at a truncated tail (the packaged ShareGPT file is cut mid-record)."""
    dec = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = text.index("[") + 1
    n = len(text)
    while True:
        i = ws.match(text, i).end()
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final record
        yield obj


def load_sharegpt(path: str) -> List[dict]:
    return list(iter_json_array(_read_sharegpt_text(path)))


def split_id(rec_id: str) -> Tuple[str, int]:
    """ShareGPT 'split' ids look like ``<root>_<piece>``: pieces of one long
    conversation.  Returns (root, piece) (piece 0 when there is no suffix)."""
    root, sep, tail = str(rec_id).rpartition("_")
    if sep and tail.isdigit():
        return root, int(tail)
    return str(rec_id), 0


def normalize_messages(conv: Sequence[dict]) -> List[dict]:
    out = []
    for t in conv or []:
        role = ROLE_MAP.get(str(t.get("from", "")).lower())
        if role is None:
            continue
        out.append({"role": role, "content": str(t.get("value") or "")})
    return out


def rejoin_conversations(records: Iterable[dict]) -> Dict[str, List[dict]]:
    """root id -> messages of the consecutive pieces 0,1,2,... (stops at a gap)."""
    pieces: Dict[str, Dict[int, List[dict]]] = {}
    for r in records:
        root, k = split_id(r.get("id", ""))
        pieces.setdefault(root, {})[k] = normalize_messages(r.get("conversations"))
    out = {}
    for root, ps in pieces.items():
        msgs: List[dict] = []
        k = 0
        while k in ps:
            msgs.extend(ps[k])
            k += 1
        if msgs:
            out[root] = msgs
    return out


# ---------------------------------------------------------------------------- helpers
def norm_key(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def hash_key(obj) -> str:
    return hashlib.sha1(json.dumps(obj, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def truncate_chars(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    sp = cut.rfind(" ")
    if sp > max_chars * 0.8:
        cut = cut[:sp]
    return cut.rstrip()


def approx_token_counter(texts: Sequence[str]) -> List[int]:
    """Fallback when no tokenizer is available: ~3.6 characters per token."""
    return [int(len(t) / 3.6) + 1 for t in texts]


# Template overhead estimate per message (<|im_start|>role\n ... <|im_end|>\n) and
# per prompt (default system prompt + assistant header).  The regeneration step
# re-checks the exact templated length.
PER_MESSAGE_OVERHEAD = 6
PER_PROMPT_OVERHEAD = 32


def record_messages(rec: dict) -> List[dict]:
    if "messages" in rec:
        return [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    return [{"role": "user", "content": rec["prompt"]}]


# ---------------------------------------------------------------------------- building
def build_prompt_sets(
    convs: Dict[str, List[dict]],
    count_tokens: Callable[[Sequence[str]], List[int]],
    *,
    seed: int = 0,
    n_heldout: int = 500,
    max_prompt_tokens: int = 1000,
    max_train: int = 40000,
    heldout_max_chars: int = 2000,
    min_chars: int = 2,
    with_context: bool = True,
    max_context_messages: int = 7,
) -> Tuple[List[dict], List[dict], Dict[str, int]]:
    """Returns (heldout records, train records, stats).

    * First turns: the first user message of each conversation (a leading system
      message is skipped), non-empty, <= max_prompt_tokens, deduplicated on
      normalised text, shuffled with ``seed``.
    * Held-out: the first ``n_heldout`` of those (truncated to
      ``heldout_max_chars`` characters); their whole conversations (root ids) are
      excluded from training, and so is any training prompt with the same text.
    * Train: the remaining first turns first (shuffled), then -- if
      ``with_context`` -- later user turns with their preceding context (as many
      preceding user/assistant pairs as fit in max_prompt_tokens, at most
      ``max_context_messages`` messages, at least one pair), deduplicated and
      shuffled; capped at ``max_train`` in total.
    """
    rng = np.random.default_rng(seed)
    roots = sorted(convs)
    stats: Dict[str, int] = {"conversations": len(roots)}

    # token counts per message, computed once
    all_msgs = [(r, j) for r in roots for j in range(len(convs[r]))]
    counts = count_tokens([convs[r][j]["content"] for r, j in all_msgs])
    ntok = {key: c for key, c in zip(all_msgs, counts)}

    # ---- first turns
    first: List[Tuple[str, str]] = []
    for r in roots:
        msgs = convs[r]
        j = 0
        while j < len(msgs) and msgs[j]["role"] == "system":
            j += 1
        if j < len(msgs) and msgs[j]["role"] == "user":
            text = msgs[j]["content"].strip()
            if len(text) < min_chars:
                continue
            if ntok[(r, j)] + PER_MESSAGE_OVERHEAD + PER_PROMPT_OVERHEAD > max_prompt_tokens:
                continue
            first.append((r, text))
    stats["first_turn_candidates"] = len(first)
    order = rng.permutation(len(first))
    seen = set()
    first_u: List[Tuple[str, str]] = []
    for i in order:
        r, t = first[i]
        k = norm_key(t)
        if k in seen:
            continue
        seen.add(k)
        first_u.append((r, t))
    stats["first_turn_unique"] = len(first_u)

    heldout = first_u[:n_heldout]
    held_keys = {norm_key(t) for _, t in heldout}
    # exclude every conversation whose first user turn equals a held-out prompt
    # (also duplicates of it under other root ids)
    held_roots = {r for r, _ in heldout} | {r for r, t in first if norm_key(t) in held_keys}
    heldout_recs = [{"prompt": truncate_chars(t, heldout_max_chars)} for _, t in heldout]

    train: List[dict] = []
    for r, t in first_u[n_heldout:]:
        if r in held_roots or norm_key(t) in held_keys:
            continue
        train.append({"prompt": t})
    stats["train_first_turn"] = len(train)

    # ---- later turns with context
    ctx_recs: List[dict] = []
    if with_context:
        seen_ctx = set()
        for r in roots:
            if r in held_roots:
                continue
            msgs = convs[r]
            for j in range(1, len(msgs)):
                if msgs[j]["role"] != "user" or len(msgs[j]["content"].strip()) < min_chars:
                    continue
                # need at least one preceding (user, assistant) pair
                if j < 2 or msgs[j - 1]["role"] != "assistant" or msgs[j - 2]["role"] != "user":
                    continue
                budget = max_prompt_tokens - PER_PROMPT_OVERHEAD
                used = ntok[(r, j)] + PER_MESSAGE_OVERHEAD
                start = j
                s = j - 2
                while s >= 0 and (j - s + 1) <= max_context_messages:
                    if (msgs[s]["role"] != "user" or msgs[s + 1]["role"] != "assistant"
                            or not msgs[s]["content"].strip() or not msgs[s + 1]["content"].strip()):
                        break
                    add = ntok[(r, s)] + ntok[(r, s + 1)] + 2 * PER_MESSAGE_OVERHEAD
                    if used + add > budget:
                        break
                    used += add
                    start = s
                    s -= 2
                if start == j:
                    continue
                window = [{"role": m["role"], "content": m["content"].strip()} for m in msgs[start:j + 1]]
                h = hash_key([[m["role"], norm_key(m["content"])] for m in window])
                if h in seen_ctx:
                    continue
                seen_ctx.add(h)
                ctx_recs.append({"messages": window})
        stats["context_candidates"] = len(ctx_recs)
        perm = rng.permutation(len(ctx_recs))
        ctx_recs = [ctx_recs[i] for i in perm]

    room = max(0, max_train - len(train))
    train = train[:max_train] + ctx_recs[:room]
    stats["train_context"] = min(room, len(ctx_recs))
    stats["train_total"] = len(train)
    stats["heldout"] = len(heldout_recs)
    return heldout_recs, train, stats


# ---------------------------------------------------------------------------- I/O
def write_jsonl(path: str, recs: Iterable[dict]) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    kw = {"compresslevel": 9} if path.endswith(".gz") else {}
    with opener(path, "wt", encoding="utf-8", **kw) as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: str) -> List[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
