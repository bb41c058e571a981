#!/usr/bin/env python3
"""Golden fixture for the DFlash2 drafter, produced by the published reference.

The reference is `DFlash2DraftModel` of z-lab/dflash (`dflash/model.py`, commit 07ebd93 or
later: the version with `GroupedDynamicCausalConv` and `CandidateSelector`), imported from a
local copy given with --reference (a folder holding `dflash/model.py`; it is never copied into
this repository). It needs torch and transformers >= 5 (the reference's cache calls
`DynamicCache(config=...)` and `activate_past_recording()`):

    python3 -m venv /tmp/ref-venv && /tmp/ref-venv/bin/pip install torch transformers safetensors
    /tmp/ref-venv/bin/python tools/make_drafter2_fixture.py \
        --reference /tmp/zlab-dflash-07ebd93 --out crates/models/tests/fixtures/dflash2_ref_tiny

A tiny random float32 DFlash2 drafter is built (3-tap convolutions over groups of 16 channels,
a rank-16 selector over 6 candidates, one sliding non-causal layer with a window of 6 and one
full layer, an output multiplier, a logit soft cap and an input embedding scale), and two
drafting rounds are run the way the reference `dflash_generate` drives the drafter: the same
cache (`DynamicCache(config=...)` with past recording), position slicing, embedding scale and
`crop` after each draft forward; then the reference `propose` (greedy, and sampled at T = 0.7).
See tools/README.md ("DFlash2 drafter reference fixture") for the tensors it writes.
"""

import argparse
import json
import math
import os
import sys

import torch

# Tiny drafter geometry.
HIDDEN = 64
N_HEADS = 4
N_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE = 128
N_LAYERS = 2
VOCAB = 300
BLOCK = 8
MASK_ID = 299
TARGET_LAYER_IDS = [1, 3]
NUM_TARGET_LAYERS = 6
WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention"]
CONV_TAPS = 3
CONV_GROUP = 16
RANK = 16
TOP_K = 6
OUTPUT_MULTIPLIER = 0.8
SOFTCAP = 5.0
EMBED_SCALE = 1.5
ROPE_THETA = 10000.0
RMS_EPS = 1e-6
TEMPERATURE = 0.7
SEED = 20260502

L1 = 11  # round-1 context; block at 11..18
ACCEPT1 = 2  # round 1 "accepts" 2 drafts: round 2 brings 3 context rows, block at 14..21
L2 = ACCEPT1 + 1


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, help="folder holding the reference dflash/model.py")
    p.add_argument("--out", default="crates/models/tests/fixtures/dflash2_ref_tiny")
    return p.parse_args()


def build_config(Qwen3Config):
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=N_LAYERS,
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
        attention_bias=False,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=N_LAYERS,
        layer_types=list(LAYER_TYPES),
        attention_dropout=0.0,
    )
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.num_target_layers = NUM_TARGET_LAYERS
    cfg.is_causal = False
    cfg.dflash_config = {
        "block_size": BLOCK,
        "mask_token_id": MASK_ID,
        "target_layer_ids": list(TARGET_LAYER_IDS),
        "conv_kernel_size": CONV_TAPS,
        "conv_group_size": CONV_GROUP,
        "selector_rank": RANK,
        "selector_top_k": TOP_K,
        "output_multiplier": OUTPUT_MULTIPLIER,
        "final_logit_softcapping": SOFTCAP,
        "input_embedding_scale": EMBED_SCALE,
    }
    cfg._attn_implementation = "sdpa"
    return cfg


def make_weights(model, gen):
    """Seeded values for every parameter: linears N(0, 1/fan_in), norms 1 + 0.1 N, conv base
    taps near identity, codebooks N(0, 1) so the selector's transition term matters."""
    sd = {}
    for name, p in sorted(model.named_parameters()):
        if name.endswith("base_kernel"):
            w = 0.3 * torch.randn(p.shape, generator=gen)
            w[:, 0] += 1.0
        elif "codebook" in name:
            w = torch.randn(p.shape, generator=gen)
        elif name.endswith("kernel_projection.weight"):
            w = 0.5 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
        elif p.ndim == 1:
            w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            w = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])
        sd[name] = w.to(torch.float32).contiguous()
    return sd


class Head(torch.nn.Module):
    """The target's output head (no bias), as the reference's `_output_head` returns it."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T


def lattice(model, hidden, logits, anchor):
    """Every score the reference walk can ask for: slot s, predecessor = the anchor (s = 0) or
    any of slot s-1's candidates, in the reference's candidate order (its formula, its modules)."""
    sel = model.candidate_selector
    unary, cand = torch.topk(logits, sel.top_k, dim=-1, sorted=False)
    h = sel.hidden_projection(hidden)
    out = torch.zeros(hidden.shape[1], sel.top_k, sel.top_k)
    for s in range(hidden.shape[1]):
        preds = anchor.view(1) if s == 0 else cand[0, s - 1]
        for pi, p in enumerate(preds):
            out[s, pi] = unary[0, s] + torch.einsum(
                "r,kr->k", sel.predecessor_codebook(p.view(1))[0] * h[0, s], sel.successor_codebook(cand[0, s])
            )
    return cand[0], unary[0], out


def run_two_rounds(ref, model, embed, lm_head, io_in):
    """Drive the drafter exactly like the reference `dflash_generate` does (batch 1)."""
    max_length = 64
    output_ids = torch.full((1, max_length + BLOCK), MASK_ID, dtype=torch.long)
    position_ids = torch.arange(output_ids.shape[1]).unsqueeze(0)
    cache = ref._make_cache(model.config)
    head = Head(lm_head)
    out = {}
    rounds = [
        (1, L1, io_in["round1_target_hidden"], int(io_in["round1_block_ids"][0])),
        (2, L1 + L2, io_in["round2_target_hidden"], int(io_in["round2_block_ids"][0])),
    ]
    for r, start, target_hidden, cur in rounds:
        output_ids[:, start] = cur
        block_ids = output_ids[:, start:start + BLOCK].clone()
        cache_len = cache.get_seq_length()
        assert cache_len + target_hidden.shape[0] == start
        scale = float(ref._draft_value(model.config, "input_embedding_scale", 1.0))
        noise = torch.nn.functional.embedding(block_ids, embed) * scale
        with torch.inference_mode():
            hidden = model(
                target_hidden=target_hidden.unsqueeze(0),
                noise_embedding=noise,
                position_ids=position_ids[:, start - target_hidden.shape[0]:start + BLOCK],
                past_key_values=cache,
                use_cache=True,
            )[:, 1 - BLOCK:, :]
            ref._crop_to(cache, start)
            raw = head(hidden)
            logits = model.compute_logits(hidden, head)
            greedy, cand_g, _ = model.propose(hidden, block_ids[:, 0], head, 0.0)
            torch.manual_seed(SEED + r)
            sampled, cand_s, q = model.propose(hidden, block_ids[:, 0], head, TEMPERATURE)
            cand, unary, scores = lattice(model, hidden, logits, block_ids[0, 0])
        assert torch.equal(cand_g, cand_s) and torch.equal(cand_g[0], cand)
        out[f"round{r}_block_ids"] = block_ids[0].clone()
        out[f"round{r}_block_positions"] = position_ids[0, start:start + BLOCK].clone()
        out[f"round{r}_cache_len_before"] = torch.tensor([cache_len], dtype=torch.long)
        out[f"round{r}_raw_logits"] = raw[0].clone()
        out[f"round{r}_logits"] = logits[0].clone()
        out[f"round{r}_candidates"] = cand.clone()
        out[f"round{r}_unary"] = unary.clone()
        out[f"round{r}_scores"] = scores.clone()
        out[f"round{r}_greedy_path"] = greedy[0].clone()
        out[f"round{r}_sampled_path"] = sampled[0].clone()
        out[f"round{r}_sampled_q"] = q[0].clone()
        if r == 1:
            output_ids[:, start:start + ACCEPT1 + 1] = torch.cat([block_ids[:, :1], greedy[:, :ACCEPT1]], dim=1)
    return out


def greedy_margin(out):
    """Smallest gap between the best and second-best score along the greedy walks."""
    worst = float("inf")
    for r in (1, 2):
        cand, scores, path = out[f"round{r}_candidates"], out[f"round{r}_scores"], out[f"round{r}_greedy_path"]
        prev = 0
        for s in range(cand.shape[0]):
            row = scores[s, prev]
            top = torch.topk(row, 2).values
            worst = min(worst, float(top[0] - top[1]))
            prev = int((cand[s] == path[s]).nonzero()[0])
    return worst


def main():
    args = parse_args()
    ref_dir = os.path.abspath(args.reference)
    if not os.path.isfile(os.path.join(ref_dir, "dflash", "model.py")):
        sys.exit(f"{ref_dir} holds no dflash/model.py")
    sys.path.insert(0, ref_dir)
    import transformers
    from safetensors.torch import load_file, save_file

    import dflash.model as ref
    if not hasattr(ref, "DFlash2DraftModel"):
        sys.exit("the reference has no DFlash2DraftModel (z-lab/dflash 07ebd93 or later is needed)")
    print(f"reference: {ref_dir}; torch {torch.__version__}, transformers {transformers.__version__}")

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED)

    def new_model(state_dict=None):
        m = ref.DFlash2DraftModel(build_config(ref.Qwen3Config)).to(torch.float32).eval()
        if state_dict is not None:
            m.load_state_dict(state_dict, strict=True)
        return m

    model = new_model()
    weights = make_weights(model, gen)
    model.load_state_dict(weights, strict=True)
    assert model.layers[0].self_attn.sliding_window == WINDOW and not model.layers[0].self_attn.is_causal
    assert model.layers[1].self_attn.sliding_window is None

    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    lm_head = 3.0 * torch.randn(VOCAB, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    k = len(TARGET_LAYER_IDS)
    io_in = {
        "round1_target_hidden": 2.0 * torch.randn(L1, k * HIDDEN, generator=gen),
        "round2_target_hidden": 2.0 * torch.randn(L2, k * HIDDEN, generator=gen),
    }
    cur1 = int(torch.randint(0, MASK_ID, (1,), generator=gen))
    cur2 = (cur1 + 17) % MASK_ID
    io_in["round1_block_ids"] = torch.tensor([cur1] + [MASK_ID] * (BLOCK - 1))
    io_in["round2_block_ids"] = torch.tensor([cur2] + [MASK_ID] * (BLOCK - 1))

    out = run_two_rounds(ref, model, embed, lm_head, io_in)
    again = run_two_rounds(ref, new_model(weights), embed, lm_head, io_in)
    for key in out:
        assert torch.equal(out[key], again[key]), f"not reproducible: {key}"
    print("reproducible: a fresh model from the same weights is bit-identical")

    # The features the fixture is meant to exercise must show in the outputs.
    margin = greedy_margin(out)
    print(f"smallest greedy score margin: {margin:.4f}")
    assert margin > 1e-3, margin
    for r in (1, 2):
        unary_best = out[f"round{r}_candidates"][torch.arange(BLOCK - 1), out[f"round{r}_unary"].argmax(-1)]
        print(f"round {r}: greedy path {out[f'round{r}_greedy_path'].tolist()}, "
              f"unary argmax {unary_best.tolist()}, sampled {out[f'round{r}_sampled_path'].tolist()}")
    assert any(
        not torch.equal(out[f"round{r}_greedy_path"],
                        out[f"round{r}_candidates"][torch.arange(BLOCK - 1), out[f"round{r}_unary"].argmax(-1)])
        for r in (1, 2)
    ), "the selector never changes the unary choice: the fixture would not pin the transition term"
    assert float((out["round1_logits"].abs() - SOFTCAP * 0.75).clamp_min(0).max()) > 0, "soft cap never bites"
    checks = {}
    for what, change in [
        ("window", lambda c: setattr(c, "sliding_window", 4096)),
        ("conv", lambda c: c.dflash_config.update(conv_kernel_size=1)),
    ]:
        cfg = build_config(ref.Qwen3Config)
        change(cfg)
        m = ref.DFlash2DraftModel(cfg).to(torch.float32).eval()
        sd = dict(weights)
        if what == "conv":
            sd = {n: (w[:, :1].contiguous() if n.endswith("base_kernel") else w) for n, w in sd.items()}
            for n in list(sd):
                if n.endswith("kernel_projection.weight"):
                    groups = HIDDEN // CONV_GROUP
                    w = sd[n].view(2, CONV_TAPS, groups, HIDDEN)[:, :1]
                    sd[n] = w.reshape(2 * groups, HIDDEN).contiguous()
        m.load_state_dict(sd, strict=True)
        alt = run_two_rounds(ref, m, embed, lm_head, io_in)
        checks[what] = float((alt["round2_raw_logits"] - out["round2_raw_logits"]).abs().max())
    print(f"max |logit change| when a feature is removed: {checks}")
    assert all(v > 1e-2 for v in checks.values()), checks

    # ---- write the fixture ----
    os.makedirs(args.out, exist_ok=True)
    config = {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dflash_config": model.config.dflash_config,
        "dtype": "float32",
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "is_causal": False,
        "layer_types": LAYER_TYPES,
        "max_position_embeddings": 4096,
        "num_attention_heads": N_HEADS,
        "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": N_KV_HEADS,
        "num_target_layers": NUM_TARGET_LAYERS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
        "use_sliding_window": True,
        "vocab_size": VOCAB,
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    # The published format stores the codebooks without `.weight` (the reference key-maps them).
    stored = {
        (n[: -len(".weight")] if "codebook" in n else n): w.contiguous() for n, w in sorted(weights.items())
    }
    save_file(stored, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    io = {
        "embed_tokens": embed,
        "lm_head": lm_head,
        "round1_target_hidden": io_in["round1_target_hidden"],
        "round2_target_hidden": io_in["round2_target_hidden"],
    }
    io.update(out)
    io = {key: v.contiguous() for key, v in sorted(io.items())}
    save_file(io, os.path.join(args.out, "io.safetensors"), metadata={"format": "pt"})
    meta = {
        "reference": "z-lab/dflash dflash/model.py (07ebd93: DFlash2DraftModel)",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "seed": SEED,
        "temperature": TEMPERATURE,
        "generator": "tools/make_drafter2_fixture.py",
        "smallest_greedy_margin": margin,
        "feature_checks_max_abs_logit_change": checks,
    }
    with open(os.path.join(args.out, "fixture.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")

    # The written config.json + model.safetensors alone rebuild the same drafter.
    disk_cfg = ref.Qwen3Config.from_json_file(os.path.join(args.out, "config.json"))
    disk_cfg._attn_implementation = "sdpa"
    disk = ref.DFlash2DraftModel(disk_cfg).to(torch.float32).eval()
    loaded = load_file(os.path.join(args.out, "model.safetensors"))
    disk.load_state_dict({(n + ".weight" if n.endswith("codebook") else n): w for n, w in loaded.items()}, strict=True)
    out_disk = run_two_rounds(ref, disk, embed, lm_head, io_in)
    for key in out:
        assert torch.equal(out[key], out_disk[key]), f"from-disk model differs: {key}"
    print("from-disk config.json + model.safetensors: bit-identical outputs")
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({total} bytes)")
    assert total < 1_000_000


if __name__ == "__main__":
    main()
