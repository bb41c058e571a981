"""Prompt preparation and regen storage tests (numpy + pytest only)."""

import json
import os


from dflash_train.data import (approx_token_counter, build_prompt_sets, iter_json_array,
                               rejoin_conversations, split_id)
from dflash_train.store import done_prompt_indices, load_sequences, write_shard

HERE = os.path.dirname(os.path.abspath(__file__))


def test_iter_json_array_tolerates_truncation():
    text = json.dumps([{"a": 1}, {"a": 2}, {"a": 3}])
    assert [o["a"] for o in iter_json_array(text)] == [1, 2, 3]
    assert [o["a"] for o in iter_json_array(text[:-8])] == [1, 2]


def test_split_and_rejoin():
    assert split_id("abc_3") == ("abc", 3)
    assert split_id("abc") == ("abc", 0)
    recs = [
        {"id": "x_1", "conversations": [{"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
        {"id": "x_0", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "x_3", "conversations": [{"from": "human", "value": "lost"}]},
    ]
    c = rejoin_conversations(recs)
    assert [m["content"] for m in c["x"]] == ["q1", "a1", "q2", "a2"]


def _convs(n):
    convs = {}
    for i in range(n):
        convs[f"r{i}"] = [
            {"role": "user", "content": f"question number {i} " + "x" * (i % 7)},
            {"role": "assistant", "content": f"answer {i}"},
            {"role": "user", "content": f"follow up {i}"},
            {"role": "assistant", "content": "ok"},
        ]
    convs["dup"] = [{"role": "user", "content": "Question number 1 x"}]  # dup of r1 (normalised)
    convs["empty"] = [{"role": "user", "content": "   "}]
    convs["long"] = [{"role": "user", "content": "y" * 10000}]
    return convs


def test_build_prompt_sets_split_is_disjoint():
    held, train, st = build_prompt_sets(_convs(60), approx_token_counter, seed=3, n_heldout=10,
                                        max_prompt_tokens=1000, max_train=1000)
    assert len(held) == 10
    held_txt = {h["prompt"].strip().lower() for h in held}
    tr_first = [t["prompt"] for t in train if "prompt" in t]
    assert not held_txt & {t.strip().lower() for t in tr_first}
    assert all(t.strip() for t in tr_first)
    assert all(len(t) < 5000 for t in tr_first)  # overlong filtered
    assert len(set(t.strip().lower() for t in tr_first)) == len(tr_first)  # dedupe
    # context prompts end with a user turn and never come from held-out conversations
    ctx = [t["messages"] for t in train if "messages" in t]
    assert ctx and all(m[-1]["role"] == "user" and m[0]["role"] == "user" for m in ctx)
    held_nums = {h["prompt"].split()[2] for h in held}
    for m in ctx:
        assert m[-1]["content"].split()[2] not in held_nums
    # first turns come before context prompts
    kinds = ["messages" in t for t in train]
    assert kinds == sorted(kinds)
    # deterministic
    held2, train2, _ = build_prompt_sets(_convs(60), approx_token_counter, seed=3, n_heldout=10,
                                         max_prompt_tokens=1000, max_train=1000)
    assert held == held2 and train == train2


def test_repo_heldout_file():
    p = os.path.join(HERE, "..", "data", "sharegpt_heldout.jsonl")
    assert os.path.getsize(p) < 1_000_000
    rows = [json.loads(l) for l in open(p, encoding="utf-8")]
    assert len(rows) == 500
    assert all(set(r) == {"prompt"} and r["prompt"].strip() for r in rows)
    assert len({r["prompt"] for r in rows}) == 500


def test_store_roundtrip_and_resume(tmp_path):
    recs = [(0, [1, 2, 3], [4, 5, 6], False, True), (7, [1, 2], [9], True, False),
            (3, [5] * 4, [70000, 8], False, True)]
    write_shard(str(tmp_path / "regen_a_00000.npz"), recs[:2])
    write_shard(str(tmp_path / "regen_a_00001.npz"), recs[2:])
    assert done_prompt_indices([str(tmp_path)]) == {0, 7, 3}
    seqs, st = load_sequences([str(tmp_path)], min_response=2)
    assert st["sequences"] == 2  # the 1-token response is dropped
    ids, lm, smp = seqs[0]
    assert ids.tolist() == [1, 2, 3, 4, 5, 6] and lm.tolist() == [0, 0, 0, 1, 1, 1] and not smp
    assert seqs[1][0].tolist() == [5, 5, 5, 5, 70000, 8]  # int32 storage above uint16 range
    seqs, _ = load_sequences([str(tmp_path)], max_len=5)
    assert seqs[0][0].size == 5
