"""Random anchor sampling inside assistant spans (pure numpy).

An anchor ``a`` starts a training block ``[token_a, MASK x (B-1)]`` at positions
``a .. a+B-1``.  A *short* block of length ``L < B`` stands for the engine's block of ``L``
tokens ``[token_a, MASK x (L-1)]``: its slots ``L..`` are neither keys nor loss positions
(masks.py, loss.py), so the drafter also learns the smaller blocks it is run with (a drafter
trained on blocks of 16 only predicts slot 1 markedly worse when fed 2 or 4 positions).  ``a`` is valid iff ``loss_mask[a]`` and ``loss_mask[a+1]`` are
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


def sample_block_lens(valid: np.ndarray, block_size: int, short_frac: float, short_lens,
                      rng: np.random.Generator) -> np.ndarray:
    """Block lengths int64 [N]: ``block_size``, except that each valid block is, with
    probability ``short_frac``, a short block of a length drawn uniformly from ``short_lens``
    (each in 2..block_size - 1).  Draws nothing from ``rng`` when ``short_frac`` is 0, so the
    batches of a run without short blocks do not change."""
    valid = np.asarray(valid, dtype=bool)
    lens = np.full(valid.shape[0], block_size, dtype=np.int64)
    if short_frac <= 0:
        return lens
    choices = np.asarray(list(short_lens), dtype=np.int64)
    if choices.size == 0 or choices.min() < 2 or choices.max() >= block_size:
        raise ValueError(f"short block lengths {choices.tolist()}: each must be in 2..{block_size - 1}")
    short = valid & (rng.random(valid.shape[0]) < short_frac)
    lens[short] = choices[rng.integers(0, choices.size, size=int(short.sum()))]
    return lens
