"""Labels and loss weights for block training (pure numpy).

Slot k (1 <= k < B) of the block anchored at a predicts token a+k ("same
position" prediction, like inference).  Weight:
    w[n, k] = valid[n] * (a+k < S) * loss_mask[a+k] * (k < len[n]) * exp(-(k-1)/gamma)
with len[n] the block's length (B unless the block is a short one, see anchors.py).
Slot 0 (the given anchor token) has weight 0.  Loss = sum(w * CE) / sum(w).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

IGNORE_INDEX = -100


def position_decay(block_size: int, gamma: float) -> np.ndarray:
    """float32 [B]: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = np.arange(block_size, dtype=np.float64)
    d = np.exp(-(k - 1.0) / float(gamma))
    d[0] = 0.0
    return d.astype(np.float32)


def block_labels_and_weights(input_ids: np.ndarray, loss_mask: np.ndarray, anchors: np.ndarray,
                             valid: np.ndarray, block_size: int, gamma: float,
                             block_len: Optional[np.ndarray] = None):
    """Returns ``(labels int64 [N, B], weights float32 [N, B])``.

    ``labels[n, k] = input_ids[a+k]`` where the target position exists, else
    IGNORE_INDEX (slot 0 is always IGNORE_INDEX).  Weights as in the module doc
    (``block_len`` [N]: the blocks' lengths, all B when None).
    """
    ids = np.asarray(input_ids).reshape(-1)
    lm = np.asarray(loss_mask).astype(bool).reshape(-1)
    s = ids.shape[0]
    pos = anchors[:, None].astype(np.int64) + np.arange(block_size, dtype=np.int64)[None, :]
    in_range = pos < s
    safe = np.where(in_range, pos, 0)
    labels = np.where(in_range, ids[safe], IGNORE_INDEX).astype(np.int64)
    labels[:, 0] = IGNORE_INDEX
    w = (in_range & lm[safe] & np.asarray(valid, dtype=bool)[:, None]).astype(np.float32)
    w *= position_decay(block_size, gamma)[None, :]
    if block_len is not None:
        w *= np.arange(block_size)[None, :] < np.asarray(block_len)[:, None]
    labels = np.where(w > 0, labels, IGNORE_INDEX)
    return labels, w


def cross_entropy_np(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per-row CE (float64); rows with IGNORE_INDEX labels give 0."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]
    lab = np.where(labels == IGNORE_INDEX, 0, labels)
    picked = np.take_along_axis(x, lab[..., None], axis=-1)[..., 0]
    return np.where(labels == IGNORE_INDEX, 0.0, lse - picked)


def weighted_loss_np(per_token_ce: np.ndarray, weights: np.ndarray) -> float:
    """sum(w * ce) / sum(w); 0.0 when all weights are zero."""
    w = np.asarray(weights, dtype=np.float64)
    tot = w.sum()
    if tot <= 0:
        return 0.0
    return float((w * np.asarray(per_token_ce, dtype=np.float64)).sum() / tot)


def acceptance_lengths(correct: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Teacher-forced acceptance length per block: 1 + number of leading slots
    k = 1.. that are predicted correctly (a slot with weight 0 ends the run).
    ``correct``/``weights`` are [N, B] (slot 0 ignored).  For greedily
    regenerated data this equals the greedy speculative acceptance (tau) of that
    block at inference time."""
    ok = np.asarray(correct, dtype=bool)[:, 1:] & (np.asarray(weights)[:, 1:] > 0)
    return 1 + np.cumprod(ok, axis=1).sum(axis=1)
