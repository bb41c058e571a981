"""Generator measurements on the GPU: throughput against HF generate, and greedy agreement.

    python -m dflash_train.bench_gen throughput [--target T.gguf] [--attns bucket flex] [--json F]
    python -m dflash_train.bench_gen agree --target T.gguf --convs train_convs.jsonl.gz

throughput (per --dtypes, default bf16): the same prompts (random token ids, 64-192 long)
through HF ``generate`` (static batch of --hf-batch rows, left padding, greedy, every row forced
to --new tokens), then fastgen with each decode attention of --attns ("fixed": the same rows
and lengths; "steady": --batch-bf16 rows, 2x as many prompts, answer lengths 32..512, rows
finish and are refilled continuously).  Arms alternate rep by rep after one warm-up each
(graph capture); medians of --reps runs (fewer once --budget-s has passed).  FlexAttention's
compile time is measured apart (compile_s), warm-up time too (warmup_s).  Checks: CUDA-graph
replay == eager decoding (greedy rows, a quarter of the rows sampling) per attention, and each
attention's greedy answers against the first one's (identical answers / mean first
divergence: bf16 reduction orders differ, so equality is not expected there; the CPU tests
prove fp32 equality).  An attention that fails to compile is reported under "errors".  Without
--target the model is a randomly initialised SmolLM2-135M-shaped Llama (throughput does not
depend on the weights when every row runs to its length).  Writes a JSON summary (--json).
agree: greedy answers to the first user turns of --convs (chat template) from fastgen fp32,
fastgen bf16 and HF generate fp32 (one prompt at a time, no padding); reports identical
answers and the mean first divergence.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from .fastgen import ATTENTIONS, Engine, TargetWeights, generate_list
from .target import chat_prompt_ids, eos_token_ids, load_target, load_tokenizer, torch_dtype


def random_smollm2(dtype, device):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                   head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    m.requires_grad_(False)
    return m


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def hf_throughput(model, prompts, new, pad=0):
    L = max(len(p) for p in prompts)
    dev = next(model.parameters()).device
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        att[i, L - len(p):] = 1
    ids, att = ids.to(dev), att.to(dev)
    sync()
    t = time.time()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad)
    sync()
    dt = time.time() - t
    n = (out.shape[1] - L) * len(prompts)
    return {"rows": len(prompts), "new_tokens": n, "seconds": round(dt, 2), "tok_s": round(n / dt)}


def fast_throughput(eng, prompts, news, sampled=None):
    st: dict = {}
    sync()
    t = time.time()
    res = generate_list(eng, prompts, news, eos=[-1], sampled=sampled, stats=st)
    sync()
    dt = time.time() - t
    n = sum(len(r[0]) for r in res)
    return {"rows": eng.B, "prompts": len(prompts), "new_tokens": n, "seconds": round(dt, 2),
            "tok_s": round(n / dt), "graphs": len(eng.graphs), "prefills": st.get("prefills")}, res


def first_divergence(a, b):
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(len(a), len(b))


def agreement(ref, got, rows=None):
    """Identical answers and mean first divergence of ``got`` against ``ref`` (lists of token lists)."""
    rows = range(len(ref)) if rows is None else rows
    pairs = [(ref[i], got[i]) for i in rows]
    same = sum(a == b for a, b in pairs)
    div = [first_divergence(a, b) for a, b in pairs]
    return {"identical": f"{same}/{len(pairs)}", "all_identical": same == len(pairs),
            "mean_first_divergence": round(float(np.mean(div)), 1),
            "mean_len": round(float(np.mean([len(a) for a, _ in pairs])), 1)}


def summarize(runs):
    """Median tokens/s of timed runs (and the raw numbers)."""
    return {"median_tok_s": round(float(np.median([r["tok_s"] for r in runs]))),
            "runs_tok_s": [r["tok_s"] for r in runs], "new_tokens": runs[0]["new_tokens"],
            "rows": runs[0]["rows"], "prompts": runs[0]["prompts"], "graphs": runs[-1]["graphs"]}


def make_engines(w, attns, batch, max_len, steps, errors, **kw):
    """One Engine per attention; an attention that fails to build or compile is reported, not fatal.
    Returns {attn: (engine, compile seconds)}."""
    out = {}
    for a in attns:
        try:
            eng = Engine(w, batch=batch, max_len=max_len, steps=steps, attn=a, **kw)
            comp = 0.0
            if a == "flex":  # compile the kernel for this shape now, to time it apart
                g = w.nh // w.nkv
                sync()
                t = time.time()
                with torch.no_grad():
                    eng._attend(0, torch.zeros(batch, w.nkv, g, w.hd, device=w.device, dtype=w.dtype), eng.T, None)
                sync()
                comp = round(time.time() - t, 1)
            out[a] = (eng, comp)
        except Exception as e:  # a device or torch without a working FlexAttention
            errors[f"{a} (batch {batch})"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[bench] {a} failed: {errors[f'{a} (batch {batch})']}", flush=True)
    return out


def timed_arm(engines, prompts, news, reps, budget_end, errors):
    """Warm-up each engine once (graph capture), then alternate engines rep by rep (at least one
    timed run each; more while ``budget_end`` allows).  Returns ({attn: summary}, {attn: answers})."""
    runs, answers, warm = {}, {}, {}
    for a, (eng, _) in list(engines.items()):
        t = time.time()
        try:
            fast_throughput(eng, prompts[:eng.B], [min(64, max(news))] * min(eng.B, len(prompts)))
        except Exception as e:
            errors[f"{a} warm-up (batch {eng.B})"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"[bench] {a} warm-up failed: {errors[f'{a} warm-up (batch {eng.B})']}", flush=True)
            del engines[a]
            continue
        warm[a] = round(time.time() - t, 1)
        runs[a] = []
    for rep in range(reps):
        for a, (eng, _) in engines.items():
            if rep and time.time() + 1.2 * runs[a][-1]["seconds"] > budget_end:
                continue
            r, res = fast_throughput(eng, prompts, news)
            runs[a].append(r)
            answers[a] = [x[0] for x in res]
            print(f"[bench] {a} batch {eng.B} rep {rep}: {r['tok_s']:,} tok/s ({r['seconds']} s)", flush=True)
    out = {}
    for a, rs in runs.items():
        out[a] = {**summarize(rs), "warmup_s": warm[a], "compile_s": engines[a][1]}
    return out, answers


def cmd_throughput(args):
    t_start = time.time()
    budget_end = t_start + args.budget_s
    rng = np.random.default_rng(0)
    out = {}
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        dev = args.device
        model = (load_target(args.target, None, dname, dev) if args.target else random_smollm2(dt, dev))
        w = TargetWeights(model, dt, dev, max_positions=2048)
        hb = args.hf_batch
        prompts = [rng.integers(100, 40000, size=int(rng.integers(64, 192))).tolist() for _ in range(hb)]
        r: dict = {"errors": {}}
        errors = r["errors"]
        if not args.no_hf:
            hf_throughput(model, prompts[:8], 8)  # warm-up
            r["hf_generate"] = hf_throughput(model, prompts, args.new)
            print(f"[bench] {dname} HF generate: {r['hf_generate']}", flush=True)
        # ---- fixed short length: hf_batch rows, every prompt to exactly --new tokens
        engines = make_engines(w, args.attns, hb, 192 + args.new + 16, args.steps, errors)
        r["fixed"], fixed_ans = timed_arm(engines, prompts, [args.new] * hb, args.reps, budget_end, errors)
        # ---- checks: graph replay == eager (greedy rows; a quarter of the rows sample, so the
        # sampled-subset graphs run too) and new attention == bucket (greedy, same prompts)
        checks: dict = {}
        samp = [i % 4 == 3 for i in range(hb)]
        greedy_rows = [i for i in range(hb) if not samp[i]]
        for a, (eng, _) in engines.items():
            try:
                eager = Engine(w, batch=hb, max_len=192 + args.new + 16, steps=args.steps, attn=a, cuda_graphs=False)
                ga = [x[0] for x in generate_list(eng, prompts, args.check_new, eos=[-1], sampled=samp)]
                ea = [x[0] for x in generate_list(eager, prompts, args.check_new, eos=[-1], sampled=samp)]
                checks[f"{a}_graphs_equal_eager"] = agreement(ea, ga, greedy_rows)
                del eager
            except Exception as e:
                errors[f"{a} graphs vs eager"] = f"{type(e).__name__}: {e}"[:2000]
        base = args.attns[0]
        for a in fixed_ans:
            if a != base and base in fixed_ans:
                checks[f"{a}_equals_{base}_greedy"] = agreement(fixed_ans[base], fixed_ans[a])
        r["checks"] = checks
        print(f"[bench] {dname} checks: {json.dumps(checks)}", flush=True)
        del engines
        torch.cuda.empty_cache()
        # ---- steady state: full batch, 2x as many prompts, lengths 32-512, rows refilled
        big = args.batch_bf16 if dt == torch.bfloat16 else args.batch_fp32
        n = big * 2
        ps = [rng.integers(100, 40000, size=int(rng.integers(64, 192))).tolist() for _ in range(n)]
        news = rng.integers(32, args.steady_max_new, size=n).tolist()
        engines = make_engines(w, args.attns, big, 192 + args.steady_max_new, args.steps, errors)
        r["steady"], _ = timed_arm(engines, ps, news, args.reps, budget_end, errors)
        del engines
        torch.cuda.empty_cache()
        for arm in ("fixed", "steady"):
            if r[arm]:
                best = max(r[arm], key=lambda a: r[arm][a]["median_tok_s"])
                r[f"{arm}_faster"] = best
                for a in r[arm]:
                    if a != "bucket" and "bucket" in r[arm]:  # > 1: a is faster than bucket
                        r[f"{arm}_{a}_vs_bucket"] = round(r[arm][a]["median_tok_s"] / r[arm]["bucket"]["median_tok_s"], 2)
        if "hf_generate" in r and r["fixed"]:
            r["fixed_best_vs_hf"] = round(r["fixed"][r["fixed_faster"]]["median_tok_s"] / r["hf_generate"]["tok_s"], 1)
        out[dname] = r
        print(json.dumps({dname: r}), flush=True)
        del w, model
        torch.cuda.empty_cache()
    out["seconds_total"] = round(time.time() - t_start, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    for d in args.dtypes:
        r = out[d]
        line = {"hf_tok_s": r.get("hf_generate", {}).get("tok_s")}
        for arm in ("fixed", "steady"):
            line[arm] = {a: v["median_tok_s"] for a, v in r[arm].items()}
            line[f"{arm}_faster"] = r.get(f"{arm}_faster")
            line.update({k: v for k, v in r.items() if k.startswith(f"{arm}_") and k.endswith("_vs_bucket")})
        line["compile_s"] = {f"{arm}/{a}": v["compile_s"] for arm in ("fixed", "steady") for a, v in r[arm].items()}
        line["checks_all_identical"] = {k: v["all_identical"] for k, v in r["checks"].items()}
        line["errors"] = list(r["errors"])
        print(f"[bench] summary {d}: {json.dumps(line)}", flush=True)
    print(f"[bench] total {out['seconds_total']} s", flush=True)
    return out


def cmd_agree(args):
    from .data import read_jsonl

    torch.backends.cuda.matmul.allow_tf32 = False
    tok = load_tokenizer(args.target)
    convs = read_jsonl(args.convs)[:args.n]
    prompts = [chat_prompt_ids(tok, [{"role": "user", "content": c["turns"][0]}]) for c in convs]
    prompts = [p for p in prompts if len(p) <= 512]
    dev = args.device
    models = {d: load_target(args.target, None, d, dev) for d in ("float32", "bfloat16")}
    eos = eos_token_ids(models["float32"], tok)
    res: dict = {}
    outs = {}
    for dname, model in models.items():
        w = TargetWeights(model, torch_dtype(dname), dev, max_positions=2048)
        eng = Engine(w, batch=128, max_len=512 + args.new + 16, steps=16)
        outs[dname] = [r[0] for r in generate_list(eng, prompts, args.new, eos)]
        del eng, w
    hf = []
    for p in prompts[:args.n_hf]:
        ids = torch.tensor([p], device=dev)
        with torch.inference_mode():
            o = models["float32"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=args.new, do_sample=False, eos_token_id=eos,
                                           pad_token_id=eos[0])
        hf.append(o[0, len(p):].tolist())
    res["fastgen_fp32_equals_hf_fp32"] = f"{sum(a == b for a, b in zip(outs['float32'], hf))}/{len(hf)}"
    # teacher-forced: on the fp32 greedy answers, does the bf16 target pick the same next token?
    agree = total = 0
    for p, a in zip(prompts, outs["float32"]):
        if not a:
            continue
        ids = torch.tensor([p + a], device=dev)
        with torch.inference_mode():
            l32 = models["float32"](input_ids=ids).logits[0, len(p) - 1:-1].argmax(-1)
            l16 = models["bfloat16"](input_ids=ids).logits[0, len(p) - 1:-1].argmax(-1)
        agree += int((l32 == l16).sum())
        total += len(a)

    def first_div(a, b):
        for i in range(min(len(a), len(b))):
            if a[i] != b[i]:
                return i
        return min(len(a), len(b))

    f32, b16 = outs["float32"], outs["bfloat16"]
    div = [first_div(a, b) for a, b in zip(f32, b16)]
    res.update({"prompts": len(prompts), "new_tokens_max": args.new,
                "bf16_identical_answers": int(sum(a == b for a, b in zip(f32, b16))),
                "bf16_mean_first_divergence": round(float(np.mean(div)), 1),
                "fp32_mean_answer_len": round(float(np.mean([len(a) for a in f32])), 1),
                "bf16_teacher_forced_argmax_agreement": round(agree / max(total, 1), 5)})
    print(json.dumps(res), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["throughput", "agree"])
    ap.add_argument("--target", default=None)
    ap.add_argument("--convs", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    ap.add_argument("--attns", nargs="+", default=["bucket", "flex"], choices=list(ATTENTIONS),
                    help="throughput: decode attentions to compare (the first is the reference)")
    ap.add_argument("--reps", type=int, default=3, help="throughput: timed runs per arm (fewer if --budget-s runs out)")
    ap.add_argument("--check-new", type=int, default=64, help="throughput: tokens per row in the graphs == eager check")
    ap.add_argument("--steady-max-new", type=int, default=512, help="throughput: steady answer lengths 32..this")
    ap.add_argument("--budget-s", type=float, default=180, help="throughput: no new timed rep after this")
    ap.add_argument("--no-hf", action="store_true", help="throughput: skip HF generate")
    ap.add_argument("--json", default="bench_gen_throughput.json", help="throughput: summary file ('' for none)")
    ap.add_argument("--hf-batch", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-bf16", type=int, default=2048)
    ap.add_argument("--batch-fp32", type=int, default=1024)
    ap.add_argument("--check-graphs", action="store_true", help="(kept for old command lines: the checks always run)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--n-hf", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="where to run (cuda; cpu for a smoke run)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # as gen_data: fp32 means fp32
    (cmd_throughput if args.mode == "throughput" else cmd_agree)(args)


if __name__ == "__main__":
    main()
