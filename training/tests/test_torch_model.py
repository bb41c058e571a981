"""Torch-dependent tests (tiny random target + drafter).  Skipped without torch."""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")

from dflash_train.batch import collate, loss_mask_from_prompt_len  # noqa: E402
from dflash_train.checkpoint import (dequant_int8_blockwise, dequant_log8, load_optimizer_state,  # noqa: E402
                                     quant_int8_blockwise, quant_log8, read_checkpoint_weights,
                                     save_checkpoint)
from dflash_train.config import DrafterConfig  # noqa: E402
from dflash_train.drafter import DFlashDrafter, batch_to_torch, block_loss, dense_mask_torch  # noqa: E402
from dflash_train.export import check_export, export_drafter, load_sharded  # noqa: E402
from dflash_train.loss import acceptance_lengths  # noqa: E402
from dflash_train.masks import dense_block_attention_mask  # noqa: E402
from dflash_train.train import acceptance_lengths_torch  # noqa: E402

V, H, L_T = 97, 32, 6


def tiny_cfg(layers=1, taps=(1, 2, 3), block=4):
    return DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=V,
                         num_target_layers=L_T, target_layer_ids=list(taps), mask_token_id=V - 1,
                         block_size=block, rms_norm_eps=1e-5, rope_theta=10000.0)


@pytest.fixture(scope="module")
def tiny_target():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L_T,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.requires_grad_(False)
    return m


def make_batch(cfg, seed=0, n_seqs=3, num_anchors=6, short_frac=0.0, short_lens=(2, 3)):
    rng = np.random.default_rng(seed)
    seqs = []
    for n, p in [(40, 12), (33, 9), (25, 20)][:n_seqs]:
        ids = rng.integers(0, V - 1, size=n)
        seqs.append((ids, loss_mask_from_prompt_len(n, p)))
    return collate(seqs, num_anchors=num_anchors, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                   gamma=4.0, rng=rng, short_frac=short_frac, short_lens=short_lens)


@pytest.mark.parametrize("short_frac", [0.0, 0.6])
def test_dense_mask_torch_matches_numpy(short_frac):
    cfg = tiny_cfg()
    nb = make_batch(cfg, short_frac=short_frac)
    assert (nb["block_len"] < cfg.block_size).any() == (short_frac > 0)
    m = dense_mask_torch(torch.from_numpy(nb["ctx_visible"]), cfg.block_size, torch.from_numpy(nb["block_len"]))
    for i in range(nb["input_ids"].shape[0]):
        anchors = nb["block_pos"][i, :, 0]
        ref = dense_block_attention_mask(anchors, nb["block_valid"][i], nb["input_ids"].shape[1], cfg.block_size,
                                         nb["block_len"][i])
        assert np.array_equal(m[i, 0].numpy(), ref)


def test_target_features_match_hidden_states(tiny_target):
    from dflash_train.target import target_features

    ids = torch.randint(0, V, (2, 11))
    att = torch.ones_like(ids)
    att[1, 8:] = 0
    taps = [1, 3, 4]
    f = target_features(tiny_target, ids, att, taps, early_exit=True)
    out = tiny_target(input_ids=ids, attention_mask=att, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1)
    assert f.shape == (2, 11, 3 * H)
    torch.testing.assert_close(f, ref)
    f2 = target_features(tiny_target, ids, att, taps, early_exit=False)
    torch.testing.assert_close(f2, ref)


def _run(drafter, emb, feats, nb):
    bt = batch_to_torch(nb, "cpu")
    b, n, bs = bt["block_ids"].shape
    x = torch.nn.functional.embedding(bt["block_ids"].view(b, n * bs), emb)
    mask = dense_mask_torch(bt["ctx_visible"], bs, bt["block_len"])
    return drafter(x, bt["block_pos"].view(b, n * bs), feats, bt["position_ids"], mask).view(b, n, bs, -1)


def _alone(drafter, emb, feats, nb, i, j, length):
    """Block j of sequence i, its first ``length`` tokens, drafted alone as inference does: no
    mask, the whole block and the context strictly before its anchor."""
    a = int(nb["block_pos"][i, j, 0])
    blk = torch.from_numpy(nb["block_ids"][i, j, :length])[None]
    pos = torch.from_numpy(nb["block_pos"][i, j, :length])[None]
    x = torch.nn.functional.embedding(blk, emb)
    return drafter(x, pos, feats[i:i + 1, :a], torch.arange(a)[None], None)[0]


def test_packed_blocks_equal_single_block_inference():
    """Each packed training block must equal an inference-style forward of that
    block alone with only the context strictly before its anchor."""
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2)
    d = DFlashDrafter(cfg).eval()
    emb = torch.randn(V, H)
    nb = make_batch(cfg, seed=1)
    S = nb["input_ids"].shape[1]
    feats = torch.randn(nb["input_ids"].shape[0], S, cfg.num_taps * H)
    with torch.no_grad():
        packed = _run(d, emb, feats, nb)
        for i in range(nb["input_ids"].shape[0]):
            for j in np.nonzero(nb["block_valid"][i])[0]:
                single = _alone(d, emb, feats, nb, i, j, cfg.block_size)
                torch.testing.assert_close(packed[i, j], single, atol=2e-5, rtol=2e-5)


def test_short_packed_blocks_equal_inference_of_the_short_block():
    """A short block (length L < B) packed among full ones equals the engine's forward of the
    block of L tokens [anchor, MASK x (L - 1)] alone, slot for slot, and takes no loss past L."""
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2, block=6)
    d = DFlashDrafter(cfg).eval()
    emb = torch.randn(V, H)
    nb = make_batch(cfg, seed=3, num_anchors=8, short_frac=0.7, short_lens=(2, 3, 5))
    lens = nb["block_len"][nb["block_valid"]]
    assert set(lens.tolist()) >= {2, 3, 5, 6}
    S = nb["input_ids"].shape[1]
    feats = torch.randn(nb["input_ids"].shape[0], S, cfg.num_taps * H)
    with torch.no_grad():
        packed = _run(d, emb, feats, nb)
        for i in range(nb["input_ids"].shape[0]):
            for j in np.nonzero(nb["block_valid"][i])[0]:
                L = int(nb["block_len"][i, j])
                assert not nb["weights"][i, j, L:].any()
                single = _alone(d, emb, feats, nb, i, j, L)
                torch.testing.assert_close(packed[i, j, :L], single, atol=2e-5, rtol=2e-5)


def test_future_context_and_other_blocks_do_not_leak():
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2)
    d = DFlashDrafter(cfg).eval()
    emb = torch.randn(V, H)
    nb = make_batch(cfg, seed=2, n_seqs=1)
    S = nb["input_ids"].shape[1]
    feats = torch.randn(1, S, cfg.num_taps * H)
    with torch.no_grad():
        base = _run(d, emb, feats, nb)
        j = int(np.nonzero(nb["block_valid"][0])[0][0])
        a = int(nb["block_pos"][0, j, 0])
        f2 = feats.clone()
        f2[:, a:] += 5.0  # anchor position and later
        out2 = _run(d, emb, f2, nb)
        torch.testing.assert_close(out2[0, j], base[0, j])
        nb3 = {k: v.copy() for k, v in nb.items()}
        others = [k for k in range(nb["block_ids"].shape[1]) if k != j]
        nb3["block_ids"][0, others, 0] = (nb3["block_ids"][0, others, 0] + 1) % (V - 1)
        out3 = _run(d, emb, feats, nb3)
        torch.testing.assert_close(out3[0, j], base[0, j])


def test_acceptance_lengths_torch_matches_numpy():
    rng = np.random.default_rng(0)
    c = rng.random((5, 7, 6)) < 0.7
    w = (rng.random((5, 7, 6)) < 0.9).astype(np.float32)
    t = acceptance_lengths_torch(torch.from_numpy(c), torch.from_numpy(w)).numpy()
    assert np.array_equal(t.reshape(-1), acceptance_lengths(c.reshape(-1, 6), w.reshape(-1, 6)))


def test_training_steps_reduce_loss(tiny_target):
    from dflash_train.target import embedding_weight, lm_head_weight, target_features

    torch.manual_seed(0)
    cfg = tiny_cfg(layers=1)
    d = DFlashDrafter(cfg)
    d.reset_parameters(seed=0)
    opt = torch.optim.AdamW(d.parameters(), lr=2e-2)
    nb = make_batch(cfg, seed=3)
    bt = batch_to_torch(nb, "cpu")
    feats = target_features(tiny_target, bt["input_ids"], bt["attention_mask"].long(), cfg.target_layer_ids)
    emb, head = embedding_weight(tiny_target), lm_head_weight(tiny_target)
    losses = []
    for _ in range(40):
        loss, correct, w = block_loss(d, emb, head, feats, bt, chunk_rows=7)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[1] < losses[0]
    assert losses[-1] < 0.85 * losses[0]
    assert not any(p.grad is not None for p in tiny_target.parameters())
    # loss equals the numpy reference definition
    with torch.no_grad():
        loss, _, w = block_loss(d, emb, head, feats, bt, checkpoint_ce=False)
        b, n, bs = bt["block_ids"].shape
        x = torch.nn.functional.embedding(bt["block_ids"].view(b, n * bs), emb)
        h = d(x, bt["block_pos"].view(b, n * bs), feats, bt["position_ids"],
              dense_mask_torch(bt["ctx_visible"], bs))
        logits = (h @ head.T).view(b, n, bs, -1).numpy()
    from dflash_train.loss import cross_entropy_np, weighted_loss_np
    ref = weighted_loss_np(cross_entropy_np(logits, nb["labels"]), nb["weights"])
    assert float(loss) == pytest.approx(ref, rel=1e-4)


def test_export_roundtrip_and_sharding(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2)
    d = DFlashDrafter(cfg)
    sd = d.state_dict()
    names = export_drafter(sd, cfg, str(tmp_path / "one"), {"target_name": "tiny"})
    assert names == ["model.safetensors"]
    rep = check_export(str(tmp_path / "one"))
    assert rep["ok"], rep
    names = export_drafter(sd, cfg, str(tmp_path / "sh"), {}, max_shard_bytes=20_000)
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    rep = check_export(str(tmp_path / "sh"), max_file_bytes=40_000)
    assert rep["ok"], rep
    got = load_sharded(str(tmp_path / "sh"))
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert got[k].dtype == torch.bfloat16
        torch.testing.assert_close(got[k].float(), v.to(torch.bfloat16).float())
    d2 = json.load(open(tmp_path / "sh" / "config.json"))
    assert DrafterConfig.from_hf_dict(d2) == cfg
    assert os.path.exists(tmp_path / "sh" / "README.md")
    with pytest.raises(ValueError):
        export_drafter({k: v for k, v in sd.items() if k != "fc.weight"}, cfg, str(tmp_path / "bad"))


def test_an_export_keeps_its_init_drafters_draft_vocabulary(tmp_path):
    """The shipped drafter's draft_vocab.safetensors (the CPU default drafts over its first
    4,096 ids) travels into an export trained from it; check_export reads past it."""
    from dflash_train.export import DRAFT_VOCAB, carry_draft_vocab
    from safetensors.torch import save_file

    torch.manual_seed(0)
    cfg = tiny_cfg(layers=2)
    init = tmp_path / "init"
    export_drafter(DFlashDrafter(cfg).state_dict(), cfg, str(init), {})
    ranks = torch.arange(40, dtype=torch.int32).flip(0)
    save_file({"ranked_ids": ranks}, str(init / DRAFT_VOCAB))
    out = tmp_path / "out"
    export_drafter(DFlashDrafter(cfg).state_dict(), cfg, str(out), {})
    assert not carry_draft_vocab(None, str(out)) and not (out / DRAFT_VOCAB).exists()
    assert carry_draft_vocab(str(init), str(out))
    assert (out / DRAFT_VOCAB).read_bytes() == (init / DRAFT_VOCAB).read_bytes()
    rep = check_export(str(out))
    assert rep["ok"], rep
    assert not carry_draft_vocab(str(out / "missing"), str(tmp_path))


def test_moment_codecs():
    torch.manual_seed(0)
    m = torch.randn(1000) * torch.logspace(-6, -2, 1000)
    q, s = quant_int8_blockwise(m)
    r = dequant_int8_blockwise(q, s, m.shape)
    blk_max = torch.nn.functional.pad(m.abs(), (0, 24)).view(-1, 256).amax(1).repeat_interleave(256)[:1000]
    assert ((r - m).abs() <= blk_max / 254 + 1e-12).all()
    v = torch.rand(1000) ** 6 * 1e-3
    v[::17] = 0
    c, prm = quant_log8(v)
    rv = dequant_log8(c, prm, v.shape)
    assert (rv[v == 0] == 0).all()
    rel = (rv[v > 0] / v[v > 0] - 1).abs()
    assert rel.max() < 0.12


@pytest.mark.parametrize("fmt", ["int8", "bf16", "none"])
def test_checkpoint_resume(tmp_path, fmt):
    torch.manual_seed(0)
    cfg = tiny_cfg(layers=1)
    d = DFlashDrafter(cfg)
    opt = torch.optim.AdamW(d.parameters(), lr=1e-3)
    for _ in range(3):
        loss = sum((p ** 2).sum() for p in d.parameters())
        opt.zero_grad()
        loss.backward()
        opt.step()
    ck = str(tmp_path / "ckpt")
    save_checkpoint(ck, d, opt, {"step": 3, "train_seconds": 1.5}, optim_state=fmt)
    save_checkpoint(ck, d, opt, {"step": 3, "train_seconds": 1.5}, optim_state=fmt)  # overwrite works
    sd, cfg2, st = read_checkpoint_weights(ck)
    assert cfg2 == cfg and st["step"] == 3
    d2 = DFlashDrafter(cfg2)
    d2.load_state_dict(sd)
    opt2 = torch.optim.AdamW(d2.parameters(), lr=1e-3)
    ok = load_optimizer_state(ck, d2, opt2)
    assert ok == (fmt != "none")
    if ok:
        for (n, p), p2 in zip(d.named_parameters(), d2.parameters()):
            s1, s2 = opt.state[p], opt2.state[p2]
            assert float(s2["step"]) == 3
            torch.testing.assert_close(s2["exp_avg"], s1["exp_avg"], atol=float(s1["exp_avg"].abs().max()) / 100 + 1e-12, rtol=0.02)
            torch.testing.assert_close(s2["exp_avg_sq"].sqrt(), s1["exp_avg_sq"].sqrt(), atol=1e-12, rtol=0.06)
        loss = sum((p ** 2).sum() for p in d2.parameters())
        opt2.zero_grad()
        loss.backward()
        opt2.step()  # a step after restoring works
    assert check_export(os.path.join(ck, "drafter"))["ok"]


def test_bf16_autocast_path(tiny_target):
    """The mixed-precision path used on the GPU (bf16 target, fp32 drafter under
    bf16 autocast), exercised with CPU autocast."""
    import copy

    from dflash_train.target import embedding_weight, lm_head_weight, target_features

    tgt = copy.deepcopy(tiny_target).to(torch.bfloat16)
    cfg = tiny_cfg(layers=2)
    d = DFlashDrafter(cfg)
    nb = make_batch(cfg, seed=4)
    bt = batch_to_torch(nb, "cpu")
    feats = target_features(tgt, bt["input_ids"], bt["attention_mask"].long(), cfg.target_layer_ids)
    assert feats.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, correct, w = block_loss(d, embedding_weight(tgt), lm_head_weight(tgt), feats, bt, chunk_rows=5)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in d.parameters())


def test_short_block_flags_are_checked_against_the_drafter():
    import types

    from dflash_train.train import short_block_lens

    flags = lambda frac, lens: types.SimpleNamespace(short_blocks=frac, short_block_lens=lens)
    assert short_block_lens(flags(0.3, "2,3,4"), tiny_cfg(block=8)) == [2, 3, 4]
    assert short_block_lens(flags(0.0, "2,9"), tiny_cfg(block=8)) == [2, 9]  # off: not checked
    for frac, lens, cfg, msg in [(1.5, "2", None, "share in 0..1"), (0.3, "2,x", None, "comma list"),
                                 (0.3, "2,8", tiny_cfg(block=8), "each must be in 2..7"),
                                 (0.3, "1", tiny_cfg(block=8), "each must be in 2..7")]:
        with pytest.raises(ValueError, match=msg):
            short_block_lens(flags(frac, lens), cfg)
    v2 = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=V, num_target_layers=L_T,
                       target_layer_ids=[1, 2], mask_token_id=V - 1, block_size=8, rms_norm_eps=1e-5,
                       rope_theta=10000.0, conv_kernel_size=2, conv_group_size=8, selector_rank=4,
                       selector_top_k=6)
    with pytest.raises(ValueError, match="DFlash2"):
        short_block_lens(flags(0.3, "2"), v2)
