"""A Qwen 3.5 hybrid target (Gated DeltaNet + gated attention) in the training recipe: the
tiny transformers-checked fixture of crates/models/tests/fixtures loads as a target, its tapped
features are the decoder layers' outputs (hidden_states[l + 1]) for taps chosen by the
published rule, and the drafter config derived from it (plain or multimodal-wrapper config)
shares its width and vocabulary.  Skipped without torch/transformers with qwen3_5."""

import json
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: skipping the torch-dependent tests")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no qwen3_5 (needs >= 5.2)", allow_module_level=True)

from dflash_train.config import build_target_layer_ids, drafter_config_from_target  # noqa: E402
from dflash_train.target import decoder_layers, load_target, target_features, target_hf_config  # noqa: E402

FIX = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "models", "tests", "fixtures")


def test_qwen35_target_taps_match_hidden_states():
    model = load_target(os.path.join(FIX, "tiny_qwen35"), dtype="float32", device="cpu")
    cfg = target_hf_config(model)
    assert len(decoder_layers(model)) == cfg.num_hidden_layers == 6
    taps = build_target_layer_ids(cfg.num_hidden_layers, 3)
    ids = torch.randint(0, cfg.vocab_size - 3, (2, 19))
    att = torch.ones_like(ids)
    att[1, 15:] = 0
    f = target_features(model, ids, att, taps, early_exit=True)
    out = model(input_ids=ids, attention_mask=att, output_hidden_states=True)
    ref = torch.cat([out.hidden_states[l + 1] for l in taps], dim=-1)
    assert f.shape == (2, 19, 3 * cfg.hidden_size)
    torch.testing.assert_close(f[0], ref[0])
    torch.testing.assert_close(f[1, :15], ref[1, :15])


@pytest.mark.parametrize("fixture", ["tiny_qwen35", "tiny_qwen35_vlm"])
def test_drafter_config_from_a_qwen35_config(fixture):
    with open(os.path.join(FIX, fixture, "config.json")) as fh:
        raw = json.load(fh)
    text = raw.get("text_config", raw)
    cfg = drafter_config_from_target(text, num_draft_layers=2, num_taps=3, mask_token_id=text["vocab_size"] - 1)
    assert cfg.hidden_size == text["hidden_size"] and cfg.vocab_size == text["vocab_size"]
    assert cfg.target_layer_ids == build_target_layer_ids(text["num_hidden_layers"], 3)
    assert cfg.rope_theta == text["rope_parameters"]["rope_theta"]
