"""Recipe unit tests: need only numpy + pytest (no torch)."""

import json
import math

import numpy as np
import pytest

from dflash_train.anchors import (block_input_ids, block_position_ids, sample_anchors,
                                  valid_anchor_positions)
from dflash_train.batch import collate, length_bucketed_batches, loss_mask_from_prompt_len
from dflash_train.config import DrafterConfig, build_target_layer_ids, default_gamma
from dflash_train.loss import (IGNORE_INDEX, acceptance_lengths, block_labels_and_weights,
                               cross_entropy_np, position_decay, weighted_loss_np)
from dflash_train.masks import block_context_visibility, dense_block_attention_mask, own_block_mask


def spans_mask(n, spans):
    m = np.zeros(n, dtype=bool)
    for a, b in spans:
        m[a:b] = True
    return m


# ----------------------------------------------------------------------------- anchors
def test_valid_anchor_positions_needs_next_token_in_span():
    m = spans_mask(12, [(2, 5), (7, 8), (9, 12)])
    # (2,5): anchors 2,3 (4's next is 5, outside); (7,8): none; (9,12): 9,10
    assert valid_anchor_positions(m).tolist() == [2, 3, 9, 10]


def test_anchors_inside_spans_no_duplicates_sorted():
    rng = np.random.default_rng(0)
    m = spans_mask(200, [(10, 60), (100, 101), (120, 200)])
    ok = set(valid_anchor_positions(m).tolist())
    for _ in range(50):
        a, v = sample_anchors(m, 32, rng)
        got = a[v]
        assert v.sum() == 32
        assert len(set(got.tolist())) == got.size
        assert np.all(np.diff(got) > 0)
        for x in got:
            assert m[x] and m[x + 1] and int(x) in ok
        assert np.all(a[~v] == 0)


def test_anchor_count_limited_by_candidates():
    rng = np.random.default_rng(1)
    m = spans_mask(30, [(20, 26)])  # candidates 20..24 -> 5
    a, v = sample_anchors(m, 16, rng)
    assert v.sum() == 5
    assert a[v].tolist() == [20, 21, 22, 23, 24]
    assert not v[5:].any()


def test_anchor_count_limited_by_request_and_uniform():
    rng = np.random.default_rng(2)
    m = spans_mask(100, [(0, 100)])
    counts = np.zeros(100)
    for _ in range(2000):
        a, v = sample_anchors(m, 10, rng)
        assert v.sum() == 10
        counts[a[v]] += 1
    assert counts[99] == 0  # last token has no next token
    c = counts[:99] / counts[:99].mean()
    assert c.min() > 0.7 and c.max() < 1.3


def test_no_valid_anchor():
    rng = np.random.default_rng(3)
    a, v = sample_anchors(spans_mask(10, [(9, 10)]), 4, rng)
    assert not v.any()
    a, v = sample_anchors(np.zeros(0, bool), 4, rng)
    assert not v.any()


def test_block_ids_and_positions():
    ids = np.arange(100, 120)
    anchors = np.array([3, 7, 0])
    valid = np.array([True, True, False])
    b = block_input_ids(ids, anchors, valid, 4, mask_token_id=99)
    assert b.tolist() == [[103, 99, 99, 99], [107, 99, 99, 99], [99, 99, 99, 99]]
    p = block_position_ids(anchors, 4)
    assert p.tolist() == [[3, 4, 5, 6], [7, 8, 9, 10], [0, 1, 2, 3]]


# ----------------------------------------------------------------------------- masks
def test_context_visibility_strictly_before_anchor():
    anchors = np.array([0, 1, 5, 9])
    valid = np.array([True, True, True, False])
    vis = block_context_visibility(anchors, valid, 8)
    assert vis[0].sum() == 0            # anchor 0 sees no context
    assert vis[1].tolist() == [True] + [False] * 7
    assert vis[2].tolist() == [True] * 5 + [False] * 3   # positions 0..4, not 5
    assert not vis[3].any()             # invalid block: no context


def test_dense_mask_semantics():
    B, S = 4, 12
    anchors = np.array([2, 6, 9])
    valid = np.array([True, True, False])
    m = dense_block_attention_mask(anchors, valid, S, B)
    n = anchors.size
    assert m.shape == (n * B, S + n * B)
    for qi in range(n * B):
        qb, _ = divmod(qi, B)
        for kj in range(S + n * B):
            if kj < S:
                expect = bool(valid[qb] and kj < anchors[qb])
            else:
                kb = (kj - S) // B
                expect = kb == qb            # own block: all (bidirectional); other blocks: never
            assert m[qi, kj] == expect, (qi, kj)
    # no empty rows (softmax safety), own block fully visible incl. later slots
    assert m.any(axis=1).all()
    assert m[0, S + B - 1] and m[B - 1, S]


def test_own_block_mask_is_block_diagonal():
    o = own_block_mask(3, 2)
    assert o.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                          [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1]]


# ----------------------------------------------------------------------------- loss weights
def test_position_decay_values():
    d = position_decay(16, 7.0)
    assert d[0] == 0
    for k in range(1, 16):
        assert d[k] == pytest.approx(math.exp(-(k - 1) / 7.0), rel=1e-6)
    assert position_decay(8, 4.0)[2] == pytest.approx(math.exp(-0.25), rel=1e-6)
    assert default_gamma(16) == 7 and default_gamma(8) == 4


def test_labels_and_weights_values():
    ids = np.arange(1000, 1020)
    lm = spans_mask(20, [(5, 12), (15, 20)])
    anchors = np.array([5, 10, 17, 0])
    valid = np.array([True, True, True, False])
    B, g = 6, 4.0
    lab, w = block_labels_and_weights(ids, lm, anchors, valid, B, g)
    dec = position_decay(B, g)
    # block at 5: targets 6..10 all in span
    assert lab[0].tolist() == [IGNORE_INDEX, 1006, 1007, 1008, 1009, 1010]
    np.testing.assert_allclose(w[0], dec)
    # block at 10: targets 11 (in), 12,13,14 (out of span), 15 (in)
    assert lab[1].tolist() == [IGNORE_INDEX, 1011, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 1015]
    np.testing.assert_allclose(w[1], [0, dec[1], 0, 0, 0, dec[5]])
    # block at 17: targets 18, 19 in range; 20.. out of range
    assert lab[2].tolist() == [IGNORE_INDEX, 1018, 1019] + [IGNORE_INDEX] * 3
    np.testing.assert_allclose(w[2], [0, dec[1], dec[2], 0, 0, 0])
    # invalid block: nothing
    assert (w[3] == 0).all() and (lab[3] == IGNORE_INDEX).all()
    assert (w[:, 0] == 0).all()


def test_weighted_loss_normalisation():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11))
    labels = rng.integers(0, 11, size=(3, 5))
    w = rng.random((3, 5)).astype(np.float32)
    w[0] = 0
    labels[0] = IGNORE_INDEX
    ce = cross_entropy_np(logits, labels)
    assert (ce[0] == 0).all()
    ref = (w * ce).sum() / w.sum()
    assert weighted_loss_np(ce, w) == pytest.approx(ref)
    # invariant to scaling all weights
    assert weighted_loss_np(ce, 3 * w) == pytest.approx(ref)
    assert weighted_loss_np(ce, np.zeros_like(w)) == 0.0
    # CE of a single row by hand
    x = logits[1, 2]
    by_hand = math.log(np.exp(x).sum()) - x[labels[1, 2]]
    assert ce[1, 2] == pytest.approx(by_hand)


def test_acceptance_lengths():
    correct = np.array([[0, 1, 1, 0, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], dtype=bool)
    w = np.ones((3, 5), np.float32)
    w[2, 3:] = 0  # out of span ends the run
    assert acceptance_lengths(correct, w).tolist() == [3, 1, 3]


# ----------------------------------------------------------------------------- collate / config
def test_collate_shapes_and_consistency():
    rng = np.random.default_rng(5)
    seqs = []
    for n, p in [(30, 10), (50, 20), (12, 4)]:
        ids = rng.integers(0, 500, size=n)
        seqs.append((ids, loss_mask_from_prompt_len(n, p)))
    b = collate(seqs, num_anchors=8, block_size=4, mask_token_id=499, gamma=4.0, rng=rng)
    assert b["input_ids"].shape == (3, 56)  # 50 rounded up to a multiple of 8
    assert b["ctx_visible"].shape == (3, 8, 56)
    assert b["block_ids"].shape == (3, 8, 4)
    assert b["attention_mask"].sum(1).tolist() == [30, 50, 12]
    for i, (ids, lm) in enumerate(seqs):
        v = b["block_valid"][i]
        anchors = b["block_pos"][i, :, 0]
        for n_ in np.nonzero(v)[0]:
            a = anchors[n_]
            assert lm[a] and lm[a + 1]
            assert b["block_ids"][i, n_, 0] == ids[a]
            assert (b["block_ids"][i, n_, 1:] == 499).all()
            assert b["ctx_visible"][i, n_].sum() == a
        assert (b["weights"][i][~v] == 0).all()


def test_length_bucketed_batches_cover_epoch():
    rng = np.random.default_rng(0)
    lens = rng.integers(10, 500, size=103)
    bs = length_bucketed_batches(lens, 8, rng, bucket_batches=4)
    allidx = np.concatenate(bs)
    assert sorted(allidx.tolist()) == list(range(103))


def test_target_layer_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # 7.5->8, 20.5->20 (half-to-even)
    assert build_target_layer_ids(30, 1) == [15]


def test_config_roundtrip():
    cfg = DrafterConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=3,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                        num_target_layers=30, target_layer_ids=[1, 8, 14, 20, 27], mask_token_id=16,
                        rope_theta=100000.0, rms_norm_eps=1e-5)
    d = json.loads(cfg.to_json())
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"mask_token_id": 16, "target_layer_ids": [1, 8, 14, 20, 27]}
    assert d["tie_word_embeddings"] is False and d["attention_bias"] is False
    assert DrafterConfig.from_hf_dict(d) == cfg


def test_short_blocks_are_drawn_only_for_valid_anchors_and_only_when_asked():
    from dflash_train.anchors import sample_block_lens

    valid = np.array([True] * 300 + [False] * 20)
    rng = np.random.default_rng(5)
    state = rng.bit_generator.state
    assert (sample_block_lens(valid, 16, 0.0, (2, 4), rng) == 16).all()
    assert rng.bit_generator.state == state  # nothing drawn: runs without short blocks are unchanged
    lens = sample_block_lens(valid, 16, 0.5, (2, 4), rng)
    assert set(np.unique(lens[:300]).tolist()) == {2, 4, 16}
    assert 100 < int((lens[:300] < 16).sum()) < 200
    assert (lens[300:] == 16).all()
    for bad in [(1, 4), (2, 16), ()]:
        with pytest.raises(ValueError, match="short block lengths"):
            sample_block_lens(valid, 16, 0.5, bad, rng)


def test_a_short_blocks_slots_past_its_length_are_no_keys_and_take_no_loss():
    ids = np.arange(30, dtype=np.int64)
    lm = np.ones(30, dtype=bool)
    anchors, valid = np.array([3, 10]), np.array([True, True])
    lens = np.array([2, 4])
    _, w = block_labels_and_weights(ids, lm, anchors, valid, 4, 4.0, lens)
    assert w[0, 1] > 0 and not w[0, 2:].any()
    assert (w[1, 1:] > 0).all()
    own = own_block_mask(2, 4, lens)
    assert own[0].tolist() == [True, True, False, False, False, False, False, False]
    assert own[3].tolist() == own[0].tolist()  # slot 3 of a block of 2 still sees slots 0..1 only
    assert own[4].tolist() == [False] * 4 + [True] * 4
