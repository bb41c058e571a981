"""Conversation data (gen_data.Scheduler), shard streaming (stream_train.StreamData), WSD and
the walk tau (CPU, tiny models and a byte-level tokenizer)."""

import json
import re
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from dflash_train.batch import collate  # noqa: E402
from dflash_train.config import DrafterConfig  # noqa: E402
from dflash_train.drafter import DFlashDrafter, batch_to_torch, block_loss  # noqa: E402
from dflash_train.gen_data import Scheduler  # noqa: E402
from dflash_train.loss import acceptance_lengths  # noqa: E402
from dflash_train.store import conv_shard_paths, read_conv_shard  # noqa: E402
from dflash_train.stream_train import StreamData, is_val, lr_wsd  # noqa: E402
from dflash_train.target import CHATML_FALLBACK, target_features  # noqa: E402
from dflash_train.walk import walk_tau  # noqa: E402

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def byte_tok():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, pad_token=EOS)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHATML_FALLBACK
    return tok


def sched_args(tmp_path, **kw):
    a = dict(seed=3, slice_size=3, start_slice=0, max_inflight_slices=2, magpie_frac=0.5, magpie_followup=0.5,
             sample_frac=0.3, max_new_tokens=40, user_max_new=30, max_prompt_tokens=300, max_len=600,
             min_answer_room=16, eval=[], dtype="float32")
    a.update(kw)
    return types.SimpleNamespace(**a)


CONVS = [{"turns": ["hello there", "and then?", "why"]}, {"turns": ["what is 2+2"]},
         {"turns": ["tell a joke", "another"]}, {"turns": ["x" * 700]}]


def drive(sch, tok, n_requests):
    """Answers every request with a scripted text: 'A<k>' for answers, 'question <k>' for user turns."""
    eos = tok.convert_tokens_to_ids(EOS)
    for k in range(n_requests):
        rq = sch.next_request()
        if rq is None:
            break
        job, prompt, max_new, sampled = rq
        user_phase = job.kind == "magpie" and job.phase == "user"
        text = f"question number {k}" if user_phase else f"A{k} ok"
        resp = list(tok(text, add_special_tokens=False)["input_ids"]) + [eos]
        sch.finish(job, prompt, resp, True)


def test_scheduler_conversations_and_resume(tmp_path, byte_tok):
    tok = byte_tok
    eos = tok.convert_tokens_to_ids(EOS)
    out = str(tmp_path / "data")
    sch = Scheduler(tok, [eos], CONVS, out, sched_args(tmp_path))
    drive(sch, tok, 60)
    paths = conv_shard_paths(out)
    assert len(paths) >= 2
    recs = [r for p in paths for r in read_conv_shard(p)]
    cids = [r["cid"] for r in recs]
    assert len(set(cids)) == len(cids)
    kinds = json.load(open(tmp_path / "data" / "state.json"))
    assert kinds["next_slice"] == len([p for p in paths if "_part" not in p])
    n_share = 0
    for r in recs:
        text = tok.decode(r["ids"].tolist())
        ids = r["ids"].tolist()
        m = r["loss_mask"]
        if not r["magpie"]:
            n_share += 1
        # every answer span holds one scripted answer ending with EOS, nothing else is trained on
        starts = np.flatnonzero(m & ~np.r_[False, m[:-1]])
        for s in starts:
            e = s + int(np.argmax(~m[s:])) if (~m[s:]).any() else len(m)
            assert ids[e - 1] == eos
            assert tok.decode(ids[s:e - 1]).startswith("A")
        # the sequence is the chat template of the whole conversation (the answers are the target's)
        msgs, pos = [], 0
        for s in starts:
            e = s + int(np.argmax(~m[s:])) if (~m[s:]).any() else len(m)
            pre = tok.decode(ids[pos:s])
            user = pre.split("<|im_start|>user\n")[-1].split(EOS)[0]
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": tok.decode(ids[s:e - 1])}]
            pos = e
        full = tok.apply_chat_template(msgs, tokenize=False)
        assert text == full.rstrip("\n"), (text, full)
    assert n_share >= 1 and any(r["magpie"] for r in recs)
    # the 700-character first turn is longer than max_prompt_tokens: that conversation is dropped
    assert not any("x" * 50 in tok.decode(r["ids"].tolist()) for r in recs)
    # multi-turn ShareGPT conversations are answered turn by turn
    assert any(r["loss_mask"].sum() > 0 and len(np.flatnonzero(np.diff(r["loss_mask"].astype(int)) == 1)) >= 2
               for r in recs if not r["magpie"])
    # resume: a new scheduler starts at the first unwritten slice with fresh conversation ids
    sch2 = Scheduler(tok, [eos], CONVS, out, sched_args(tmp_path))
    assert sch2.start_slice == kinds["next_slice"]
    rq = sch2.next_request()
    assert rq[0].cid == kinds["next_slice"] * 3


def test_scheduler_partial_shards_at_stop(tmp_path, byte_tok):
    tok = byte_tok
    eos = tok.convert_tokens_to_ids(EOS)
    out = str(tmp_path / "d")
    sch = Scheduler(tok, [eos], CONVS, out, sched_args(tmp_path, slice_size=50, max_inflight_slices=1))
    drive(sch, tok, 7)
    assert not conv_shard_paths(out)
    sch.close_partial()
    paths = conv_shard_paths(out)
    assert len(paths) == 1 and paths[0].endswith("_part.npz")
    assert read_conv_shard(paths[0])


def is_early(path: str) -> bool:
    return re.search(r"_e\d+\.npz$", path) is not None


def test_scheduler_early_flush_then_full_shard(tmp_path, byte_tok):
    tok = byte_tok
    eos = tok.convert_tokens_to_ids(EOS)
    out = str(tmp_path / "e")
    sch = Scheduler(tok, [eos], CONVS, out, sched_args(tmp_path, slice_size=8, max_inflight_slices=1))
    drive(sch, tok, 6)
    sch.flush_early()
    early = conv_shard_paths(out)
    assert early and all(is_early(p) for p in early)
    first = [r["cid"] for p in early for r in read_conv_shard(p)]
    assert first
    data = StreamData(out, 2000, val_frac=0.0, val_cap=0, max_passes=2, seed=0)
    data.poll()
    drive(sch, tok, 6)
    sch.flush_early()  # only what finished since the first flush
    second = [r["cid"] for p in conv_shard_paths(out) if p not in early for r in read_conv_shard(p)]
    assert not set(first) & set(second)
    drive(sch, tok, 200)
    paths = conv_shard_paths(out)
    assert paths and not any(is_early(p) for p in paths)  # the full shard replaced the early files
    full = [r["cid"] for p in paths for r in read_conv_shard(p)]
    assert set(first) <= set(full)
    data.poll()  # a reader that saw the early file takes each conversation once
    assert data.stats["conversations"] == len(set(full))


def test_stream_data_passes_and_val_split(tmp_path, byte_tok):
    tok = byte_tok
    eos = tok.convert_tokens_to_ids(EOS)
    out = str(tmp_path / "data")
    sch = Scheduler(tok, [eos], CONVS * 10, out, sched_args(tmp_path, slice_size=8, max_inflight_slices=3))
    drive(sch, tok, 200)
    sd = StreamData(out, max_len=1000, val_frac=0.2, val_cap=100, max_passes=2, seed=0)
    sd.poll()
    n_train = len(sd.fresh)
    assert sd.val and all(is_val(r["cid"], 0.2) for r in sd.val)
    assert not any(is_val(r["cid"], 0.2) for r in sd.fresh)
    seen = []
    while True:
        t = sd.take(4)
        if t is None:
            break
        seen += [r["cid"] for r in t]
    counts = np.bincount(seen)
    assert counts.max() == 2 and (counts[counts > 0] == 2).sum() >= n_train - 3
    # fresh conversations come before second passes
    assert len(set(seen[:n_train - n_train % 4])) == n_train - n_train % 4
    # a resumed reader skips what the use counts say is spent
    sd2 = StreamData(out, max_len=1000, val_frac=0.2, val_cap=100, max_passes=2, seed=0, uses=sd.uses)
    sd2.poll()
    assert len(sd2.fresh) == 0


def test_lr_wsd():
    assert lr_wsd(0, 0.0, 100.0, 10.0, 10, 0.1) == pytest.approx(0.1)
    assert lr_wsd(50, 50.0, 100.0, 10.0, 10, 0.1) == 1.0
    assert lr_wsd(50, 105.0, 100.0, 10.0, 10, 0.1) == pytest.approx(0.55)
    assert lr_wsd(50, 200.0, 100.0, 10.0, 10, 0.1) == pytest.approx(0.1)


@pytest.mark.parametrize("dflash2,block,verify", [(False, 4, None), (True, 4, None), (False, 2, None),
                                                  (False, 4, 2)])
def test_walk_tau_equals_a_walk_over_teacher_forced_acceptance(dflash2, block, verify):
    """DFlash2: the walk's selector follows its own picks, the training's teacher-forced pick
    the true previous token; they agree on every accepted prefix, so the walks match. Block 2:
    a walk at a smaller block than the drafter's (as the engine drafts it) matches the
    teacher-forced acceptance of blocks of that size. Verify 2 of a block of 4: the acceptance
    of blocks of 4, at most one draft a round."""
    V, H = 61, 32
    cfg_t = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=5,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg_t).eval()
    target.requires_grad_(False)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, num_target_layers=5,
                        target_layer_ids=[1, 3], mask_token_id=V - 1, block_size=4, rms_norm_eps=1e-5,
                        rope_theta=10000.0,
                        **(dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=6)
                           if dflash2 else {}))
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(seed=1)
    if dflash2:  # a selector that changes picks (a fresh one is a no-op)
        sel, g = drafter.candidate_selector, torch.Generator().manual_seed(3)
        with torch.no_grad():
            sel.successor_codebook.copy_(torch.randn(V, 4, generator=g) * 0.25)
            sel.predecessor_codebook.copy_(torch.randn(V, 4, generator=g) * 0.25)
            sel.hidden_projection.weight.copy_(torch.randn(4, H, generator=g) * 0.25)
    emb = target.get_input_embeddings().weight
    head = target.get_output_embeddings().weight
    rng = np.random.default_rng(0)
    # answers made of a token the random drafter likes, mixed with noise, so that some drafts
    # are accepted and some rejected
    best = max(range(V), key=lambda c: walk_tau(drafter, target, emb, head, [
        {"ids": np.r_[rng.integers(0, V - 1, size=6), [c] * 12].astype(np.int64), "first_span": (6, 18)}])["walk_tau"])
    recs = []
    for n, p in [(40, 10), (31, 6)]:
        ids = np.r_[rng.integers(0, V - 1, size=p), [best] * (n - p)].astype(np.int64)
        ids[p + 7::9] = rng.integers(0, V - 1, size=ids[p + 7::9].size)
        recs.append({"ids": ids, "first_span": (p, n)})
    got = walk_tau(drafter, target, emb, head, recs, max_new=1000, batch=2, block=block, verify=verify)
    cap = block if verify is None else verify
    # reference: teacher-forced acceptance at every anchor (training's masks and labels), walked
    tokens = rounds = 0
    for r in recs:
        ids, (s0, end) = r["ids"], r["first_span"]
        lm = np.zeros(ids.size, dtype=bool)
        lm[s0:] = True
        nb = collate([(ids, lm)], num_anchors=ids.size, block_size=block, mask_token_id=V - 1, gamma=1e9,
                     rng=np.random.default_rng(0))
        bt = batch_to_torch(nb, "cpu")
        feats = target_features(target, bt["input_ids"], bt["attention_mask"].long(), cfg.target_layer_ids)
        with torch.no_grad():
            _, correct, w = block_loss(drafter, emb, head, feats, bt, checkpoint_ce=False)
        acc_len = acceptance_lengths(correct[0].numpy(), w[0].numpy())
        by_anchor = {int(a): int(t) for a, t, v in zip(nb["block_pos"][0, :, 0], acc_len, nb["block_valid"][0]) if v}
        a = s0
        while a < end - 1:
            commit = min(by_anchor[a], cap, end - 1 - a)
            tokens += commit
            rounds += 1
            a += commit
    assert rounds == got["walk_rounds"] and tokens == got["walk_tokens"]
    assert 1.0 < got["walk_tau"] <= cap
    assert len(got["walk_accept_by_slot"]) == min(cap - 1, 8)
    with pytest.raises(ValueError, match="walk block"):
        walk_tau(drafter, target, emb, head, recs, block=5)
    with pytest.raises(ValueError, match="walk verify"):
        walk_tau(drafter, target, emb, head, recs, block=2, verify=3)
    if dflash2:  # its convolutions are sized for its block
        with pytest.raises(ValueError, match="DFlash2"):
            walk_tau(drafter, target, emb, head, recs, block=2)
    if dflash2:  # the selector does change the walk: without it (the unary argmax) it differs
        sel, drafter.candidate_selector = drafter.candidate_selector, None
        unary = walk_tau(drafter, target, emb, head, recs, max_new=1000, batch=2)
        drafter.candidate_selector = sel
        assert (unary["walk_rounds"], unary["walk_tokens"]) != (rounds, tokens)
