"""ModelConfig: the values the layers read, derived once; the adapter from NeoXArgs; the model's rules."""

import dataclasses
import subprocess
import sys

import pytest

from megatron.model.config import (
    ModelConfig,
    expand_attention_config,
    padded_vocab_size,
    softmax_fusion_warning,
)
from megatron.neox_arguments import NeoXArgs
from tests.neox_arguments.helpers import tiny

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
FLATTENED = {"soft_prompt_tokens", "soft_prompt_init_range", "soft_prompt_init_tokens", "local_attention_block", "local_attention_window_blocks",
             "number_checkpoints", "mup_width_mult"}


def test_defaults_are_the_schemas():
    schema = {f.name: f.default for f in dataclasses.fields(NeoXArgs)}
    for f in dataclasses.fields(ModelConfig):
        if not f.init or f.name in FLATTENED or f.default is dataclasses.MISSING:
            continue
        if f.name == "precision":  # the schema's None means "derive it"; derivation gives fp32
            assert f.default == "fp32" and tiny().precision == "fp32"
            continue
        assert f.default == schema[f.name], f.name


def test_frozen_and_free_of_torch():
    config = ModelConfig(**SHAPE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 8
    code = "import sys, megatron.model.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_derived_values():
    config = ModelConfig(**SHAPE, num_kv_heads=2, pos_emb="rotary", rotary_pct=0.25, norm="rmsnorm",
                         rms_norm_epsilon=1e-6, activation="swiglu", mlp_multiple_of=16)
    assert (config.head_dim, config.kv_heads, config.rotary_dim) == (16, 2, 4)
    assert config.norm_epsilon == 1e-6 and config.gated_mlp
    assert config.ffn_width == 96  # int(256 * 2 / 3) // 2 = 85, rounded up to 16
    assert config.positions == 32 and config.attention_types == ("global", "global")
    plain = ModelConfig(**SHAPE)
    assert (plain.kv_heads, plain.rotary_dim, plain.norm_epsilon, plain.ffn_width) == (4, 0, 1e-5, 256)
    assert config.replace(num_kv_heads=None).kv_heads == 4  # derived values are recomputed


def test_mlp_width_rules():
    def width(**kw):
        return ModelConfig(**{**SHAPE, "hidden_size": 32, **kw}).ffn_width

    assert width() == 128
    assert width(expansion_factor=2.0) == 64
    assert width(intermediate_size=100, mlp_multiple_of=16) == 112
    assert width(intermediate_size=100, expansion_factor=2.0, mlp_multiple_of=32) == 128  # intermediate wins
    assert width(hidden_size=48, activation="geglu") == 64  # int(192 * 2 / 3) // 2


def test_attention_config_expansion():
    assert expand_attention_config(None, 3) == ("global",) * 3
    assert expand_attention_config([[["global", "local"], 2]], 4) == ("global", "local", "global", "local")
    assert expand_attention_config([[["global"], 1], [["flash"], 2]], 3) == ("global", "flash", "flash")
    assert expand_attention_config([[["local", "global"], "all"]], 3) == ("local", "global", "local")
    config = ModelConfig(**SHAPE, attention_config=[[["flash"], "all"]])
    assert config.attention_types == ("flash", "flash")
    with pytest.raises(ValueError, match="count"):
        expand_attention_config([[["global"], 0]], 2)


@pytest.mark.parametrize(
    ("vocab", "div", "mp", "expected"),
    [(50257, 128, 1, 50304), (50257, 128, 2, 50432), (512, 128, 1, 512), (1, 8, 1, 8), (8193, 64, 4, 8448)],
)
def test_padded_vocab_size_is_the_smallest_multiple(vocab, div, mp, expected):
    padded = padded_vocab_size(vocab, div, mp)
    assert padded == expected
    assert padded % (div * mp) == 0 and padded >= vocab and padded - vocab < div * mp


def test_padded_vocab_size_is_a_multiple_of_divisor_times_model_parallel():
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(128, 128, 1) == 128
    assert padded_vocab_size(900, 128, 1, explicit=1000) == 1000
    with pytest.raises(ValueError, match="padded_vocab_size=1000"):
        padded_vocab_size(1001, 128, 1, explicit=1000)


def test_from_neox_args_reads_every_model_value_and_never_changes_the_args():
    args = tiny(num_kv_heads=2, pos_emb="rotary", soft_prompt_tuning={"enabled": True, "n_tokens": 3},
                attention_config=[[["local"], 2]], bf16={"enabled": True}, no_weight_tying=True, seed=7)
    before = args.to_dict()
    config = ModelConfig.from_neox_args(args, padded_vocab_size=256)
    assert args.to_dict() == before
    assert (config.padded_vocab_size, config.kv_heads, config.pos_emb, config.precision) == (256, 2, "rotary",
                                                                                             "bfloat16")
    assert (config.soft_prompt_tokens, config.local_attention_block, config.local_attention_window_blocks) == (3, 16, 3)
    assert config.attention_types == ("local", "local") and not config.tied_embeddings and config.seed == 7
    assert ModelConfig.from_neox_args(tiny(soft_prompt_tuning={"enabled": False})).soft_prompt_tokens is None
    assert ModelConfig.from_neox_args(args.to_dict(), padded_vocab_size=256) == config  # a checkpoint's dict
    # sparsity_config's local window, read as GPT-NeoX does: num_local_blocks, num_sliding_window_blocks, then 4
    for sparsity, window in (({"block": 8, "num_sliding_window_blocks": 5}, (8, 5)), ({"block": 8}, (8, 4)),
                             ({"num_local_blocks": 6, "num_sliding_window_blocks": 5}, (16, 6))):
        windowed = ModelConfig.from_neox_args({**args.to_dict(), "sparsity_config": sparsity})
        assert (windowed.local_attention_block, windowed.local_attention_window_blocks) == window
        assert dict(windowed.sparsity_config) == sparsity and windowed.problems() == []


@pytest.mark.parametrize("overrides,needle", [
    (dict(hidden_size=63), "hidden_size=63 must be divisible by num_attention_heads=4"),
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide"),
    (dict(attention_config=["global", "amlp"], activation="swiglu"), "a GLU activation does not apply"),
    (dict(attention_config=["global", "gmlp"], gmlp_attn_dim=32), "gmlp_attn_dim=32 is the width of aMLP layers'"),
    (dict(attention_config=["gmlp", "amlp"], model_parallel_size=2, sequence_parallel=True),
     "sequence_parallel with amlp / gmlp layers is not supported"),
    (dict(attention_config=["global", "bigbird"], sparsity_config=(("num_random_block", 1),)),
     "unknown key 'num_random_block'; did you mean 'num_random_blocks'"),
    (dict(attention_config=["local", "global"], sparsity_config=(("mode", "fixed"),)), "'mode' is not read"),
    (dict(attention_config=["local", "global"], sparsity_config=(("attention", "bidirectional"),)),
     "attention='bidirectional' is not supported: the model is causal"),
    (dict(attention_config=["sparse_fixed", "global"], sparsity_config=(("block", 5),)),
     "seq_length=32 must be divisible by block=5"),
    (dict(attention_config=["sparse_fixed", "global"], sparsity_config=(("num_global_blocks", 3),)),
     "num_local_blocks=4 must be divisible by num_global_blocks=3"),
    (dict(attention_config=["bslongformer", "global"], sparsity_config=(("global_block_end_indices", (0,)),)),
     "global block start 0 must be smaller than its end 0"),
    (dict(sparsity_config=(("block", 8),)), "sparsity_config is set but no layer reads it"),
    (dict(attention_config=["global", "nope"]), "unknown attention type 'nope'"),
    (dict(attention_config=["global"]), "expands to 1 layers"),
    (dict(pos_emb="rotary", rotary_pct=0.01), "rotated channels"),
    (dict(rope_fusion=True), "rope_fusion=true fuses rotary embeddings"),
    (dict(norm="te_layernorm"), "norm='te_layernorm' is not supported"),
    (dict(sequence_parallel=True), "sequence_parallel=true needs model_parallel_size > 1"),
    (dict(max_position_embeddings=16), "max_position_embeddings=16 must be >= seq_length=32"),
])
def test_rules(overrides, needle):
    assert needle in " ".join(ModelConfig(**{**SHAPE, **overrides}).problems())


def test_valid_config_has_no_problems_and_the_rules_reach_validation():
    assert ModelConfig(**SHAPE).problems() == []
    from tests.neox_arguments.helpers import problems_of

    assert "a GLU activation does not apply" in problems_of(attention_config=[[["amlp"], 2]], activation="geglu")


def test_softmax_fusion_on_flash_layers_does_nothing_and_says_so():
    flash = ModelConfig(**SHAPE, attention_config=[[["flash"], 2]], scaled_upper_triang_masked_softmax_fusion=True)
    assert flash.problems() == [] and not flash.softmax_fusion
    assert "has no effect" in softmax_fusion_warning(flash)
    mixed = flash.replace(attention_config=["flash", "global"])
    assert mixed.softmax_fusion and softmax_fusion_warning(mixed) is None


def test_device_problems():
    fp16 = ModelConfig(**SHAPE, precision="fp16")
    assert fp16.device_problems(cuda_available=True) == []
    assert "fp16 needs a CUDA GPU" in fp16.device_problems(cuda_available=False)[0]
    assert ModelConfig(**SHAPE, precision="bfloat16").device_problems(cuda_available=False) == []


def test_a_mixture_of_experts_with_recurrent_layers_is_refused():
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                         attention_config=["mamba", "global"], moe_num_experts=4)
    assert any("a mixture of experts (moe_num_experts=4) with mamba layers is not supported yet" in p
               for p in config.problems())
    assert not any("mixture of experts" in p for p in config.replace(moe_num_experts=1).problems())
