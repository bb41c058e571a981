"""Block-sparse (FlexAttention) training attention == the dense-mask reference."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")

from dflash_train.batch import collate  # noqa: E402
from dflash_train.config import DrafterConfig  # noqa: E402
from dflash_train.drafter import DFlashDrafter, batch_to_torch, block_loss, dense_mask_torch  # noqa: E402
from dflash_train.flexattn import TILE, FlexBlocks, padded_context_len  # noqa: E402

BS = 16


def tiny_cfg(dflash2: bool = False):
    v2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=8) if dflash2 else {}
    return DrafterConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=16, vocab_size=300, num_target_layers=4,
                         target_layer_ids=[1, 2], block_size=BS, mask_token_id=5, rms_norm_eps=1e-6,
                         rope_theta=10000.0, **v2)


def make_batch(seed: int, lengths, prompt_lens, num_anchors: int, short_frac: float = 0.0):
    rng = np.random.default_rng(seed)
    seqs = []
    for s, p in zip(lengths, prompt_lens):
        ids = rng.integers(6, 300, size=s)
        lm = np.zeros(s, dtype=bool)
        lm[p:] = True
        seqs.append((ids, lm))
    return collate(seqs, num_anchors=num_anchors, block_size=BS, mask_token_id=5, gamma=4.0, rng=rng,
                   short_frac=short_frac, short_lens=(2, 4, 8))


def tile_classes_from_dense(dense: torch.Tensor):
    """(any-visible, all-visible) per (q tile, kv tile) of a dense mask [b, 1, Q, K]."""
    b, _, q, k = dense.shape
    t = dense.view(b, q // TILE, TILE, k // TILE, TILE)
    return t.any(-1).any(2), t.all(-1).all(2)


@pytest.mark.parametrize("short_frac", [0.0, 0.5])
def test_block_mask_covers_exactly_the_visible_tiles(short_frac):
    nb = make_batch(1, [300, 520, 90], [40, 200, 10], num_anchors=24, short_frac=short_frac)
    bt = batch_to_torch(nb, "cpu")
    sp = padded_context_len(520)
    blocks = FlexBlocks(bt["block_pos"][:, :, 0], bt["block_valid"], BS, sp, bt["block_len"])
    vis = torch.nn.functional.pad(bt["ctx_visible"], (0, sp - bt["ctx_visible"].shape[-1]))
    dense = dense_mask_torch(vis, BS, bt["block_len"])
    anyv, allv = tile_classes_from_dense(dense)
    bm = blocks.block_mask
    nq, nk = anyv.shape[1], anyv.shape[2]
    for bi in range(anyv.shape[0]):
        for qi in range(nq):
            part = set(bm.kv_indices[bi, 0, qi, :int(bm.kv_num_blocks[bi, 0, qi])].tolist())
            full = set(bm.full_kv_indices[bi, 0, qi, :int(bm.full_kv_num_blocks[bi, 0, qi])].tolist())
            assert not (part & full)
            for kj in range(nk):
                if allv[bi, qi, kj]:
                    assert kj in full or kj in part, (bi, qi, kj)
                elif anyv[bi, qi, kj]:
                    assert kj in part, (bi, qi, kj)
                else:
                    assert kj not in part and kj not in full, (bi, qi, kj)
                if kj in full:
                    assert allv[bi, qi, kj]
    # the mask_mod reproduces the dense mask element for element
    q = torch.arange(dense.shape[2])[:, None]
    k = torch.arange(dense.shape[3])[None, :]
    for bi in range(dense.shape[0]):
        got = bm.mask_mod(torch.tensor(bi), torch.tensor(0), q, k)
        assert torch.equal(got, dense[bi, 0])


def run_both(device: str, grads: bool, dflash2: bool = False, short_frac: float = 0.0):
    torch.manual_seed(0)
    dt = torch.float64 if device == "cpu" else torch.float32
    dr = DFlashDrafter(tiny_cfg(dflash2))
    dr.reset_parameters(seed=3)
    if dflash2:  # convolutions and a selector that are not no-ops
        with torch.no_grad():
            for n, p in dr.named_parameters():
                if "_conv." in n or "candidate_selector." in n:
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    dr = dr.to(device=device, dtype=dt)
    g = torch.Generator().manual_seed(4)
    emb = (torch.randn(300, 64, generator=g) * 0.5).to(device=device, dtype=dt)
    head = (torch.randn(300, 64, generator=g) * 0.5).to(device=device, dtype=dt)
    nb = make_batch(2, [200, 130], [30, 60], num_anchors=16, short_frac=short_frac)
    bt = batch_to_torch(nb, device)
    s = bt["input_ids"].shape[1]
    feats = torch.randn(2, s, 2 * 64, generator=g).to(device=device, dtype=dt)
    res = []
    for ctx_pad in (0, padded_context_len(s)):
        dr.zero_grad()
        with torch.set_grad_enabled(grads):
            loss, correct, _ = block_loss(dr, emb, head, feats, bt, checkpoint_ce=False, ctx_pad=ctx_pad)
        if grads:
            loss.backward()
        res.append((loss.detach(), correct,
                    {n: p.grad.clone() for n, p in dr.named_parameters()} if grads else {}))
    return res


# (DFlash2 drafters refuse the engine's short blocks: no short-block case for them)
ARMS = [(False, 0.0), (True, 0.0), (False, 0.5)]


@pytest.mark.parametrize("dflash2,short_frac", ARMS)
def test_flex_loss_equals_dense_cpu(dflash2, short_frac):
    """Forward on the CPU (FlexAttention has no CPU backward): loss and argmaxes equal (DFlash2:
    the selector's picks; short_frac: half the blocks are the engine's short ones)."""
    (l0, c0, _), (l1, c1, _) = run_both("cpu", grads=False, dflash2=dflash2, short_frac=short_frac)
    assert torch.allclose(l0, l1, rtol=1e-10, atol=1e-12)
    assert torch.equal(c0, c1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NOT RUN: needs CUDA (compiled flex fwd+bwd); "
                    "run this file on the device machine")
@pytest.mark.parametrize("dflash2,short_frac", ARMS)
def test_flex_loss_and_grads_equal_dense_cuda(dflash2, short_frac):
    (l0, c0, g0), (l1, c1, g1) = run_both("cuda", grads=True, dflash2=dflash2, short_frac=short_frac)
    assert torch.allclose(l0, l1, rtol=1e-3, atol=1e-5)
    for n in g0:  # the compiled kernel may run its fp32 dots in TF32: compare by relative norm
        rel = float((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-12))
        assert rel < 1e-2, (n, rel)


def test_flex_rejects_bad_shapes():
    a = torch.zeros(2, 3, dtype=torch.long)
    v = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        FlexBlocks(a, v, BS, 256)  # 3 x 16 queries is not a multiple of the tile
    with pytest.raises(ValueError):
        FlexBlocks(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool), BS, 200)
