"""One-process pipeline: load the target once, regenerate, train, export.

    python -m dflash_train.pipeline --target T.gguf --prompts P.jsonl.gz \
        --out-dir WORK --total-s 520 --regen-s 240 [--data-dirs CARRIED_REGEN ...]

Phases (all inside --total-s, counted from process start after imports):
  1. regeneration for --regen-s seconds (skipped when 0 or without --prompts);
     prompts already regenerated in WORK/regen or --data-dirs are skipped;
  2. training on WORK/regen + --data-dirs until the total deadline, resuming
     from WORK/ckpt when it exists (or from --resume);
  3. WORK/ckpt/drafter is the export (checked at the end); WORK/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from . import regenerate, train
from .checkpoint import checkpoint_bytes
from .export import check_export
from .store import done_prompt_indices, shard_paths
from .target import load_target, load_tokenizer


def main(argv=None):
    t_start = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF dir or .gguf file")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--total-s", type=float, default=520)
    ap.add_argument("--regen-s", type=float, default=240)
    ap.add_argument("--min-train-s", type=float, default=60,
                    help="regeneration stops early enough to leave this much for training")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", help="target dtype (regeneration and features)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    regenerate.add_args(ap)
    train.add_args(ap)
    ap.set_defaults(resume="auto")
    args = ap.parse_args(argv)
    deadline = t_start + args.total_s
    os.makedirs(args.out_dir, exist_ok=True)
    logf = open(os.path.join(args.out_dir, "pipeline_log.txt"), "a")

    def log(s):
        line = f"[{time.time() - t_start:7.1f}s] {s}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    if args.device == "cuda":
        log(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    tok = load_tokenizer(args.target, args.gguf_file)
    model = load_target(args.target, args.gguf_file, args.dtype, args.device)
    log(f"target loaded: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params")
    summary = {"target": args.target}

    regen_dir = os.path.join(args.out_dir, "regen")
    if args.regen_s > 0 and args.prompts:
        from .data import read_jsonl

        prompts = read_jsonl(args.prompts)
        done = done_prompt_indices([regen_dir] + list(args.data_dirs))
        r_deadline = min(time.time() + args.regen_s,
                         deadline - (0 if args.no_train else args.min_train_s))
        rg = regenerate.Regenerator(model, tok, args, regen_dir, log=log)
        st = rg.run(prompts, r_deadline, done)
        st["seconds"] = round(time.time() - t_start, 1)
        summary["regen"] = st
        log(f"regeneration: {json.dumps(st)}")
        if args.device == "cuda":
            log(f"peak GPU memory during regeneration: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    if not args.no_train:
        dirs = [regen_dir] + list(args.data_dirs)
        if not shard_paths(dirs):
            log("no regenerated data: nothing to train on")
        else:
            tr = train.Trainer(args, model, tok, args.out_dir, log_fn=log,
                               target_name=os.path.basename(args.target.rstrip("/")))
            tr.load_data(dirs)
            res = tr.train(deadline)
            summary["train"] = {k: v for k, v in res.items() if k not in ("args",)}
            if args.device == "cuda":
                log(f"peak GPU memory during training: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
            exp = os.path.join(args.out_dir, "ckpt", "drafter")
            summary["export_check"] = check_export(exp)
            summary["ckpt_bytes"] = checkpoint_bytes(os.path.join(args.out_dir, "ckpt"))
            log(f"export check: {json.dumps(summary['export_check'])}")
    summary["seconds"] = round(time.time() - t_start, 1)
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    log(f"done in {summary['seconds']}s")


if __name__ == "__main__":
    main()
