"""RoPE scaling (megatron.model.rope_scaling, positional.rotary_frequencies) against transformers'
modeling_rope_utils.ROPE_INIT_FUNCTIONS, the oracle: the same inverse frequencies and attention factor for each
rope_type, partial rotation included; the tables a layer uses carry them; bad settings are refused by key."""

import pytest
import torch

from megatron.model.config import ModelConfig
from megatron.model.positional import RotaryEmbedding, rotary_frequencies
from tests.model.helpers import tiny_config

POSITIONS = 256
SCALINGS = {
    "linear": dict(rope_type="linear", factor=2.5),
    "dynamic": dict(rope_type="dynamic", factor=3.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn-all-options": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16.0,
                             beta_slow=2.0, mscale=0.7, mscale_all_dim=1.0, truncate=False),
    "yarn-attention-factor": dict(rope_type="yarn", factor=8.0, attention_factor=1.3),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
}


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("rotary_pct", [1.0, 0.5])
@pytest.mark.parametrize("seq_len", [None, 3 * POSITIONS])
def test_frequencies_and_attention_factor_are_transformers(name, rotary_pct, seq_len):
    from transformers import GPTNeoXConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = SCALINGS[name]
    hf_config = GPTNeoXConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=POSITIONS,
                              rope_parameters={**scaling, "rope_theta": 5000.0, "partial_rotary_factor": rotary_pct})
    want, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu", seq_len=seq_len)
    got, factor = rotary_frequencies(int(128 * rotary_pct), 5000.0, scaling, POSITIONS, seq_len)
    default, _ = rotary_frequencies(int(128 * rotary_pct), 5000.0, None, POSITIONS)
    if not (name == "dynamic" and seq_len is None):  # dynamic within max_position_embeddings is plain rotary
        assert not torch.allclose(want, default)  # the scaling changes the frequencies: the comparison can fail
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item(), (got - want).abs().max().item()
    assert abs(factor - want_factor) <= 1e-6, (factor, want_factor)


def test_the_layer_tables_carry_the_scaling_and_dynamic_follows_the_sequence_length():
    yarn = RotaryEmbedding(16, 10000.0, 32, dict(SCALINGS["yarn"], original_max_position_embeddings=8))
    inv_freq, factor = rotary_frequencies(16, 10000.0, dict(SCALINGS["yarn"], original_max_position_embeddings=8), 32)
    cos, sin = yarn.tables(3, 4, torch.device("cpu"))
    angles = torch.arange(3, 7, dtype=torch.float32)[:, None] * inv_freq
    torch.testing.assert_close(cos, torch.cat((angles, angles), -1).cos() * factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat((angles, angles), -1).sin() * factor, rtol=0, atol=1e-6)
    dynamic = RotaryEmbedding(16, 10000.0, 32, SCALINGS["dynamic"])
    plain = RotaryEmbedding(16, 10000.0, 32)
    assert torch.equal(dynamic.tables(0, 32, torch.device("cpu"))[0], plain.tables(0, 32, torch.device("cpu"))[0])
    longer, _ = dynamic.tables(40, 8, torch.device("cpu"))  # a decoding step at position 47: computed for 48
    inv_freq, _ = rotary_frequencies(16, 10000.0, SCALINGS["dynamic"], 32, 48)
    angles = torch.arange(40, 48, dtype=torch.float32)[:, None] * inv_freq
    torch.testing.assert_close(longer, torch.cat((angles, angles), -1).cos(), rtol=0, atol=1e-6)
    positions = torch.tensor([40, 41, 46, 47])
    torch.testing.assert_close(dynamic.tables_at(positions, 48)[0], longer[[0, 1, 6, 7]], rtol=0, atol=0)


def test_type_is_read_as_rope_type_and_default_is_no_scaling():
    config = tiny_config(pos_emb="rotary", rope_scaling={"type": "linear", "factor": 2})
    assert config.rope_scaling_dict == {"rope_type": "linear", "factor": 2} and config.problems() == []
    assert tiny_config(pos_emb="rotary", rope_scaling={"rope_type": "default"}).rope_scaling is None
    assert ModelConfig.replace(config).rope_scaling == config.rope_scaling


@pytest.mark.parametrize("scaling,message", [
    (dict(rope_type="longrope", factor=2.0), "rope_scaling.rope_type='longrope' (per-frequency"),
    (dict(factor=2.0), "rope_scaling.rope_type=None"),
    (dict(rope_type="llama3", factor=8.0), "rope_scaling.low_freq_factor is required with rope_type 'llama3'"),
    (dict(rope_type="linear", factor=2.0, rope_theta=5e5), "rope_scaling.rope_theta: set rotary_emb_base"),
    (dict(rope_type="linear", factr=2.0), "rope_scaling.factr is not a parameter of rope_type 'linear'; did you "
                                          "mean factor?"),
    (dict(rope_type="linear", factor=0), "rope_scaling.factor=0 must be a number > 0"),
    (dict(rope_type="dynamic", factor=2.0, rotary_pct=0.25), "needs more than 2 rotated channels per head"),
    (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=8.5), "must be an integer > 0"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
          original_max_position_embeddings=8), "high_freq_factor=1.0 must be greater than low_freq_factor=4.0"),
])
def test_bad_settings_are_refused_naming_the_key(scaling, message):
    scaling = dict(scaling)
    pct = scaling.pop("rotary_pct", 1.0)  # head size 8: 0.25 rotates 2 channels
    problems = tiny_config(pos_emb="rotary", rotary_pct=pct, rope_scaling=scaling).problems()
    assert any(message in p for p in problems), problems


def test_yaml_key_reaches_the_model_and_needs_rotary():
    from megatron.errors import ConfigError
    from tests.neox_arguments.helpers import tiny

    args = tiny(pos_emb="rotary", rope_scaling=SCALINGS["llama3"])
    assert ModelConfig.from_neox_args(args).rope_scaling_dict == SCALINGS["llama3"]
    with pytest.raises(ConfigError, match="rope_scaling scales rotary embeddings, but pos_emb='learned'"):
        tiny(pos_emb="learned", rope_scaling=SCALINGS["linear"])
