"""The model's state dict is GPT-NeoX's (megatron.model.checkpoint_layout): the extra entries GPT-NeoX saves,
how GPT-NeoX's models load where they differ from this config's, and GPT-NeoX's parameter order."""
import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.checkpoint_layout import LayoutError
from megatron.mpu import SingleProcessState
from megatron.optim.param_groups import get_param_groups
from tests.model.helpers import random_batch, tiny_config


def _model(**overrides):
    return build_model(tiny_config(**overrides), SingleProcessState())


def test_computed_buffers_are_saved_as_gpt_neox_saves_them():
    sinusoidal = _model(pos_emb="sinusoidal").state_dict()
    torch.testing.assert_close(sinusoidal["sequential.0.position_embeddings.inv_freq"],
                               1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32))
    alibi = _model(pos_emb="alibi", precision="bfloat16").state_dict()
    slopes = alibi["sequential.3.attention.alibi_embed.slopes"]
    assert slopes.dtype == torch.bfloat16 and slopes.tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    assert "sequential.2.attention.rotary_emb.inv_freq" not in _model(pos_emb="rotary").state_dict()
    saved = _model(pos_emb="rotary", rotary_pct=0.5, rotary_save_freqs_buffer=True).state_dict()
    assert saved["sequential.2.attention.rotary_emb.inv_freq"].shape == (2,)


@pytest.mark.parametrize("overrides,key,factor,message", [
    (dict(pos_emb="sinusoidal"), "sequential.0.position_embeddings.inv_freq", 2.0, "hidden_size"),
    (dict(pos_emb="alibi"), "sequential.2.attention.alibi_embed.slopes", 0.5, "num_attention_heads"),
    (dict(pos_emb="rotary", rotary_save_freqs_buffer=True), "sequential.3.attention.rotary_emb.inv_freq", 1.5,
     "rotary_emb_base"),
])
def test_computed_buffers_are_checked_when_loading(overrides, key, factor, message):
    model = _model(**overrides)
    state = model.state_dict()
    model.load_state_dict(state, strict=True)
    state[key] = state[key] * factor
    with pytest.raises(LayoutError, match=f"{key}.*{message}"):
        model.load_state_dict(state, strict=True)
    del state[key]  # absent (GPT-NeoX without rotary_save_freqs_buffer): fine
    model.load_state_dict(state, strict=True)


def test_saved_rotary_frequencies_load_into_a_model_that_does_not_save_them():
    saved = _model(pos_emb="rotary", rotary_save_freqs_buffer=True).state_dict()
    _model(pos_emb="rotary").load_state_dict(saved, strict=True)
    with pytest.raises(LayoutError, match="rotary_pct / rotary_emb_base"):
        _model(pos_emb="rotary", rotary_pct=0.5).load_state_dict(saved, strict=True)


def test_rmsnorm_names_and_gpt_neox_norms_without_offset():
    model = _model(norm="rmsnorm", use_bias_in_norms=True)
    state = model.state_dict()
    assert "sequential.2.input_layernorm.scale" in state and "sequential.5.norm.offset" in state
    with torch.no_grad():
        model.sequential[5].norm.offset.fill_(3.0)
    gpt_neox = {k: v for k, v in state.items() if not k.endswith("offset")}  # GPT-NeoX's RMSNorm has none
    model.load_state_dict(gpt_neox, strict=True)
    assert torch.count_nonzero(model.sequential[5].norm.offset) == 0


def test_layernorm_bias_of_a_gpt_neox_checkpoint_in_a_bias_free_model():
    biased = _model().state_dict()
    plain = _model(use_bias_in_norms=False)
    zero = {k: (torch.zeros_like(v) if k.endswith("norm.bias") else v) for k, v in biased.items()}
    plain.load_state_dict(zero, strict=True)
    biased["sequential.2.input_layernorm.bias"] += 1.0
    with pytest.raises(LayoutError, match="input_layernorm.bias.*use_bias_in_norms: true"):
        plain.load_state_dict(biased, strict=True)


def test_gpt_neox_qk_layernorm_is_refused():
    model = _model()
    state = model.state_dict()
    state["sequential.2.attention.qk_layernorm.weight"] = torch.ones(4, 8)
    with pytest.raises(LayoutError, match="qk_layernorm.*q_norm / k_norm"):
        model.load_state_dict(state, strict=True)


def test_gpt_j_tied_writes_the_unused_norm_as_gpt_neox_and_ignores_it():
    model = _model(gpt_j_residual=True, gpt_j_tied=True)
    state = model.state_dict()
    for kind in ("weight", "bias"):
        assert torch.equal(state[f"sequential.2.post_attention_layernorm.{kind}"],
                           state[f"sequential.2.input_layernorm.{kind}"])
    state["sequential.2.post_attention_layernorm.weight"] = torch.full((32,), 7.0)  # GPT-NeoX's: never trained
    model.load_state_dict(state, strict=True)
    # and an untied reader of this checkpoint gets the same model
    untied = _model(gpt_j_residual=True)
    untied.load_state_dict(model.state_dict(), strict=True)
    inputs, _ = random_batch()
    model.eval(), untied.eval()
    torch.testing.assert_close(untied(inputs), model(inputs))


def test_rpe_is_one_table_shared_by_all_layers():
    model = _model(pos_emb="rpe")
    tables = [n for n, _ in model.named_parameters() if "rpe" in n]
    assert tables == ["sequential.2.attention.rpe.weight"]
    state = model.state_dict()
    assert torch.equal(state["sequential.2.attention.rpe.weight"], state["sequential.3.attention.rpe.weight"])
    assert model.layers[0].attention.rpe is model.layers[1].attention.rpe


GPT_NEOX_LAYER_ORDER = ["input_layernorm.weight", "input_layernorm.bias", "attention.query_key_value.weight",
                        "attention.query_key_value.bias", "attention.dense.weight", "attention.dense.bias",
                        "post_attention_layernorm.weight", "post_attention_layernorm.bias", "mlp.linear1.weight",
                        "mlp.linear1.bias", "mlp.linear2.weight", "mlp.linear2.bias"]
"""GPT-NeoX's ParallelTransformerLayer registers input_layernorm, attention (query_key_value, ..., dense),
post_attention_layernorm, mlp (linear1, linear2): the order of its parameters, its optimizer groups and its
ZeRO partitions."""


def test_parameters_and_optimizer_groups_are_in_gpt_neox_order():
    model = _model(no_weight_tying=True)
    names = [n for n, _ in model.named_parameters()]
    layer = [n[len("sequential.2."):] for n in names if n.startswith("sequential.2.")]
    assert layer == GPT_NEOX_LAYER_ORDER
    assert names[:2] == ["sequential.0.word_embeddings.weight", "sequential.0.position_embeddings.weight"]
    assert names[-3:] == ["sequential.5.norm.weight", "sequential.5.norm.bias", "sequential.6.final_linear.weight"]
    by_id = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = ([by_id[id(p)] for p in g["params"]] for g in get_param_groups(model, 0.01))
    # GPT-NeoX's get_params_for_weight_decay_optimization: norms and biases undecayed, module order kept
    assert decay == [n for n in names if not n.endswith("bias") and "norm" not in n]
    assert no_decay == [n for n in names if n.endswith("bias") or "norm" in n]


GPT_NEOX_MAMBA_LAYER = ["norm.scale", "mixer.A_log", "mixer.D", "mixer.in_proj.weight", "mixer.conv1d.weight",
                        "mixer.conv1d.bias", "mixer.x_proj.weight", "mixer.dt_proj.weight", "mixer.dt_proj.bias",
                        "mixer.out_proj.weight"]
GPT_NEOX_RWKV_LAYER = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias"] + [
    f"att.{name}" for name in ("time_maa_x", "time_maa_w", "time_maa_k", "time_maa_v", "time_maa_r", "time_maa_g",
                               "time_maa_w1", "time_maa_w2", "time_decay", "time_decay_w1", "time_decay_w2",
                               "time_faaaa", "receptance.weight", "key.weight", "value.weight", "output.weight",
                               "gate.weight", "ln_x.weight", "ln_x.bias")] + [
    f"ffn.{name}" for name in ("time_maa_k", "time_maa_r", "key.weight", "receptance.weight", "value.weight")]
"""GPT-NeoX's ParallelMambaResidualLayer (rmsnorm, default biases) and RWKVResidualLayer state, in the order
its modules register them (a module's own parameters, A_log and D, before its submodules')."""


@pytest.mark.parametrize("kind,names", [("mamba", GPT_NEOX_MAMBA_LAYER), ("rwkv", GPT_NEOX_RWKV_LAYER)])
def test_mamba_and_rwkv_slots_hold_gpt_neox_s_names_in_its_order(kind, names):
    model = _model(attention_config=["global", kind], norm="rmsnorm", use_bias_in_norms=False)
    state = model.state_dict()
    assert [n[len("sequential.3."):] for n in state if n.startswith("sequential.3.")] == names
    assert [n for n, _ in model.named_parameters() if n.startswith("sequential.3.")] == \
        [f"sequential.3.{n}" for n in names]


GPT_NEOX_AMLP_LAYER = {f"{module}.{p}" for module in ("norm", "input_linear", "sgu.norm", "sgu.proj",
                                                     "sgu.attn.proj_qkv", "sgu.attn.proj_ffn", "output_linear")
                       for p in ("weight", "bias")}
"""GPT-NeoX's GMLPBlock state (layernorm, an amlp layer): its input / output linears' biases are saved though
its forward never adds them."""


def test_gmlp_slots_hold_gpt_neox_s_entries_and_its_unused_biases_load_as_nothing():
    from megatron.checkpoint.format import gpt_neox_gmlp_problem

    model = _model(attention_config=["global", "amlp"], gmlp_attn_dim=8)
    state = model.state_dict()
    assert {n[len("sequential.3."):] for n in state if n.startswith("sequential.3.")} == GPT_NEOX_AMLP_LAYER
    assert not state["sequential.3.input_linear.bias"].any() and state["sequential.3.input_linear.bias"].shape == \
        (state["sequential.3.input_linear.weight"].size(0),)
    inputs, _ = random_batch()
    before = model(inputs)
    state["sequential.3.input_linear.bias"] += 1.0  # whatever GPT-NeoX holds there, its function ignores it
    state["sequential.3.output_linear.bias"] += 1.0
    model.load_state_dict(state)
    torch.testing.assert_close(model(inputs), before, rtol=0, atol=0)
    assert gpt_neox_gmlp_problem(2, ("global", "gmlp")) and gpt_neox_gmlp_problem(1, ("amlp",)) is None
    assert gpt_neox_gmlp_problem(2, ("global", "mamba")) is None


def test_saved_rotary_frequencies_carry_rope_scaling_and_a_checkpoint_from_before_scaling_loads():
    """rotary_save_freqs_buffer saves the scaled frequencies; a checkpoint saved without scaling (before the context
    was extended) loads into a model with rope_scaling (the buffer is computed, never learned); one saved with
    other scaling is refused naming rope_scaling."""
    from megatron.model.positional import rotary_frequencies

    llama3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=4)
    scaled = _model(pos_emb="rotary", rotary_save_freqs_buffer=True, rope_scaling=llama3).state_dict()
    torch.testing.assert_close(scaled["sequential.2.attention.rotary_emb.inv_freq"],
                               rotary_frequencies(8, 10000.0, llama3, 16)[0], rtol=0, atol=0)
    plain = _model(pos_emb="rotary", rotary_save_freqs_buffer=True).state_dict()
    _model(pos_emb="rotary", rotary_save_freqs_buffer=True, rope_scaling=llama3).load_state_dict(plain, strict=True)
    with pytest.raises(LayoutError, match="rope_scaling"):
        _model(pos_emb="rotary", rope_scaling=dict(llama3, factor=2.0)).load_state_dict(scaled, strict=True)
