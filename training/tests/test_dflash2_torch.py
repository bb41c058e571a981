"""DFlash2 in the training package: config round trip, exact no-op initialisation,
parity with the published reference on the golden fixture, the selector objective,
and an export the Rust loader's layout check accepts.

The parity test loads ``crates/models/tests/fixtures/dflash2_ref_tiny`` (made by
tools/make_drafter2_fixture.py from z-lab's ``DFlash2DraftModel``) into the training
drafter and recomputes round 1 (11 context rows, block at 11..18, one sliding layer
of window 6 and one full layer) with one packed-style forward.  The fixture's
embedding scale, output multiplier and soft cap (inference-only knobs the training
config does not export) are applied by the test.

Skipped with a message when torch (or safetensors) is missing.
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")

from dflash_train.config import DrafterConfig  # noqa: E402
from dflash_train.drafter import DFlashDrafter, batch_to_torch, block_loss  # noqa: E402

FIXTURE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "crates", "models", "tests",
                                       "fixtures", "dflash2_ref_tiny"))


def tiny_cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=96, num_target_layers=6,
                target_layer_ids=[1, 3], mask_token_id=95, block_size=4, rms_norm_eps=1e-6,
                conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    base.update(kw)
    return DrafterConfig(**base)


def test_config_round_trip_and_checks():
    cfg = tiny_cfg(sliding_window=32)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlash2DraftModel"]
    assert d["dflash_config"]["selector_top_k"] == 5 and d["dflash_config"]["conv_group_size"] == 16
    assert d["layer_types"] == ["sliding_attention"] * 2 and d["is_causal"] is False
    back = DrafterConfig.from_hf_dict(json.loads(json.dumps(d)))
    assert back == cfg
    v1 = tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    assert v1.to_hf_dict()["architectures"] == ["DFlashDraftModel"]
    with pytest.raises(ValueError, match="conv_group_size"):
        tiny_cfg(conv_group_size=24).validate()
    with pytest.raises(ValueError, match="needs conv_kernel_size"):
        tiny_cfg(selector_rank=None).validate()
    bad = dict(d, dflash_config=dict(d["dflash_config"], final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        DrafterConfig.from_hf_dict(bad)


def _batch(cfg, seed=0):
    """A packed batch: one sequence of 20 tokens, anchors 5 and 11."""
    rng = np.random.default_rng(seed)
    s, bs = 20, cfg.block_size
    ids = rng.integers(0, cfg.vocab_size - 1, size=(1, s))
    anchors = np.array([[5, 11]])
    pos = anchors[..., None] + np.arange(bs)
    block_ids = np.full((1, 2, bs), cfg.mask_token_id)
    block_ids[..., 0] = ids[0, anchors[0]]
    labels = ids[0, np.minimum(pos, s - 1)]
    labels[..., 0] = -100
    w = np.ones((1, 2, bs), dtype=np.float32)
    w[..., 0] = 0
    return {
        "input_ids": ids, "attention_mask": np.ones((1, s), dtype=bool), "position_ids": np.arange(s)[None],
        "block_ids": block_ids, "block_pos": pos, "block_valid": np.ones((1, 2), dtype=bool),
        "ctx_visible": np.arange(s)[None, None, :] < anchors[..., None],
        "labels": labels, "weights": w,
    }


def _inputs(cfg, seed):
    """The packed batch of `_batch` with random embeddings, head and features (hidden 64):
    (batch, emb, head, feats, dense mask, block embeddings, the generator, for more)."""
    from dflash_train.drafter import dense_mask_torch
    bt = batch_to_torch(_batch(cfg), "cpu")
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(cfg.vocab_size, 64, generator=g)
    head = torch.randn(cfg.vocab_size, 64, generator=g) / 8
    feats = torch.randn(1, 20, 2 * 64, generator=g)
    mask = dense_mask_torch(bt["ctx_visible"], cfg.block_size)
    x = torch.nn.functional.embedding(bt["block_ids"].view(1, -1), emb)
    return bt, emb, head, feats, mask, x, g


def test_fresh_dflash2_is_a_dflash_drafter():
    """Identity base taps, zero projections and a zero successor codebook: the
    same backbone weights give the same hidden states as a DFlash drafter, and
    the selector's scores are the unary logits."""
    cfg2 = tiny_cfg()
    cfg1 = tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    d2, d1 = DFlashDrafter(cfg2), DFlashDrafter(cfg1)
    d2.reset_parameters(seed=3)
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if k in d1.state_dict()}, strict=True)
    bt, emb, head, feats, mask, x, g = _inputs(cfg2, seed=1)
    stats = {}
    with torch.no_grad():
        h2 = d2(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
        h1 = d1(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
        l2, c2, w = block_loss(d2, emb, head, feats, bt, checkpoint_ce=False, stats=stats)
        l1, c1, _ = block_loss(d1, emb, head, feats, bt, checkpoint_ce=False)
    assert torch.equal(h1, h2), "the convolutions start as the identity"
    # Loss: unary CE + the selector's CE (a softmax over the unary top-k at first).
    wsum = float(w.sum())
    assert abs(float(l2) - float(l1) - stats["selector_loss"] * stats["selector_coverage"]) < 1e-5
    assert torch.equal(c1, c2), "the selector's picks equal the unary argmax at initialisation"
    assert wsum > 0
    h = torch.randn(3, 64, generator=g)
    unary = torch.randn(3, 5, generator=g)
    cand = torch.randint(0, 96, (3, 5), generator=g)
    s = d2.candidate_selector.scores(unary, cand, h, torch.tensor([1, 2, 3]))
    assert torch.equal(s, unary)


def test_selector_objective_is_teacher_forced_ce_over_the_top_k():
    # Half the vocabulary as candidates: some targets are candidates, some are not.
    cfg = tiny_cfg(selector_top_k=48)
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=5)
    with torch.no_grad():
        d.candidate_selector.successor_codebook.normal_()
    g = torch.Generator().manual_seed(2)
    emb = torch.randn(cfg.vocab_size, 64, generator=g)
    head = torch.randn(cfg.vocab_size, 64, generator=g) / 8
    feats = torch.randn(1, 20, 2 * 64, generator=g)
    nb = _batch(cfg)
    bt = batch_to_torch(nb, "cpu")
    stats = {}
    loss, _, w = block_loss(d, emb, head, feats, bt, checkpoint_ce=False, selector_alpha=0.5, stats=stats)
    unary_only, _, _ = block_loss(d, emb, head, feats, bt, checkpoint_ce=False, selector_alpha=0.0)
    # By hand: hidden states of the weighted slots, their logits, top-k, predecessor = true previous token.
    from dflash_train.drafter import dense_mask_torch
    with torch.no_grad():
        x = torch.nn.functional.embedding(bt["block_ids"].view(1, -1), emb)
        h = d(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], dense_mask_torch(bt["ctx_visible"], 4))[0]
        wts = bt["weights"].view(-1)
        sel_sum, cov_sum = 0.0, 0.0
        for r in torch.nonzero(wts > 0)[:, 0].tolist():
            label = int(bt["labels"].view(-1)[r])
            prev = int(bt["input_ids"][0, int(bt["block_pos"].view(-1)[r]) - 1])
            logits = h[r] @ head.T
            unary, cand = logits.topk(cfg.selector_top_k)
            if label not in cand.tolist():
                continue
            sc = d.candidate_selector.scores(unary[None], cand[None], h[r][None], torch.tensor([prev]))[0]
            sel_sum += float(wts[r]) * float(-torch.log_softmax(sc, -1)[cand.tolist().index(label)])
            cov_sum += float(wts[r])
    assert 0 < cov_sum < float(wts.sum())
    want = float(unary_only.detach()) + 0.5 * sel_sum / float(wts.sum())
    assert abs(float(loss.detach()) - want) < 1e-4
    assert abs(stats["selector_loss"] - sel_sum / cov_sum) < 1e-4
    assert abs(stats["selector_coverage"] - cov_sum / float(wts.sum())) < 1e-6
    # Gradients reach every DFlash2 parameter.
    loss.backward()
    for name, p in d.named_parameters():
        if "conv" in name or "candidate_selector" in name:
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


def test_export_layout_and_reload(tmp_path):
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    from dflash_train.export import check_export, export_drafter, expected_tensor_shapes, load_drafter
    cfg = tiny_cfg(sliding_window=16)
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=7)
    exp = expected_tensor_shapes(cfg)
    assert exp["layers.1.attention_conv.base_kernel"] == [2, 2, 64]
    assert exp["layers.0.mlp_conv.kernel_projection.weight"] == [16, 64]
    assert exp["candidate_selector.predecessor_codebook"] == [96, 8]
    export_drafter(d.state_dict(), cfg, str(tmp_path), {"target_name": "tiny"})
    report = check_export(str(tmp_path))
    assert not report.get("problems"), report
    back, cfg2 = load_drafter(str(tmp_path))
    assert cfg2 == cfg
    card = open(tmp_path / "README.md").read()
    assert "DFlash2" in card and "selector" in card


@pytest.mark.skipif(not os.path.exists(os.path.join(FIXTURE, "io.safetensors")),
                    reason="DFlash2 reference fixture not found")
def test_forward_matches_the_reference_fixture():
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    from safetensors.torch import load_file

    with open(os.path.join(FIXTURE, "config.json")) as f:
        raw = json.load(f)
    dc = dict(raw["dflash_config"])
    scale = dc.pop("input_embedding_scale")
    mult = dc.pop("output_multiplier")
    cap = dc.pop("final_logit_softcapping")
    cfg = DrafterConfig.from_hf_dict(dict(raw, dflash_config=dc))
    assert cfg.is_dflash2 and cfg.layer_window(0) == 6 and cfg.layer_window(1) is None
    d = DFlashDrafter(cfg)
    d.load_state_dict(load_file(os.path.join(FIXTURE, "model.safetensors")), strict=True)
    io = load_file(os.path.join(FIXTURE, "io.safetensors"))
    feats = io["round1_target_hidden"][None]
    ids = io["round1_block_ids"]
    pos = io["round1_block_positions"][None]
    x = torch.nn.functional.embedding(ids, io["embed_tokens"])[None] * scale
    s, q = feats.shape[1], ids.shape[0]
    mask = torch.ones(1, 1, q, s + q, dtype=torch.bool)
    with torch.no_grad():
        h = d(x, pos, feats, torch.arange(s)[None], mask)[0, 1:]
        raw_logits = h @ io["lm_head"].T
    diff = float((raw_logits - io["round1_raw_logits"]).abs().max())
    print(f"round 1 raw logits: max |diff| {diff:.2e}")
    assert diff < 1e-4
    # The selector's greedy walk over the transformed logits gives the reference path.
    logits = torch.tanh(raw_logits * mult / cap) * cap
    prev = int(ids[0])
    path = []
    with torch.no_grad():
        for slot in range(q - 1):
            unary, cand = logits[slot].topk(cfg.selector_top_k)
            sc = d.candidate_selector.scores(unary[None], cand[None], h[slot][None], torch.tensor([prev]))[0]
            prev = int(cand[sc.argmax()])
            path.append(prev)
    assert path == io["round1_greedy_path"].tolist()
    # walk.selector_path (the walk tau of DFlash2 runs) makes the same path in one batched pass.
    from dflash_train.walk import selector_path
    padded = torch.cat([logits[:1], logits])[None]  # slot 0 (the anchor's own row) is not read
    hh = torch.cat([h[:1], h])[None]
    got = selector_path(d.candidate_selector, padded, hh, ids[:1])
    assert got[0, 1:].tolist() == io["round1_greedy_path"].tolist() and int(got[0, 0]) == int(ids[0])


def test_a_dflash_drafter_grows_into_a_dflash2_one():
    """train.as_dflash2 + load_backbone (stream_train --init-drafter DFLASH --dflash2): the
    grown drafter keeps every DFlash weight, its own parts start as no-ops, so its hidden
    states and greedy walk equal the DFlash drafter's; a drafter of another shape is refused."""
    from types import SimpleNamespace

    from dflash_train.train import as_dflash2, load_backbone
    from dflash_train.walk import selector_path

    v1 = tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    d1 = DFlashDrafter(v1)
    d1.reset_parameters(seed=5)
    a = SimpleNamespace(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5)
    cfg2 = as_dflash2(v1, a)
    assert cfg2.is_dflash2 and not v1.is_dflash2 and cfg2.num_hidden_layers == v1.num_hidden_layers
    d2 = DFlashDrafter(cfg2)
    d2.reset_parameters(seed=9)
    load_backbone(d2, d1.state_dict())
    for k, v in d1.state_dict().items():
        assert torch.equal(d2.state_dict()[k], v), k
    bt, _, head, feats, mask, x, _ = _inputs(cfg2, seed=2)
    with torch.no_grad():
        h1 = d1(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
        h2 = d2(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
        assert torch.equal(h1, h2)
        logits = (h2 @ head.T).view(-1, cfg2.block_size, cfg2.vocab_size)
        hb = h2.view(-1, cfg2.block_size, 64)
        anchor = bt["block_ids"].view(-1, cfg2.block_size)[:, 0]
        path = selector_path(d2.candidate_selector, logits, hb, anchor)
    assert torch.equal(path[:, 1:], logits[:, 1:].argmax(-1)), "a no-op selector walks the argmax"
    wide = DFlashDrafter(as_dflash2(tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None,
                                             selector_top_k=None, num_hidden_layers=3), a))
    with pytest.raises(ValueError, match="does not fit"):
        load_backbone(wide, d1.state_dict())


@pytest.mark.parametrize("dflash2", [False, True])
def test_grown_layers_start_as_no_ops(dflash2):
    """train.grown_config + load_backbone(layers=) (stream_train --init-drafter D --grow-layers N):
    the first layers keep the resumed drafter's weights, the new ones copy its last layer with
    zero output projections, so the grown drafter's hidden states equal the resumed one's; a
    drafter can only grow."""
    from types import SimpleNamespace

    from dflash_train.train import as_dflash2, grown_config, load_backbone

    v1 = tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None)
    d1 = DFlashDrafter(v1)
    d1.reset_parameters(seed=5)
    cfg = grown_config(v1, 4)
    if dflash2:
        cfg = as_dflash2(cfg, SimpleNamespace(conv_kernel_size=2, conv_group_size=16, selector_rank=8,
                                              selector_top_k=5))
    assert cfg.num_hidden_layers == 4 and cfg.to_hf_dict()["num_hidden_layers"] == 4
    assert len(cfg.to_hf_dict()["layer_types"]) == 4
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=9)
    load_backbone(d, d1.state_dict(), layers=2)
    sd = d.state_dict()
    for k, v in d1.state_dict().items():
        assert torch.equal(sd[k], v), k
    for i in (2, 3):
        assert torch.equal(sd[f"layers.{i}.self_attn.q_proj.weight"], sd["layers.1.self_attn.q_proj.weight"])
        assert not sd[f"layers.{i}.self_attn.o_proj.weight"].any()
        assert not sd[f"layers.{i}.mlp.down_proj.weight"].any()
    bt, _, _, feats, mask, x, _ = _inputs(cfg, seed=2)
    with torch.no_grad():
        h1 = d1(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
        h = d(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask)
    assert torch.equal(h1, h)
    # The new layers learn: their output projections get gradients at once.
    _, _, _, feats, mask, x, _ = _inputs(cfg, seed=3)
    d(x, bt["block_pos"].view(1, -1), feats, bt["position_ids"], mask).square().sum().backward()
    assert d.layers[3].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="already has 2 layers"):
        grown_config(v1, 1)
    sliding = tiny_cfg(conv_kernel_size=None, conv_group_size=None, selector_rank=None, selector_top_k=None,
                       sliding_window=8, layer_types=["full_attention", "sliding_attention"])
    assert grown_config(sliding, 3).layer_types == ["full_attention", "sliding_attention", "sliding_attention"]


@pytest.mark.parametrize("module", ["train", "stream_train"])
def test_a_negative_layer_count_is_a_usage_error(module, capsys):
    """--grow-layers below 0 exits with a usage error naming the flag, before any model loads."""
    import importlib

    mod = importlib.import_module(f"dflash_train.{module}")
    dirs = ["--out-dir", "o"] if module == "train" else ["--data-dir", "d", "--work", "w"]
    with pytest.raises(SystemExit) as e:
        mod.main(["--target", "no-such-target", *dirs, "--grow-layers", "-1"])
    assert e.value.code == 2
    assert "--grow-layers -1" in capsys.readouterr().err
