"""Training attention masks (pure numpy).

Keys of one packed sequence are ``[context (S positions) ; all N blocks (N*B)]``.
Queries are the N*B block tokens.  A query in the block anchored at ``a``:
  * sees context key ``p`` iff ``p < a`` (strictly before the anchor: at
    inference the anchor token's own target feature is not available yet),
  * sees every key of its own block (bidirectional inside the block) that lies inside the
    block's length (a block of length L < B stands for the engine's block of L tokens: its
    slots L.. are no keys, and no loss is taken there),
  * never sees keys of any other block.
Padding (invalid) blocks see only their own block, so no query row is empty.
``True`` means "may attend".
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def block_context_visibility(anchors: np.ndarray, valid: np.ndarray, ctx_len: int) -> np.ndarray:
    """bool [N, ctx_len]: context key p visible to block n iff valid[n] and p < anchors[n]."""
    p = np.arange(ctx_len, dtype=np.int64)[None, :]
    return (p < anchors[:, None]) & np.asarray(valid, dtype=bool)[:, None]


def own_block_mask(num_blocks: int, block_size: int, block_len: Optional[np.ndarray] = None) -> np.ndarray:
    """bool [N*B, N*B]: block-diagonal (query and key in the same block); with ``block_len``
    [N], key slot j of block n only where j < block_len[n]."""
    bid = np.repeat(np.arange(num_blocks), block_size)
    own = bid[:, None] == bid[None, :]
    if block_len is not None:
        slot = np.tile(np.arange(block_size), num_blocks)
        own &= (slot < np.repeat(np.asarray(block_len), block_size))[None, :]
    return own


def dense_block_attention_mask(anchors: np.ndarray, valid: np.ndarray, ctx_len: int,
                               block_size: int, block_len: Optional[np.ndarray] = None) -> np.ndarray:
    """bool [N*B, ctx_len + N*B]: the full mask of one sequence (reference form)."""
    n = anchors.shape[0]
    ctx = np.repeat(block_context_visibility(anchors, valid, ctx_len), block_size, axis=0)
    return np.concatenate([ctx, own_block_mask(n, block_size, block_len)], axis=1)
