#!/usr/bin/env python3
"""Golden fixture for the DFlash drafter forward, produced by the published reference.

The reference is `DFlashDraftModel` from z-lab/dflash (`dflash/model.py`), imported
from a local checkout given with --reference (it is never copied into this repo).
The reference pins transformers==4.57.1; run with that version on the path, e.g.

    git clone https://github.com/z-lab/dflash /work/zlab-dflash   # commit 44947fb
    pip install --target /work/zlab-env --no-deps transformers==4.57.1 \
        huggingface-hub==0.36.0 tokenizers==0.22.1
    PYTHONPATH=/work/zlab-env python3 tools/make_drafter_fixture.py \
        --reference /work/zlab-dflash --out crates/models/tests/fixtures/dflash_ref_tiny

A tiny random float32 drafter is built, and two consecutive drafting rounds are run
exactly the way the reference `dflash_generate` loop drives the drafter (same
position_ids slicing, same DynamicCache, same `crop(start)` after each draft forward).
See tools/README.md ("DFlash drafter reference fixture") for the tensor list and the
semantics the Rust implementation must reproduce.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch

EXPECTED_REFERENCE_COMMIT = "44947fbf71114e241c96de194f4b382b5dd330d0"
EXPECTED_TRANSFORMERS = "4.57.1"

# Tiny drafter geometry (see the brief in tools/README.md).
HIDDEN = 128
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 256
N_DRAFT_LAYERS = 2
RMS_EPS = 1e-6
ROPE_THETA = 10000.0
VOCAB = 512
BLOCK = 8
MASK_ID = 511
TARGET_LAYER_IDS = [1, 3]
NUM_TARGET_LAYERS = 6
SEED = 20260501

# Keys of the published z-lab drafter config.json (e.g. z-lab/Qwen3-4B-DFlash-b16).
PUBLISHED_CONFIG_KEYS = [
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size",
    "bos_token_id", "dflash_config", "dtype", "eos_token_id", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings",
    "transformers_version", "use_cache", "use_sliding_window", "vocab_size",
]

# Two drafting rounds.
L1 = 11  # prompt length == round-1 context length; round-1 block starts at position 11
ACCEPT1 = 2  # pretend the target accepted 2 drafts in round 1 -> 3 new context rows
L2 = ACCEPT1 + 1  # new context rows for round 2 (positions 11..13)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, help="path to a z-lab/dflash checkout (contains dflash/model.py)")
    p.add_argument("--out", default="crates/models/tests/fixtures/dflash_ref_tiny", help="output folder")
    p.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "eager"],
                   help="attention backend used for the saved outputs (the other one is used as a cross-check)")
    return p.parse_args()


def reference_commit(path):
    try:
        return subprocess.check_output(["git", "-C", path, "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def build_config(Qwen3Config, attn_impl):
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_DRAFT_LAYERS,
        num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=RMS_EPS,
        use_cache=True,
        tie_word_embeddings=False,
        rope_theta=ROPE_THETA,
        rope_scaling=None,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=N_DRAFT_LAYERS,
        layer_types=["full_attention"] * N_DRAFT_LAYERS,
        attention_dropout=0.0,
    )
    # DFlash fields, laid out like the published z-lab drafter config.json files.
    cfg.architectures = ["DFlashDraftModel"]
    cfg.auto_map = {"AutoModel": "dflash.DFlashDraftModel"}
    cfg.block_size = BLOCK
    cfg.num_target_layers = NUM_TARGET_LAYERS
    cfg.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": list(TARGET_LAYER_IDS)}
    cfg._attn_implementation = attn_impl
    return cfg


def make_weights(model, gen):
    """Overwrite every parameter with seeded values: linears ~ N(0, 1/fan_in), norms 1 + 0.1 N(0,1)."""
    sd = {}
    for name, p in sorted(model.named_parameters()):
        if p.ndim == 1:  # every 1-D parameter of the drafter is an RMSNorm weight
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
        sd[name] = w.to(torch.float32).contiguous()
    return sd


def run_two_rounds(model, embed, lm_head, io_in):
    """Drive the drafter exactly like z-lab `dflash_generate` does (batch 1)."""
    from transformers import DynamicCache

    max_length = 64
    output_ids = torch.full((1, max_length + BLOCK), MASK_ID, dtype=torch.long)
    position_ids = torch.arange(output_ids.shape[1]).unsqueeze(0)
    cache = DynamicCache()
    out = {}

    rounds = [
        (1, L1, io_in["round1_target_hidden"], int(io_in["round1_block_ids"][0])),
        (2, L1 + L2, io_in["round2_target_hidden"], int(io_in["round2_block_ids"][0])),
    ]
    for r, start, target_hidden, cur_token in rounds:
        output_ids[:, start] = cur_token
        block_output_ids = output_ids[:, start:start + BLOCK].clone()
        cache_len = cache.get_seq_length()
        assert cache_len + target_hidden.shape[0] == start, "draft cache + new context must end at block start"
        pos = position_ids[:, cache_len:start + BLOCK]
        noise_embedding = torch.nn.functional.embedding(block_output_ids, embed)
        with torch.inference_mode():
            hidden = model(
                target_hidden=target_hidden.unsqueeze(0),
                noise_embedding=noise_embedding,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                is_causal=False,
            )
            logits = hidden[:, 1 - BLOCK:, :] @ lm_head.T  # target.lm_head (no bias)
            cache.crop(start)
        drafts = torch.argmax(logits, dim=-1)  # reference `sample(draft_logits)` is always greedy
        out[f"round{r}_block_ids"] = block_output_ids[0].clone()
        out[f"round{r}_positions"] = pos[0].clone()
        out[f"round{r}_hidden_out"] = hidden[0].clone()
        out[f"round{r}_logits"] = logits[0].clone()
        out[f"round{r}_draft_ids"] = drafts[0].clone()
        out[f"round{r}_cache_len_before"] = torch.tensor([cache_len], dtype=torch.long)
        for li in range(N_DRAFT_LAYERS):
            k, v = cache.layers[li].keys, cache.layers[li].values  # [1, kv_heads, start, head_dim]
            out[f"round{r}_cache_k_l{li}"] = k[0].clone()
            out[f"round{r}_cache_v_l{li}"] = v[0].clone()
        # Commit as the reference would: block[:accept+1] + bonus; only round 1 is continued.
        if r == 1:
            output_ids[:, start:start + ACCEPT1 + 1] = torch.cat(
                [block_output_ids[:, :1], drafts[:, :ACCEPT1]], dim=1)
    return out


# ---------------------------------------------------------------------------------------
# Independent re-statement of the semantics (plain torch, float64) used to check that the
# description in tools/README.md matches what the reference actually computes.
# ---------------------------------------------------------------------------------------

def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


def _rope(x, pos):
    # x: [T, heads, d]; neox / rotate_half style: pairs (i, i + d/2)
    d = x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def semantics_forward(W, embed, lm_head, target_hidden, block_ids, ctx_pos, blk_pos, cache):
    W = {k: v.double() for k, v in W.items()}
    c = _rms(target_hidden.double() @ W["fc.weight"].T, W["hidden_norm.weight"])
    x = embed.double()[block_ids]
    B, Lc = x.shape[0], c.shape[0]
    groups = N_HEADS // N_KV_HEADS
    new_cache = []
    for li in range(N_DRAFT_LAYERS):
        p = f"layers.{li}."
        h = _rms(x, W[p + "input_layernorm.weight"])
        q = _rope(_rms((h @ W[p + "self_attn.q_proj.weight"].T).view(B, N_HEADS, HEAD_DIM),
                       W[p + "self_attn.q_norm.weight"]), blk_pos)
        kc = _rope(_rms((c @ W[p + "self_attn.k_proj.weight"].T).view(Lc, N_KV_HEADS, HEAD_DIM),
                        W[p + "self_attn.k_norm.weight"]), ctx_pos)
        vc = (c @ W[p + "self_attn.v_proj.weight"].T).view(Lc, N_KV_HEADS, HEAD_DIM)
        kb = _rope(_rms((h @ W[p + "self_attn.k_proj.weight"].T).view(B, N_KV_HEADS, HEAD_DIM),
                        W[p + "self_attn.k_norm.weight"]), blk_pos)
        vb = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, N_KV_HEADS, HEAD_DIM)
        ck, cv = cache[li]
        K = torch.cat([ck, kc, kb], 0)  # [cache + Lc + B, kv, d]
        V = torch.cat([cv, vc, vb], 0)
        new_cache.append((torch.cat([ck, kc], 0), torch.cat([cv, vc], 0)))  # crop(start) drops kb/vb
        heads = []
        for hq in range(N_HEADS):
            kv = hq // groups
            s = (q[:, hq, :] @ K[:, kv, :].T) * HEAD_DIM ** -0.5  # no mask at all
            heads.append(torch.softmax(s, -1) @ V[:, kv, :])
        a = torch.cat(heads, -1)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h2 = _rms(x, W[p + "post_attention_layernorm.weight"])
        m = torch.nn.functional.silu(h2 @ W[p + "mlp.gate_proj.weight"].T) * (h2 @ W[p + "mlp.up_proj.weight"].T)
        x = x + m @ W[p + "mlp.down_proj.weight"].T
    hidden = _rms(x, W["norm.weight"])
    logits = hidden[1:] @ lm_head.double().T
    return hidden, logits, new_cache


def semantics_two_rounds(W, embed, lm_head, io):
    empty = torch.zeros(0, N_KV_HEADS, HEAD_DIM, dtype=torch.float64)
    cache = [(empty, empty) for _ in range(N_DRAFT_LAYERS)]
    res = {}
    cache_len = 0
    for r in (1, 2):
        th = io[f"round{r}_target_hidden"]
        start = cache_len + th.shape[0]
        ctx_pos = torch.arange(cache_len, start)
        blk_pos = torch.arange(start, start + BLOCK)
        hidden, logits, cache = semantics_forward(W, embed, lm_head, th, io[f"round{r}_block_ids"],
                                                  ctx_pos, blk_pos, cache)
        res[f"round{r}_hidden_out"] = hidden
        res[f"round{r}_logits"] = logits
        for li in range(N_DRAFT_LAYERS):
            res[f"round{r}_cache_k_l{li}"] = cache[li][0].transpose(0, 1)
            res[f"round{r}_cache_v_l{li}"] = cache[li][1].transpose(0, 1)
        cache_len = start
    return res


def main():
    args = parse_args()
    ref = os.path.abspath(args.reference)
    if not os.path.isfile(os.path.join(ref, "dflash", "model.py")):
        sys.exit(f"{ref} does not look like a z-lab/dflash checkout (no dflash/model.py)")
    sys.path.insert(0, ref)
    import transformers
    from safetensors.torch import save_file
    from dflash.model import DFlashDraftModel, Qwen3Config  # the published reference

    commit = reference_commit(ref)
    print(f"reference: {ref} @ {commit}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if commit != EXPECTED_REFERENCE_COMMIT:
        print(f"WARNING: reference commit differs from {EXPECTED_REFERENCE_COMMIT}")
    if int(transformers.__version__.split(".")[0]) >= 5:
        # transformers 5.x changed DynamicCache.crop(n>0) into an error ("use a negative integer"),
        # so the reference's own `past_key_values_draft.crop(start)` cannot run there.
        sys.exit(f"transformers {transformers.__version__} cannot run the reference generate loop; "
                 f"put transformers=={EXPECTED_TRANSFORMERS} first on PYTHONPATH (see tools/README.md)")
    if transformers.__version__ != EXPECTED_TRANSFORMERS:
        print(f"WARNING: the reference pins transformers=={EXPECTED_TRANSFORMERS}")

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)

    def new_model(attn_impl, state_dict=None):
        m = DFlashDraftModel(build_config(Qwen3Config, attn_impl)).to(torch.float32).eval()
        if state_dict is not None:
            m.load_state_dict(state_dict, strict=True)
        return m

    model = new_model(args.attn_impl)
    weights = make_weights(model, gen)
    model.load_state_dict(weights, strict=True)

    # Shared target tensors + round inputs.
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    K = len(TARGET_LAYER_IDS)
    io_in = {
        "round1_target_hidden": 2.0 * torch.randn(L1, K * HIDDEN, generator=gen),
        "round2_target_hidden": 2.0 * torch.randn(L2, K * HIDDEN, generator=gen),
    }
    cur1 = int(torch.randint(0, MASK_ID, (1,), generator=gen))
    cur2 = int(torch.randint(0, MASK_ID, (1,), generator=gen))
    if cur2 == cur1:
        cur2 = (cur1 + 1) % MASK_ID
    mask_tail = [MASK_ID] * (BLOCK - 1)
    io_in["round1_block_ids"] = torch.tensor([cur1] + mask_tail, dtype=torch.long)
    io_in["round2_block_ids"] = torch.tensor([cur2] + mask_tail, dtype=torch.long)

    out = run_two_rounds(model, embed, lm_head, io_in)
    for r in (1, 2):
        assert torch.equal(out[f"round{r}_block_ids"], io_in[f"round{r}_block_ids"])

    # 1) reproducibility: same model again, and a fresh model reloaded from the saved weights.
    out_again = run_two_rounds(model, embed, lm_head, io_in)
    out_reload = run_two_rounds(new_model(args.attn_impl, weights), embed, lm_head, io_in)
    for k in out:
        assert torch.equal(out[k], out_again[k]), f"not reproducible: {k}"
        assert torch.equal(out[k], out_reload[k]), f"reload differs: {k}"
    print("reproducible: two runs + reload bit-identical")

    # 2) the other attention backend of the reference must agree.
    other = "eager" if args.attn_impl == "sdpa" else "sdpa"
    out_other = run_two_rounds(new_model(other, weights), embed, lm_head, io_in)
    d_backend = max((out[k].double() - out_other[k].double()).abs().max().item()
                    for k in out if out[k].is_floating_point())
    print(f"{args.attn_impl} vs {other}: max abs diff {d_backend:.3e}")
    assert d_backend < 1e-4

    # 3) the documented semantics (plain float64 re-statement) must reproduce the reference.
    sem = semantics_two_rounds(weights, embed, lm_head, io_in)
    d_sem = 0.0
    for k, v in sem.items():
        d = (out[k].double() - v).abs().max().item()
        d_sem = max(d_sem, d)
        print(f"  semantics vs reference {k:24s} max abs diff {d:.3e}")
    assert d_sem < 1e-3, d_sem
    for r in (1, 2):
        assert torch.equal(out[f"round{r}_draft_ids"], torch.argmax(sem[f"round{r}_logits"], -1)), \
            "argmax drafts differ between semantics and reference"

    # ---- write the fixture ----
    os.makedirs(args.out, exist_ok=True)
    full = model.config.to_dict()
    cfg_json = {k: full.get(k) for k in PUBLISHED_CONFIG_KEYS}
    cfg_json["dtype"] = "float32"
    cfg_json["transformers_version"] = transformers.__version__
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
        f.write("\n")
    meta = {
        "reference_repo": "https://github.com/z-lab/dflash",
        "reference_commit": commit,
        "reference_file": "dflash/model.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "attn_implementation": args.attn_impl,
        "seed": SEED,
        "generator": "tools/make_drafter_fixture.py",
        "rounds": {
            "round1": {"cache_len_before": 0, "new_ctx": L1, "block_start": L1},
            "round2": {"cache_len_before": L1, "new_ctx": L2, "block_start": L1 + L2,
                       "simulated_accept_in_round1": ACCEPT1},
        },
        "max_abs_diff": {"sdpa_vs_eager": d_backend, "float64_semantics_vs_reference": d_sem},
    }
    with open(os.path.join(args.out, "fixture.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    # Only a single metadata key: safetensors writes metadata from a hash map, so more keys
    # would make the header byte order (and the git diff) change on every regeneration.
    save_file({k: v.contiguous() for k, v in sorted(weights.items())},
              os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})

    io = {
        "embed_tokens": embed,
        "lm_head": lm_head,
        "mask_token_id": torch.tensor([MASK_ID], dtype=torch.long),
        "round1_target_hidden": io_in["round1_target_hidden"],
        "round2_target_hidden": io_in["round2_target_hidden"],
    }
    io.update(out)
    for r in (1, 2):
        pos = out[f"round{r}_positions"]
        n_ctx = io_in[f"round{r}_target_hidden"].shape[0]
        io[f"round{r}_ctx_positions"] = pos[:n_ctx].clone()
        io[f"round{r}_block_positions"] = pos[n_ctx:].clone()
        # fused context feature = hidden_norm(fc(target_hidden)), as computed inside the reference
        with torch.inference_mode():
            io[f"round{r}_ctx_fused"] = model.hidden_norm(model.fc(io_in[f"round{r}_target_hidden"])).clone()
    io = {k: v.contiguous() for k, v in sorted(io.items())}
    save_file(io, os.path.join(args.out, "io.safetensors"), metadata={"format": "pt"})

    # 4) the written config.json + model.safetensors alone rebuild the same reference drafter.
    from safetensors.torch import load_file
    disk_cfg = Qwen3Config.from_json_file(os.path.join(args.out, "config.json"))
    disk_cfg._attn_implementation = args.attn_impl
    disk_model = DFlashDraftModel(disk_cfg).to(torch.float32).eval()
    disk_model.load_state_dict(load_file(os.path.join(args.out, "model.safetensors")), strict=True)
    assert disk_model.target_layer_ids == TARGET_LAYER_IDS and disk_model.mask_token_id == MASK_ID
    assert disk_model.block_size == BLOCK
    out_disk = run_two_rounds(disk_model, embed, lm_head, io_in)
    for k in out:
        assert torch.equal(out[k], out_disk[k]), f"from-disk model differs: {k}"
    print("from-disk config.json + model.safetensors: bit-identical outputs")

    print("fixture tensors:")
    for k, v in io.items():
        if v.is_floating_point():
            extra = f" max|x|={v.abs().max().item():.4f}"
        else:
            extra = f" {v.tolist()}" if v.numel() <= 24 else ""
        print(f"  {k:24s} {str(v.dtype):14s} {list(v.shape)}{extra}")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({total} bytes)")
    assert total < 2_000_000


if __name__ == "__main__":
    main()
