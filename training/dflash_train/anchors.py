"""Random anchor sampling inside assistant spans (pure numpy).

An anchor ``a`` starts a training block ``[token_a, MASK x (B-1)]`` at positions
``a .. a+B-1``.  ``a`` is valid iff ``loss_mask[a]`` and ``loss_mask[a+1]`` are
both set: the anchor token itself is part of the assistant response (at
inference slot 0 always holds an already-committed response token) and so is
its first prediction target.
"""

from __future__ import annotations

import numpy as np


def valid_anchor_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Indices ``a`` (ascending, int64) with ``loss_mask[a] & loss_mask[a+1]``."""
    m = np.asarray(loss_mask).astype(bool).reshape(-1)
    if m.size < 2:
        return np.zeros(0, dtype=np.int64)
    ok = m[:-1] & m[1:]
    return np.nonzero(ok)[0].astype(np.int64)


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, rng: np.random.Generator):
    """Sample up to ``num_anchors`` distinct valid anchors.

    Returns ``(anchors, valid)``: ``anchors`` int64 [num_anchors] with the
    sampled positions sorted ascending in the first ``valid.sum()`` slots and
    0 in the padding slots; ``valid`` bool [num_anchors].
    Sampling is uniform without replacement over all valid positions.
    """
    if num_anchors < 1:
        raise ValueError("num_anchors must be >= 1")
    cand = valid_anchor_positions(loss_mask)
    k = min(num_anchors, cand.size)
    anchors = np.zeros(num_anchors, dtype=np.int64)
    valid = np.zeros(num_anchors, dtype=bool)
    if k > 0:
        pick = rng.choice(cand.size, size=k, replace=False)
        anchors[:k] = np.sort(cand[pick])
        valid[:k] = True
    return anchors, valid


def block_input_ids(input_ids: np.ndarray, anchors: np.ndarray, valid: np.ndarray,
                    block_size: int, mask_token_id: int) -> np.ndarray:
    """Block token ids [N, B]: slot 0 = ``input_ids[a]``, slots 1.. = mask id.
    Padding (invalid) blocks are all mask ids."""
    ids = np.asarray(input_ids).reshape(-1)
    n = anchors.shape[0]
    out = np.full((n, block_size), mask_token_id, dtype=np.int64)
    out[valid, 0] = ids[anchors[valid]]
    return out


def block_position_ids(anchors: np.ndarray, block_size: int) -> np.ndarray:
    """Absolute positions [N, B]: ``a + j`` (same positions as the target)."""
    return anchors[:, None].astype(np.int64) + np.arange(block_size, dtype=np.int64)[None, :]
