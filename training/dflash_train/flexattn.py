"""Block-sparse training attention with FlexAttention: only the visible work is done.

The dense training mask (masks.py) has ``N*B`` queries against ``S + N*B`` keys, but a block's
queries see only the context before their anchor and their own ``B`` block keys: with 256
anchors of 16 tokens over ~1,000 context positions the dense form computes ~10x the visible
scores.  Here the keys are ``[context padded to Sp ; block keys]`` with ``Sp`` a multiple of
the tile (so every shape is static and the compiled kernel is built once), anchors are sorted
ascending inside each sequence (anchors.py), and the BlockMask is built directly from them:

* query tile ``i`` (``TILE / B`` consecutive blocks) and context tile ``j``: *full* when
  ``(j + 1) * TILE <= min anchor`` of the tile's blocks (all of them valid), *partial* when
  ``j * TILE < max anchor``, skipped otherwise;
* the block keys of query tile ``i`` are exactly key tile ``Sp / TILE + i`` (*partial*: the
  block-diagonal inside it).

Inside partial tiles ``mask_mod`` applies the exact rule: context key ``p`` visible iff
``p < anchor`` of the query's block (0 for padding blocks, which then see only their own
block), block key visible iff it belongs to the query's block and lies inside its length (a
short block's, see anchors.py).  Scores, softmax and the output
equal the dense SDPA form up to rounding (tests/test_flexattn_torch.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

TILE = 128  # FlexAttention's default sparse block size (queries and keys)

_compiled = None


def padded_context_len(max_seq_len: int) -> int:
    """Static context length: ``max_seq_len`` rounded up to the tile."""
    return -(-int(max_seq_len) // TILE) * TILE


class FlexBlocks:
    """What the drafter's attention needs in place of a dense mask: the BlockMask.

    ``anchors`` [b, N] (padding blocks: any value; ``valid`` [b, N] False), ``block_size`` B,
    ``ctx_pad`` Sp, ``block_len`` [b, N] the blocks' lengths (all B when None).  The
    mask_mod's visible-length and block-length buffers are shared by every FlexBlocks of one
    shape: build the next one only after the previous step's backward."""

    def __init__(self, anchors: torch.Tensor, valid: torch.Tensor, block_size: int, ctx_pad: int,
                 block_len: Optional[torch.Tensor] = None):
        b, n = anchors.shape
        if TILE % block_size:
            raise ValueError(f"block size {block_size} must divide the tile {TILE}")
        if ctx_pad % TILE:
            raise ValueError(f"padded context {ctx_pad} must be a multiple of {TILE}")
        if (n * block_size) % TILE:
            raise ValueError(f"anchors x block size ({n} x {block_size}) must be a multiple of {TILE}")
        self.block_size, self.ctx_pad = block_size, ctx_pad
        vis = torch.where(valid, anchors, torch.zeros_like(anchors)).to(torch.int32).clamp_(max=ctx_pad)
        lens = (torch.full_like(vis, block_size) if block_len is None
                else block_len.to(device=vis.device, dtype=torch.int32))
        self.block_mask = build_block_mask(vis, valid, block_size, ctx_pad, lens)


def build_block_mask(vis: torch.Tensor, valid: torch.Tensor, block_size: int, ctx_pad: int,
                     lens: torch.Tensor) -> BlockMask:
    """BlockMask of the module doc from per-block visible context lengths ``vis`` [b, N] and
    block lengths ``lens`` [b, N]."""
    b, n = vis.shape
    per = TILE // block_size
    nq = n * block_size // TILE
    nctx = ctx_pad // TILE
    dev = vis.device
    tiles_v = vis.view(b, nq, per)
    tiles_ok = valid.view(b, nq, per)
    big = torch.iinfo(torch.int32).max
    vmin = torch.where(tiles_ok, tiles_v, torch.full_like(tiles_v, big)).amin(-1)
    all_valid = tiles_ok.all(-1)
    vmin = torch.where(all_valid, vmin, torch.zeros_like(vmin))
    vmax = tiles_v.amax(-1)
    j = torch.arange(nctx, device=dev, dtype=torch.int32)
    full = (j + 1)[None, None, :] * TILE <= vmin[..., None]                # [b, nq, nctx]
    part = (j[None, None, :] * TILE < vmax[..., None]) & ~full
    # block keys: tile nctx + i, always partial
    own = torch.zeros(b, nq, nq, dtype=torch.bool, device=dev)
    own[:, torch.arange(nq), torch.arange(nq)] = True
    part = torch.cat([part, own], dim=-1)
    full = torch.cat([full, torch.zeros_like(own)], dim=-1)

    def to_idx(m: torch.Tensor):
        cnt = m.sum(-1, dtype=torch.int32)
        # visible tile indices first (stable order), the rest after
        key = torch.where(m, 0, 1).to(torch.int32) * m.shape[-1] + torch.arange(m.shape[-1], device=dev,
                                                                                   dtype=torch.int32)
        idx = key.argsort(-1).to(torch.int32)
        return cnt[:, None].contiguous(), idx[:, None].contiguous()

    kv_num, kv_idx = to_idx(part)
    full_num, full_idx = to_idx(full)
    buf, len_buf, mask_mod = _mask_mod(tuple(vis.shape), block_size, ctx_pad, vis.device)
    buf.copy_(vis)
    len_buf.copy_(lens)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod, seq_lengths=(n * block_size, ctx_pad + n * block_size))


_MASK_MODS: dict = {}


def _mask_mod(shape, block_size: int, ctx_pad: int, device):
    """One mask_mod function and one pair of buffers (visible context lengths, block lengths)
    per shape, reused every step, so the compiled kernel sees the same function and tensors (no
    recompilation per batch)."""
    key = (shape, block_size, ctx_pad, str(device))
    if key not in _MASK_MODS:
        vis = torch.zeros(shape, dtype=torch.int32, device=device)
        lens = torch.full(shape, block_size, dtype=torch.int32, device=device)

        def mask_mod(bi, h, q_idx, kv_idx):
            blk = q_idx // block_size
            ctx_ok = (kv_idx < ctx_pad) & (kv_idx < vis[bi, blk])
            own = ((kv_idx >= ctx_pad) & ((kv_idx - ctx_pad) // block_size == blk)
                   & ((kv_idx - ctx_pad) % block_size < lens[bi, blk]))
            return ctx_ok | own

        _MASK_MODS[key] = (vis, lens, mask_mod)
    return _MASK_MODS[key]


def pad_context(x: torch.Tensor, ctx_pad: int, dim: int) -> torch.Tensor:
    """Zero-pad (or reject) ``x`` along ``dim`` to ``ctx_pad`` positions."""
    s = x.shape[dim]
    if s > ctx_pad:
        raise ValueError(f"context of {s} positions exceeds the padded length {ctx_pad}")
    if s == ctx_pad:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, ctx_pad - s]
    return F.pad(x, pad)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: FlexBlocks, scale: float,
           compiled: Optional[bool] = None) -> torch.Tensor:
    """q [b, Hq, N*B, d]; k, v [b, Hkv, Sp + N*B, d] -> [b, Hq, N*B, d].  Compiled on CUDA
    (the eager form materialises every score and is only a reference)."""
    global _compiled
    use = q.is_cuda if compiled is None else compiled
    fn = flex_attention
    if use:
        if _compiled is None:
            _compiled = torch.compile(flex_attention, dynamic=False)
        fn = _compiled
    return fn(q, k, v, block_mask=blocks.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
