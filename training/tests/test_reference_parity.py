"""Parity of the training drafter with the published reference drafter.

The golden fixture ``crates/models/tests/fixtures/dflash_ref_tiny/`` was produced
by z-lab/dflash ``DFlashDraftModel`` (see tools/README.md, "DFlash drafter
reference fixture"): a tiny random f32 drafter driven through two drafting
rounds, round 2 reusing the draft context cache of round 1.  These tests load
the fixture's ``config.json`` + ``model.safetensors`` through the package's own
loader (``export.load_drafter``) and check that

(a) inference-style forwards of the two blocks (round 2 recomputes the whole
    context 0..13 instead of using a cache) reproduce the reference hidden
    states, logits, argmax drafts and the context K of the draft cache;
(b) ONE packed training forward with anchors 11 and 14 over the sequence's
    context features (mask: context strictly before the anchor, own block
    bidirectional) gives the same per-slot outputs, and ``block_loss`` turns
    them into the expected cross entropy.

Skipped with a message when torch (or safetensors) is missing.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")
pytest.importorskip("safetensors", reason="safetensors is not installed: skipping the reference parity tests")

from dflash_train.anchors import block_input_ids, block_position_ids  # noqa: E402
from dflash_train.drafter import (apply_rope, batch_to_torch, block_loss, dense_mask_torch,  # noqa: E402
                                  rope_cos_sin)
from dflash_train.export import load_drafter  # noqa: E402
from dflash_train.masks import block_context_visibility, dense_block_attention_mask  # noqa: E402

FIXTURE = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "crates", "models", "tests",
                                       "fixtures", "dflash_ref_tiny"))
ATOL = 1e-4

if not os.path.exists(os.path.join(FIXTURE, "io.safetensors")):
    pytest.skip(f"reference fixture not found at {FIXTURE}", allow_module_level=True)


@pytest.fixture(scope="module")
def ref():
    from safetensors.torch import load_file

    drafter, cfg = load_drafter(FIXTURE)
    io = load_file(os.path.join(FIXTURE, "io.safetensors"))
    return drafter, cfg, io


def _max_diff(a, b):
    return float((a.double() - b.double()).abs().max())


def _inference_round(drafter, io, feats, ctx_pos, n):
    """Inference-style forward of round n: no mask, the block sees the whole
    given context and its whole block (bidirectional)."""
    blk = io[f"round{n}_block_ids"]
    pos = io[f"round{n}_block_positions"]
    x = torch.nn.functional.embedding(blk, io["embed_tokens"])[None]
    with torch.no_grad():
        h = drafter(x, pos[None], feats[None], ctx_pos[None], None)[0]
    return h, h[1:] @ io["lm_head"].T


def test_config_and_weights_load(ref):
    drafter, cfg, io = ref
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.target_layer_ids == [1, 3] and cfg.num_target_layers == 6
    assert cfg.block_size == 8 and cfg.mask_token_id == 511 == int(io["mask_token_id"][0])
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 1e4 and cfg.vocab_size == 512
    assert drafter.fc.weight.dtype == torch.float32


def test_context_fusion(ref):
    drafter, _, io = ref
    for n in (1, 2):
        with torch.no_grad():
            c = drafter.fuse_context(io[f"round{n}_target_hidden"])
        assert _max_diff(c, io[f"round{n}_ctx_fused"]) < ATOL


def test_round_layout_matches_fixture(ref):
    _, cfg, io = ref
    assert io["round1_ctx_positions"].tolist() == list(range(0, 11))
    assert io["round2_ctx_positions"].tolist() == list(range(11, 14))
    assert io["round1_block_positions"].tolist() == list(range(11, 19))
    assert io["round2_block_positions"].tolist() == list(range(14, 22))
    for n, cur in ((1, 29), (2, 64)):
        assert io[f"round{n}_block_ids"].tolist() == [cur] + [cfg.mask_token_id] * 7
        # the package's block builder gives the same ids/positions
        a = int(io[f"round{n}_block_positions"][0])
        ids = np.zeros(a + 1, dtype=np.int64)
        ids[a] = cur
        got = block_input_ids(ids, np.array([a]), np.array([True]), cfg.block_size, cfg.mask_token_id)[0]
        assert got.tolist() == io[f"round{n}_block_ids"].tolist()
        assert block_position_ids(np.array([a]), cfg.block_size)[0].tolist() == \
            io[f"round{n}_block_positions"].tolist()


def test_inference_round1(ref):
    drafter, _, io = ref
    h, logits = _inference_round(drafter, io, io["round1_target_hidden"], io["round1_ctx_positions"], 1)
    dh, dl = _max_diff(h, io["round1_hidden_out"]), _max_diff(logits, io["round1_logits"])
    print(f"round1 inference: max|dh|={dh:.3g} max|dlogits|={dl:.3g}")
    assert dh < ATOL and dl < ATOL
    assert logits.argmax(-1).tolist() == io["round1_draft_ids"].tolist()


def test_inference_round2_full_context(ref):
    """Round 2 with the whole context (11 cached + 3 new rows) recomputed: the
    reference's cached context K/V equal recomputing them."""
    drafter, _, io = ref
    feats = torch.cat([io["round1_target_hidden"], io["round2_target_hidden"]])
    cpos = torch.cat([io["round1_ctx_positions"], io["round2_ctx_positions"]])
    h, logits = _inference_round(drafter, io, feats, cpos, 2)
    dh, dl = _max_diff(h, io["round2_hidden_out"]), _max_diff(logits, io["round2_logits"])
    print(f"round2 inference: max|dh|={dh:.3g} max|dlogits|={dl:.3g}")
    assert dh < ATOL and dl < ATOL
    assert logits.argmax(-1).tolist() == io["round2_draft_ids"].tolist()


def test_context_kv_matches_reference_cache(ref):
    """The context K (k_norm + RoPE at absolute positions) and V of every layer
    equal the reference draft cache: pins the absolute positions, which the
    outputs alone do not (they only depend on relative positions)."""
    drafter, cfg, io = ref
    feats = torch.cat([io["round1_target_hidden"], io["round2_target_hidden"]])[None]
    cpos = torch.arange(14)[None]
    with torch.no_grad():
        c = drafter.fuse_context(feats)
        cos, sin = rope_cos_sin(cpos, cfg.head_dim, cfg.rope_theta)
        for i, layer in enumerate(drafter.layers):
            at = layer.self_attn
            k = at.k_norm(at.k_proj(c).view(1, 14, at.nkv, at.hd)).transpose(1, 2)
            k = apply_rope(k, cos, sin)[0]
            v = at.v_proj(c).view(1, 14, at.nkv, at.hd).transpose(1, 2)[0]
            for n, s in ((1, 11), (2, 14)):
                assert _max_diff(k[:, :s], io[f"round{n}_cache_k_l{i}"]) < ATOL
                assert _max_diff(v[:, :s], io[f"round{n}_cache_v_l{i}"]) < ATOL


def _packed_batch(cfg, io, s_len=16):
    """One training sequence holding both rounds: tokens 29 at 11 and 64 at 14,
    anchors 11 and 14, context features of positions 0..13 from the fixture and
    garbage at 14.. (must be invisible to both blocks)."""
    anchors = np.array([11, 14], dtype=np.int64)
    valid = np.array([True, True])
    ids = np.full(s_len, 7, dtype=np.int64)
    ids[11], ids[14] = int(io["round1_block_ids"][0]), int(io["round2_block_ids"][0])
    labels = np.zeros((2, cfg.block_size), dtype=np.int64)
    labels[0, 1:] = io["round1_draft_ids"].numpy()
    labels[1, 1:] = io["round2_draft_ids"].numpy()
    weights = np.zeros((2, cfg.block_size), dtype=np.float32)
    weights[:, 1:] = 1.0
    nb = {
        "input_ids": ids[None],
        "attention_mask": np.ones((1, s_len), dtype=bool),
        "position_ids": np.arange(s_len, dtype=np.int64)[None],
        "block_ids": block_input_ids(ids, anchors, valid, cfg.block_size, cfg.mask_token_id)[None],
        "block_pos": block_position_ids(anchors, cfg.block_size)[None],
        "block_valid": valid[None],
        "ctx_visible": block_context_visibility(anchors, valid, s_len)[None],
        "labels": labels[None],
        "weights": weights[None],
    }
    gen = torch.Generator().manual_seed(0)
    feats = torch.cat([io["round1_target_hidden"], io["round2_target_hidden"],
                       5.0 * torch.randn(s_len - 14, io["round1_target_hidden"].shape[1], generator=gen)])
    return nb, feats[None]


def test_training_packed_forward_matches_reference(ref):
    drafter, cfg, io = ref
    nb, feats = _packed_batch(cfg, io)
    # the mask is the documented one: block at 11 sees context 0..10, block at 14 sees 0..13
    m = dense_block_attention_mask(nb["block_pos"][0, :, 0], nb["block_valid"][0], 16, cfg.block_size)
    assert m[:8, :16].sum(1).tolist() == [11] * 8 and m[8:, :16].sum(1).tolist() == [14] * 8
    bt = batch_to_torch(nb, "cpu")
    b, n, bs = bt["block_ids"].shape
    x = torch.nn.functional.embedding(bt["block_ids"].view(b, n * bs), io["embed_tokens"])
    mask = dense_mask_torch(bt["ctx_visible"], bs)
    assert np.array_equal(mask[0, 0].numpy(), m)
    with torch.no_grad():
        h = drafter(x, bt["block_pos"].view(b, n * bs), feats, bt["position_ids"], mask).view(n, bs, -1)
    logits = h[:, 1:] @ io["lm_head"].T
    for j, rnd in enumerate((1, 2)):
        dh = _max_diff(h[j], io[f"round{rnd}_hidden_out"])
        dl = _max_diff(logits[j], io[f"round{rnd}_logits"])
        print(f"packed training forward, block at {int(nb['block_pos'][0, j, 0])} vs round{rnd}: "
              f"max|dh|={dh:.3g} max|dlogits|={dl:.3g}")
        assert dh < ATOL and dl < ATOL


def test_block_loss_on_reference_blocks(ref):
    """block_loss over the packed batch: with the reference drafts as labels
    every weighted slot is 'correct', and the loss equals the mean CE computed
    from the reference logits."""
    drafter, cfg, io = ref
    nb, feats = _packed_batch(cfg, io)
    bt = batch_to_torch(nb, "cpu")
    with torch.no_grad():
        loss, correct, w = block_loss(drafter, io["embed_tokens"], io["lm_head"], feats, bt,
                                      chunk_rows=5, checkpoint_ce=False)
    assert correct[0, :, 1:].all() and not correct[0, :, 0].any()
    ref_logits = torch.cat([io["round1_logits"], io["round2_logits"]])
    ref_labels = torch.cat([io["round1_draft_ids"], io["round2_draft_ids"]])
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.double(), ref_labels)
    assert abs(float(loss) - float(ref_loss)) < ATOL


def test_load_drafter_reads_our_own_export(ref, tmp_path):
    """export_drafter (bf16, published names) -> load_drafter gives back the
    same config and the bf16-rounded weights."""
    from dflash_train.export import check_export, export_drafter

    drafter, cfg, _ = ref
    export_drafter(drafter.state_dict(), cfg, str(tmp_path / "exp"), {}, max_shard_bytes=300_000)
    assert check_export(str(tmp_path / "exp"))["ok"]
    d2, cfg2 = load_drafter(str(tmp_path / "exp"))
    assert cfg2 == cfg
    for k, v in drafter.state_dict().items():
        assert torch.equal(d2.state_dict()[k], v.to(torch.bfloat16).float()), k
