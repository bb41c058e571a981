"""Collate regenerated sequences into numpy training batches (pure numpy)."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from .anchors import block_input_ids, block_position_ids, sample_anchors, sample_block_lens
from .loss import block_labels_and_weights
from .masks import block_context_visibility


def loss_mask_from_prompt_len(total_len: int, prompt_len: int) -> np.ndarray:
    m = np.zeros(total_len, dtype=bool)
    m[prompt_len:] = True
    return m


def collate(seqs: Sequence[Tuple[np.ndarray, np.ndarray]], *, num_anchors: int, block_size: int,
            mask_token_id: int, gamma: float, rng: np.random.Generator,
            pad_token_id: int = 0, pad_multiple: int = 8, short_frac: float = 0.0,
            short_lens: Sequence[int] = (2, 3, 4)) -> Dict[str, np.ndarray]:
    """seqs: list of (input_ids [S_i], loss_mask [S_i]).  Right-padded to S = max S_i
    rounded up to a multiple of ``pad_multiple`` (keeps attention-mask strides aligned).
    ``short_frac`` of the blocks are short ones of a length from ``short_lens``
    (anchors.sample_block_lens).

    Returns numpy arrays:
      input_ids [b,S] int64, attention_mask [b,S] bool, position_ids [b,S],
      block_ids [b,N,B], block_pos [b,N,B], block_valid [b,N] bool,
      block_len [b,N] int64 (B, or a short block's length),
      ctx_visible [b,N,S] bool (context part of the mask, see masks.py),
      labels [b,N,B] int64, weights [b,N,B] float32.
    """
    b = len(seqs)
    s_max = max(int(x[0].shape[0]) for x in seqs)
    s_max = -(-s_max // pad_multiple) * pad_multiple
    out = {
        "input_ids": np.full((b, s_max), pad_token_id, dtype=np.int64),
        "attention_mask": np.zeros((b, s_max), dtype=bool),
        "block_ids": np.zeros((b, num_anchors, block_size), dtype=np.int64),
        "block_pos": np.zeros((b, num_anchors, block_size), dtype=np.int64),
        "block_valid": np.zeros((b, num_anchors), dtype=bool),
        "block_len": np.full((b, num_anchors), block_size, dtype=np.int64),
        "ctx_visible": np.zeros((b, num_anchors, s_max), dtype=bool),
        "labels": np.zeros((b, num_anchors, block_size), dtype=np.int64),
        "weights": np.zeros((b, num_anchors, block_size), dtype=np.float32),
    }
    for i, (ids, lm) in enumerate(seqs):
        s = ids.shape[0]
        out["input_ids"][i, :s] = ids
        out["attention_mask"][i, :s] = True
        anchors, valid = sample_anchors(lm, num_anchors, rng)
        out["block_ids"][i] = block_input_ids(ids, anchors, valid, block_size, mask_token_id)
        out["block_pos"][i] = block_position_ids(anchors, block_size)
        out["block_valid"][i] = valid
        lens = sample_block_lens(valid, block_size, short_frac, short_lens, rng)
        out["block_len"][i] = lens
        out["ctx_visible"][i] = block_context_visibility(anchors, valid, s_max)
        lab, w = block_labels_and_weights(ids, lm, anchors, valid, block_size, gamma, lens)
        out["labels"][i] = lab
        out["weights"][i] = w
    out["position_ids"] = np.broadcast_to(np.arange(s_max, dtype=np.int64), (b, s_max)).copy()
    return out


def length_bucketed_batches(lengths: Sequence[int], batch_size: int, rng: np.random.Generator,
                            bucket_batches: int = 32) -> List[np.ndarray]:
    """One epoch of batches (index arrays): shuffle, then sort by length inside
    windows of ``bucket_batches * batch_size`` to limit padding, then shuffle
    the batch order."""
    n = len(lengths)
    perm = rng.permutation(n)
    lens = np.asarray(lengths)
    win = batch_size * bucket_batches
    batches = []
    for st in range(0, n, win):
        chunk = perm[st:st + win]
        chunk = chunk[np.argsort(lens[chunk], kind="stable")]
        for j in range(0, chunk.size, batch_size):
            batches.append(chunk[j:j + batch_size])
    order = rng.permutation(len(batches))
    return [batches[k] for k in order]
