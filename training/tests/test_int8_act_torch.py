"""The CPU engine's int8 activations simulated for training data (int8_act.py, fastgen --int8-act)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from dflash_train import int8_act  # noqa: E402
from dflash_train.fastgen import Engine, TargetWeights, generate_list  # noqa: E402


def quantize_like_the_engine(x: np.ndarray) -> np.ndarray:
    """The rule of crates/runtime/src/cpu/int8/quantize.rs, block by block, in float32 scalars."""
    out = np.zeros_like(x, dtype=np.float32)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            blk = x[r, b:b + 32].astype(np.float32)
            amax = np.float32(np.abs(blk).max())
            d = np.float32(amax / np.float32(127.0))
            inv = np.float32(np.float32(127.0) / amax) if amax > 0 else np.float32(0.0)
            q = np.clip(np.round(blk * inv), -127, 127).astype(np.float32)  # np.round: half to even
            out[r, b:b + 32] = q * d
    return out


def test_codes_follow_the_engine_rule():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 96)).astype(np.float32) * np.float32(3.0)
    x[1, 32:64] = 0.0                                # an all-zero block stays zero
    x[2, :32] = np.arange(32, dtype=np.float32) - 4.5  # halves: ties go to the even code
    x[2, 0] = 127.0                                  # amax 127: inv 1, so the codes are the values
    x[3, :32] = np.array([(i - 20) * 0.37 for i in range(32)], dtype=np.float32)  # the Rust test's row
    got = int8_act.fake_quant_blocks(torch.from_numpy(x)).numpy()
    want = quantize_like_the_engine(x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(got[1, 32:64] == 0)
    assert got[2, 1] == -4.0 and got[2, 2] == -2.0 and got[2, 3] == -2.0  # -3.5 -> -4, -2.5 -> -2
    amax = np.float32(abs((0 - 20) * 0.37))
    assert got[3, 0] == np.float32(-127.0) * np.float32(amax / np.float32(127.0))
    assert got[3, 20] == 0.0
    # at most half a step from the input, as the numeric contract assumes
    steps = np.repeat(np.abs(x).reshape(5, 3, 32).max(-1) / 127.0, 32, axis=-1)
    assert np.all(np.abs(got - x) <= steps * 0.5 * (1 + 2.0 ** -20) + 1e-30)


def test_rounding_in_row_chunks_equals_one_pass(monkeypatch):
    """Large tensors are rounded a slice of rows at a time (bounded float32 temporaries): the
    values are those of one pass, for 3-D inputs and a chunk that does not divide the rows."""
    torch.manual_seed(5)
    x = (torch.randn(7, 13, 96) * 4).to(torch.bfloat16)
    whole = int8_act.fake_quant_blocks(x)
    monkeypatch.setattr(int8_act, "CHUNK_VALUES", 96 * 5)
    sliced = int8_act.fake_quant_blocks(x)
    assert sliced.shape == x.shape and sliced.dtype == x.dtype
    assert torch.equal(sliced, whole)


def test_a_partial_block_is_refused():
    with pytest.raises(ValueError, match="32-value blocks"):
        int8_act.fake_quant_blocks(torch.zeros(2, 40))


def tiny_llama(hidden=64, heads=4, head_dim=16, inter=128):
    cfg = transformers.LlamaConfig(vocab_size=151, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=3,
                                   num_attention_heads=heads, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   initializer_range=0.3)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.requires_grad_(False)
    return m


def hf_greedy(model, prompt, max_new):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=[999], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_generator_writes_what_the_int8_target_writes():
    model = tiny_llama()
    rng = np.random.default_rng(5)
    ps = [rng.integers(1, 151, size=int(rng.integers(2, 30))).tolist() for _ in range(6)]
    max_new = 24
    plain = generate_list(Engine(TargetWeights(model, torch.float32, "cpu", 256), batch=3, max_len=64, steps=4,
                                 bucket=16), ps, max_new, [999])
    w = TargetWeights(model, torch.float32, "cpu", 256, int8_act=True)
    got = generate_list(Engine(w, batch=3, max_len=64, steps=4, bucket=16), ps, max_new, [999])
    handles = int8_act.round_projection_inputs(model)
    assert len(handles) == 7 * 3
    try:
        want = [hf_greedy(model, p, max_new) for p in ps]
    finally:
        for h in handles:
            h.remove()
    assert [r for r, _ in got] == want
    # the int8 grid changes the text: that is why the generator simulates it
    assert any(a != b for (a, _), (b, _) in zip(got, plain))


def test_int8_generator_needs_whole_blocks():
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        TargetWeights(tiny_llama(hidden=48, heads=6, head_dim=8, inter=96), torch.float32, "cpu", 64, int8_act=True)
