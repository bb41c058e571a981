"""Training data at scale: whole conversations answered by the target, turn by turn.

    python -m dflash_train.gen_data --target T.gguf --convs train_convs.jsonl.gz \
        --out-dir RUN/data --time-limit-s 500 [--dtype float32] [--batch 1024]

Jobs come in a fixed order: job j is a ShareGPT conversation (its user turns, from
conversations.py) or a self-written one (Magpie: the chat template up to the user header, with
a system prompt steering toward chat, code, math, writing, ..., and the target writes the user
turn at T = 1; then it answers it with the default template, as the engine's chat does).  The
target answers every user turn in order, conditioned on its own previous answers (the sequence
grows by the template's turn suffix and the next user turn).  A conversation is answered
greedily or, for a deterministic ``--sample-frac`` share, by plain T = 1 sampling.

Job j belongs to slice j // --slice-size; a slice's conversations go to one shard
``conv_s<seed>_k<slice>.npz`` (store.write_conv_shard) once all of them are done, so a shard's
inputs (which conversations, which system prompts, greedy or sampled, RNG seed) are a
deterministic function of (slice, seed); the tokens are the target's up to GPU reduction order.
``state.json`` in the out dir records the first slice not yet written; a later call resumes
there.  At the time limit, slices in flight are written as ``..._part.npz`` (their finished
conversations), replaced when the slice is redone.  Every ``--early-s`` seconds the conversations
finished since the last flush in slices still in flight go to ``..._e<n>.npz`` (so a trainer that
reads the directory starts long before the first slice is complete); the slice's full or partial
shard repeats them (readers skip conversation ids they have seen) and replaces the early files.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .conversations import eval_key, eval_keys
from .data import read_jsonl
from .fastgen import ATTENTIONS, Engine, TargetWeights, generate_loop
from .store import write_conv_shard
from .target import chat_prompt_ids, eos_token_ids, load_target, load_tokenizer, torch_dtype

SENT = "\x00SENT\x00"
SENT2 = "\x00SENT2\x00"

# System prompts used only to make the target write a user turn (Magpie).  The answer is
# generated without them (default template), as the engine formats prompts.
MAGPIE_SYSTEMS = (
    "You are a curious person chatting with an AI assistant. Ask it a question about everyday life.",
    "You are a programmer. Ask an AI assistant to write, explain or fix a piece of code.",
    "You are a student. Ask an AI assistant to solve a math problem step by step.",
    "You are a writer. Ask an AI assistant to write a story, a poem, an email or a blog post.",
    "You are a scientist. Ask an AI assistant a question about physics, chemistry, biology or engineering.",
    "You are a history and philosophy enthusiast. Ask an AI assistant about history, art, culture or ethics.",
    "You are playing a game with an AI assistant. Ask it to role-play a character or a situation.",
    "You are an analyst. Give an AI assistant a short text and ask it to extract or summarize information.",
    "You are a puzzle lover. Ask an AI assistant a reasoning or logic question.",
    "You are a business person. Ask an AI assistant for advice on work, marketing or finance.",
    "You are a teacher. Ask an AI assistant to explain a concept simply, with examples.",
    "You are planning a trip or an event. Ask an AI assistant for help and recommendations.",
)


def _h(seed: int, j: int, what: str) -> float:
    return zlib.crc32(f"{seed}:{j}:{what}".encode()) / 2**32


class Templates:
    """Token pieces of the chat template, found by rendering with sentinels."""

    def __init__(self, tok, eos: Sequence[int]):
        self.tok = tok
        self.eos_text = {int(e): tok.convert_ids_to_tokens(int(e)) for e in eos}
        ex = [{"role": "user", "content": "x"}, {"role": "assistant", "content": SENT}]
        self.tail = tok.apply_chat_template(ex + [{"role": "user", "content": SENT2}], tokenize=False,
                                            add_generation_prompt=True)
        self.tail = self.tail[self.tail.index(SENT) + len(SENT):]

    def ids(self, text: str) -> List[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, user: str) -> List[int]:
        return chat_prompt_ids(self.tok, [{"role": "user", "content": user}])

    def magpie_prefix(self, system: str) -> List[int]:
        text = self.tok.apply_chat_template([{"role": "system", "content": system},
                                             {"role": "user", "content": SENT2}], tokenize=False)
        return self.ids(text[:text.index(SENT2)])

    def _after_answer(self, last_token: int, text: str) -> str:
        e = self.eos_text.get(int(last_token))
        if e is not None and text.startswith(e):
            text = text[len(e):]
        return text

    def next_turn(self, last_token: int, user: str) -> List[int]:
        """Ids after an answer that ended with ``last_token``: turn end + user turn + assistant header."""
        return self.ids(self._after_answer(last_token, self.tail.replace(SENT2, user)))

    def next_user_header(self, last_token: int) -> List[int]:
        return self.ids(self._after_answer(last_token, self.tail[:self.tail.index(SENT2)]))


class Job:
    __slots__ = ("cid", "slice", "kind", "sampled", "turns", "system", "magpie_turns", "turn",
                 "ids", "spans", "phase", "finished", "user_ids")

    def __init__(self, cid, slc, kind, sampled, turns=None, system=None, magpie_turns=0):
        self.cid, self.slice, self.kind, self.sampled = cid, slc, kind, sampled
        self.turns, self.system, self.magpie_turns = turns or [], system, magpie_turns
        self.turn = 0
        self.ids: Optional[List[int]] = None
        self.spans: List[tuple] = []
        self.phase = "assistant"
        self.finished = False
        self.user_ids: Optional[List[int]] = None


class Scheduler:
    """The request source of fastgen.generate_loop: jobs, turns, slices and shards."""

    def __init__(self, tok, eos, convs: List[dict], out_dir: str, args, log=print):
        self.t = Templates(tok, eos)
        self.tok, self.convs, self.out_dir, self.a, self.log = tok, convs, out_dir, args, log
        self.blocked = eval_keys(args.eval) if args.eval else set()
        os.makedirs(out_dir, exist_ok=True)
        self.state_path = os.path.join(out_dir, "state.json")
        st = json.load(open(self.state_path)) if os.path.exists(self.state_path) else {}
        self.start_slice = int(st.get("next_slice", args.start_slice))
        self.next_job = self.start_slice * args.slice_size
        self.share_pos = self._share_pos_at(self.next_job)
        self.ready: collections.deque = collections.deque()
        self.open: Dict[int, int] = collections.defaultdict(int)  # slice -> jobs not closed
        self.records: Dict[int, List[dict]] = collections.defaultdict(list)
        self.full_written = set()
        self.early: Dict[int, List[str]] = collections.defaultdict(list)  # slice -> early files
        self.flushed: Dict[int, int] = collections.defaultdict(int)  # slice -> records in them
        self.stopping = False
        self.stats = {"conversations": 0, "records": 0, "answer_tokens": 0, "answers": 0, "turns_sharegpt": 0,
                      "magpie_user_turns": 0, "magpie_rejected": 0, "shards": 0, "sampled_records": 0,
                      "magpie_records": 0, "tokens": 0}

    # ---- job order (a pure function of the seed and the job index)
    def _is_share(self, j: int, pos: int) -> bool:
        return pos < len(self.convs) and _h(self.a.seed, j, "src") >= self.a.magpie_frac

    def _share_pos_at(self, j_end: int) -> int:
        pos = 0
        for j in range(j_end):
            if self._is_share(j, pos):
                pos += 1
        return pos

    def _new_job(self) -> Job:
        j = self.next_job
        self.next_job += 1
        slc = j // self.a.slice_size
        sampled = _h(self.a.seed, j, "sample") < self.a.sample_frac
        if self._is_share(j, self.share_pos):
            turns = self.convs[self.share_pos]["turns"]
            self.share_pos += 1
            job = Job(j, slc, "sharegpt", sampled, turns=turns)
        else:
            sysi = int(_h(self.a.seed, j, "sys") * len(MAGPIE_SYSTEMS))
            n = 1 + int(_h(self.a.seed, j, "turns") < self.a.magpie_followup)
            job = Job(j, slc, "magpie", sampled, system=MAGPIE_SYSTEMS[sysi], magpie_turns=n)
            job.phase = "user"
        self.open[slc] += 1
        self.stats["conversations"] += 1
        return job

    def _request(self, job: Job):
        a = self.a
        if job.kind == "magpie" and job.phase == "user":
            prompt = (self.t.magpie_prefix(job.system) if job.ids is None
                      else job.ids + self.t.next_user_header(job.ids[-1]))
            if len(prompt) + a.user_max_new + a.min_answer_room > a.max_len:
                return None
            return job, prompt, a.user_max_new, True
        if job.kind == "sharegpt":
            user = job.turns[job.turn]
            prompt = self.t.first_prompt(user) if job.ids is None else job.ids + self.t.next_turn(job.ids[-1], user)
            self.stats["turns_sharegpt"] += 1
        else:
            prompt = job.user_ids
        if job.ids is None and len(prompt) > a.max_prompt_tokens:
            return None
        if len(prompt) + a.min_answer_room > a.max_len:
            return None
        return job, prompt, a.max_new_tokens, job.sampled

    def _issue(self, job: Job):
        rq = self._request(job)
        if rq is None:
            self._close(job)
        else:
            self.ready.append(rq)

    # ---- the source interface
    def exhausted(self) -> bool:
        return self.stopping and not self.ready

    def next_request(self):
        while not self.ready:
            if self.stopping:
                return None
            lowest = min([s for s, n in self.open.items() if n > 0], default=self.next_job // self.a.slice_size)
            if self.next_job // self.a.slice_size >= lowest + self.a.max_inflight_slices:
                return None
            self._issue(self._new_job())
        return self.ready.popleft()

    def finish(self, job: Job, prompt, resp, fin: bool):
        if self.stopping and not fin:
            self._close(job)  # cut by the time limit: keep the turns that were complete
            return
        if job.kind == "magpie" and job.phase == "user":
            text = self.tok.decode(resp[:-1] if fin else resp, skip_special_tokens=True).strip()
            if not fin or len(text) < 8 or eval_key(text) in self.blocked:
                self.stats["magpie_rejected"] += 1
                self._close(job)
                return
            self.stats["magpie_user_turns"] += 1
            job.user_ids = (self.t.first_prompt(text) if job.ids is None
                            else job.ids + self.t.next_turn(job.ids[-1], text))
            job.phase = "assistant"
            self._issue(job)
            return
        if not resp:
            self._close(job)
            return
        job.ids = list(prompt) + list(resp)
        job.spans.append((len(prompt), len(job.ids)))
        job.finished = fin
        self.stats["answers"] += 1
        self.stats["answer_tokens"] += len(resp)
        job.turn += 1
        more = job.turn < (len(job.turns) if job.kind == "sharegpt" else job.magpie_turns)
        if fin and more and not self.stopping:
            if job.kind == "magpie":
                job.phase = "user"
            self._issue(job)
        else:
            self._close(job)

    def _close(self, job: Job):
        if job.spans:
            self.records[job.slice].append({"ids": job.ids, "spans": job.spans, "cid": job.cid,
                                            "sampled": job.sampled, "finished": job.finished,
                                            "magpie": job.kind == "magpie"})
        self.open[job.slice] -= 1
        self._maybe_write(job.slice)

    def _slice_issued(self, slc: int) -> bool:
        return self.next_job >= (slc + 1) * self.a.slice_size

    def _maybe_write(self, slc: int, partial: bool = False):
        if self.open[slc] > 0 or (not partial and not self._slice_issued(slc)):
            return
        recs = sorted(self.records.pop(slc, []), key=lambda r: r["cid"])
        self.open.pop(slc, None)
        name = f"conv_s{self.a.seed}_k{slc:05d}{'_part' if partial else ''}.npz"
        meta = {"seed": self.a.seed, "slice": slc, "slice_size": self.a.slice_size, "partial": partial,
                "max_new_tokens": self.a.max_new_tokens, "max_len": self.a.max_len, "dtype": self.a.dtype}
        ntok = write_conv_shard(os.path.join(self.out_dir, name), recs, meta)
        for p in self.early.pop(slc, []) + ([] if partial else [os.path.join(self.out_dir, name[:-4] + "_part.npz")]):
            if os.path.exists(p):
                os.remove(p)
        self.flushed.pop(slc, None)
        self.stats["shards"] += 1
        self.stats["records"] += len(recs)
        self.stats["tokens"] += ntok
        self.stats["sampled_records"] += sum(r["sampled"] for r in recs)
        self.stats["magpie_records"] += sum(r["magpie"] for r in recs)
        if not partial:
            self.full_written.add(slc)
            nxt = self.start_slice
            while nxt in self.full_written:
                nxt += 1
            with open(self.state_path + ".tmp", "w") as f:
                json.dump({"next_slice": nxt, "seed": self.a.seed}, f)
            os.replace(self.state_path + ".tmp", self.state_path)

    def flush_early(self):
        """Write the conversations finished since the last flush of every slice in flight."""
        for slc, recs in list(self.records.items()):
            new = recs[self.flushed[slc]:]
            if not new:
                continue
            path = os.path.join(self.out_dir, f"conv_s{self.a.seed}_k{slc:05d}_e{len(self.early[slc])}.npz")
            write_conv_shard(path, new, {"seed": self.a.seed, "slice": slc, "early": True})
            self.early[slc].append(path)
            self.flushed[slc] = len(recs)

    def close_partial(self):
        """At the time limit: write every slice in flight as a partial shard."""
        self.stopping = True
        while self.ready:
            self._close(self.ready.popleft()[0])
        for slc in sorted(set(self.open) | set(self.records)):
            if self.records.get(slc):
                self.open[slc] = 0
                self._maybe_write(slc, partial=True)


def add_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("data generation")
    g.add_argument("--convs", required=False, help="ShareGPT user-turn lists (conversations.py)")
    g.add_argument("--eval", nargs="*", default=[], help="evaluation prompt files: Magpie turns matching them are dropped")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slice-size", type=int, default=1024)
    g.add_argument("--start-slice", type=int, default=0)
    g.add_argument("--max-inflight-slices", type=int, default=4)
    g.add_argument("--magpie-frac", type=float, default=0.5, help="Magpie share while ShareGPT lasts (then 1)")
    g.add_argument("--magpie-followup", type=float, default=0.3, help="share of Magpie jobs with a second turn")
    g.add_argument("--sample-frac", type=float, default=0.2, help="conversations answered at T=1")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--user-max-new", type=int, default=160)
    g.add_argument("--max-prompt-tokens", type=int, default=768)
    g.add_argument("--max-len", type=int, default=1024, help="conversation length cap (tokens)")
    g.add_argument("--min-answer-room", type=int, default=64)
    g.add_argument("--batch", type=int, default=0, help="rows (0: from --kv-gib)")
    g.add_argument("--kv-gib", type=float, default=56.0, help="KV cache size when --batch is 0")
    g.add_argument("--steps", type=int, default=16, help="decode steps per graph replay")
    g.add_argument("--no-graphs", action="store_true")
    g.add_argument("--early-s", type=float, default=20,
                   help="flush finished conversations of slices in flight this often (0 = never)")
    g.add_argument("--attn", choices=list(ATTENTIONS), default="bucket",
                   help="decode attention (fastgen.py): bucket (batched matmuls over the longest row's "
                        "bucket) or flex (FlexAttention, each row reads its own length)")
    g.add_argument("--int8-act", action="store_true",
                   help="answer with the CPU engine's int8 activations on the target's projections "
                        "(int8_act.py): the text the CPU's default path writes, for a CPU drafter")


def make_engine(model, args, device) -> Engine:
    w = TargetWeights(model, torch_dtype(args.dtype), device, max_positions=args.max_len + 256,
                      int8_act=args.int8_act)
    batch = args.batch
    if not batch:
        per_row = w.kv_bytes_per_token() * (args.max_len + args.steps + 128)
        batch = max(64, int(args.kv_gib * 2**30 // per_row) // 64 * 64)
    return Engine(w, batch=batch, max_len=args.max_len, steps=args.steps,
                  cuda_graphs=not args.no_graphs, attn=args.attn)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--time-limit-s", type=float, default=500)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--log-every-s", type=float, default=15)
    add_args(ap)
    args = ap.parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.time_limit_s
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the labels are argmaxes
    tok = load_tokenizer(args.target, args.gguf_file)
    model = load_target(args.target, args.gguf_file, args.dtype, args.device)
    eos = eos_token_ids(model, tok)
    convs = read_jsonl(args.convs) if args.convs else []
    eng = make_engine(model, args, args.device)
    del model
    sch = Scheduler(tok, eos, convs, args.out_dir, args)
    log = open(os.path.join(args.out_dir, "gen_log.txt"), "a")
    st: Dict = {}
    last = [time.time(), 0, time.time()]

    def should_stop():
        now = time.time()
        if now - last[0] > args.log_every_s:
            rate = (st.get("new_tokens", 0) - last[1]) / (now - last[0])
            line = (f"[gen {now - t0:6.1f}s] {rate:,.0f} new tok/s | " + json.dumps(sch.stats)
                    + f" | rows {eng.B} graphs {len(eng.graphs)}")
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            last[0], last[1] = now, st.get("new_tokens", 0)
        if args.early_s > 0 and now - last[2] > args.early_s:
            sch.flush_early()
            last[2] = now
        if now >= deadline:
            sch.stopping = True
        return sch.stopping

    print(f"[gen] rows {eng.B}, cache {eng.T} positions, dtype {args.dtype}, attention {args.attn}, resume at slice "
          f"{sch.start_slice}, {len(convs)} ShareGPT conversations", flush=True)
    t_gen = time.time()
    generate_loop(eng, sch, eos, should_stop, stats=st)
    sch.close_partial()
    el = time.time() - t_gen
    summary = {"seconds": round(el, 1), "new_tok_s": round(st.get("new_tokens", 0) / max(el, 1e-9)),
               **st, **sch.stats}
    line = "[gen] done " + json.dumps(summary)
    print(line, flush=True)
    log.write(line + "\n")
    log.close()


if __name__ == "__main__":
    main()
