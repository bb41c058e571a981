"""Generator measurements on the GPU: throughput against HF generate, and greedy agreement.

    python -m dflash_train.bench_gen throughput [--target T.gguf] [--seconds-hf 20]
    python -m dflash_train.bench_gen agree --target T.gguf --convs train_convs.jsonl.gz

throughput: the same prompts (random token ids, 64-192 long) through HF ``generate`` (static
batch, left padding, greedy, every row forced to the same number of new tokens) and through
fastgen (same batch and lengths), then fastgen in steady state at its full batch with
per-prompt lengths drawn from 32-512 (rows finish and are refilled continuously), in bf16 and
fp32.  Without --target the model is a randomly initialised SmolLM2-135M-shaped Llama
(throughput does not depend on the weights when every row runs to its length).
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

from .fastgen import Engine, TargetWeights, generate_list
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


def fast_throughput(eng, prompts, news):
    st: dict = {}
    sync()
    t = time.time()
    res = generate_list(eng, prompts, news, eos=[-1], stats=st)
    sync()
    dt = time.time() - t
    n = sum(len(r[0]) for r in res)
    return {"rows": eng.B, "prompts": len(prompts), "new_tokens": n, "seconds": round(dt, 2),
            "tok_s": round(n / dt), "graphs": len(eng.graphs), "prefills": st.get("prefills")}


def cmd_throughput(args):
    rng = np.random.default_rng(0)
    out = {}
    for dname in args.dtypes:
        dt = torch_dtype(dname)
        model = (load_target(args.target, None, dname, "cuda") if args.target else random_smollm2(dt, "cuda"))
        w = TargetWeights(model, dt, "cuda", max_positions=2048)
        hb = args.hf_batch
        prompts = [rng.integers(100, 40000, size=int(rng.integers(64, 192))).tolist() for _ in range(hb)]
        r = {}
        hf_throughput(model, prompts[:8], 8)  # warm-up
        r["hf_generate"] = hf_throughput(model, prompts, args.new)
        eng = Engine(w, batch=hb, max_len=192 + args.new + 16, steps=args.steps)
        fast_throughput(eng, prompts[:hb], [args.new] * hb)  # warm-up + graph capture
        r["fastgen_same_batch"] = fast_throughput(eng, prompts, [args.new] * hb)
        del eng
        torch.cuda.empty_cache()
        big = args.batch_bf16 if dt == torch.bfloat16 else args.batch_fp32
        eng = Engine(w, batch=big, max_len=1024, steps=args.steps)
        n = big * 2
        ps = [rng.integers(100, 40000, size=int(rng.integers(64, 192))).tolist() for _ in range(n)]
        news = rng.integers(32, 512, size=n).tolist()
        fast_throughput(eng, ps[:big], [64] * big)  # warm-up
        r["fastgen_steady"] = fast_throughput(eng, ps, news)
        if args.check_graphs:
            small = ps[:64]
            e1 = Engine(w, batch=64, max_len=512, steps=args.steps, cuda_graphs=True)
            e2 = Engine(w, batch=64, max_len=512, steps=args.steps, cuda_graphs=False)
            a1 = generate_list(e1, small, 64, eos=[-1])
            a2 = generate_list(e2, small, 64, eos=[-1])
            r["graphs_equal_eager"] = all(x[0] == y[0] for x, y in zip(a1, a2))
        out[dname] = r
        print(json.dumps({dname: r}), flush=True)
        del eng, w, model
        torch.cuda.empty_cache()
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
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--hf-batch", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch-bf16", type=int, default=2048)
    ap.add_argument("--batch-fp32", type=int, default=1024)
    ap.add_argument("--check-graphs", action="store_true")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--n-hf", type=int, default=16)
    ap.add_argument("--device", default="cuda", help="agree: where to run (cuda or cpu)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # as gen_data: fp32 means fp32
    (cmd_throughput if args.mode == "throughput" else cmd_agree)(args)


if __name__ == "__main__":
    main()
