"""The fast generator against HF generate (tiny random Llama, fp32, CPU)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")
transformers = pytest.importorskip("transformers")

from dflash_train.fastgen import Engine, TargetWeights, generate_list  # noqa: E402

V = 151


@pytest.fixture(scope="module")
def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-5,
                                   rope_theta=10000.0, initializer_range=0.3)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    m.requires_grad_(False)
    return m


def hf_greedy(model, prompt, max_new, eos):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(n, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, V, size=int(rng.integers(1, 40))).tolist() for _ in range(n)]


def test_greedy_equals_hf_generate_with_refill(tiny_llama):
    ps = prompts(7)
    max_new = 23
    # an EOS id that some rows produce, so rows finish at different steps
    eos = [int(np.bincount(sum((hf_greedy(tiny_llama, p, max_new, [V + 1]) for p in ps), []),
                           minlength=V).argmax())]
    w = TargetWeights(tiny_llama, torch.float32, "cpu", max_positions=512)
    eng = Engine(w, batch=3, max_len=80, steps=4, bucket=16)
    got = generate_list(eng, ps, max_new, eos)
    n_eos = 0
    for p, (resp, fin) in zip(ps, got):
        ref = hf_greedy(tiny_llama, p, max_new, eos)
        assert resp == ref, (p, resp, ref)
        assert fin == (ref[-1] in eos)
        n_eos += fin
    assert 0 < n_eos < len(ps)


def test_length_limit_and_sampling_rows(tiny_llama):
    w = TargetWeights(tiny_llama, torch.float32, "cpu", max_positions=512)
    eng = Engine(w, batch=4, max_len=48, steps=4, bucket=16)
    ps = prompts(5, seed=3)
    torch.manual_seed(0)
    got = generate_list(eng, ps, 100, eos=[V + 1], sampled=[False, True, False, True, True])
    for p, (resp, fin) in zip(ps, got):
        assert not fin
        # stops when prompt + response reaches the cache's length limit
        assert len(p) + len(resp) == eng.T - eng.steps
    greedy = generate_list(eng, [ps[0]], 100, eos=[V + 1])[0][0]
    assert greedy == got[0][0]
    # T=1 samples differ from the greedy continuation somewhere
    ref = hf_greedy(tiny_llama, ps[1], len(got[1][0]), [V + 1])
    assert got[1][0] != ref
