"""muP's model side (attention 1/d with mup_attn_temp, embedding and position multipliers, the readout's
1/(width multiplier x output temperature)), its initialisation and its optimizer groups (MuAdam / MuSGD rules)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron.optim.learning_rates import AnnealingLR
from megatron.model.gpt2_model import build_model
from megatron.mpu import SingleProcessState
from megatron.mup.parametrization import base_shapes_of, mup_initialize, named_parameters, set_base_shapes
from megatron.optim.optimizers import build_optimizer
from tests.model.helpers import random_batch, tiny_config

PS = SingleProcessState()
HEAD_DIM = 32 // 4


def logits(config, batch=None, explicit=False):
    model = build_model(config, PS).eval()
    for module in model.modules():
        if hasattr(module, "force_explicit"):
            module.force_explicit = explicit
    with torch.no_grad():
        return model((batch or random_batch())[0])


@pytest.mark.parametrize("tied", [True, False])
def test_model_side_multipliers(tied):
    sp = tiny_config(no_weight_tying=not tied)
    reference = logits(sp)
    # mup_attn_temp 1/sqrt(d) turns muP's 1/(d temp) back into 1/sqrt(d); with unit multipliers the model is SP's
    same = sp.replace(use_mup=True, mup_attn_temp=1 / math.sqrt(HEAD_DIM))
    for explicit in (False, True):  # SDPA and the explicit-scores path
        torch.testing.assert_close(logits(same, explicit=explicit), reference)
    # muP's own attention scale, 1/d, changes the scores
    assert not torch.allclose(logits(sp.replace(use_mup=True)), reference, atol=1e-4)
    # the readout divides its input by width multiplier x output temperature
    readout = same.replace(mup_width_mult=4.0, mup_output_temp=2.0)
    torch.testing.assert_close(logits(readout) * 8.0, reference)

    # the embedding's output and the (learned) position embeddings are multiplied
    embedding = build_model(same.replace(mup_embedding_mult=3.0, mup_rp_embedding_mult=0.0), PS).embedding
    plain = build_model(same, PS).embedding
    inputs = random_batch()[0]
    words = plain.word_embeddings(inputs[0])
    torch.testing.assert_close(embedding(inputs)[0], 3.0 * words)


def test_mup_initialisation_and_optimizer_groups():
    config = tiny_config(no_weight_tying=True)
    base = base_shapes_of(build_model(config, PS), build_model(config.replace(hidden_size=64), PS))
    wide = config.replace(hidden_size=128)  # width multiplier 4
    sp, mup = build_model(wide, PS), build_model(wide, PS)
    set_base_shapes(mup, base, "base")
    mup_initialize(mup, init_scale=0.5)
    sp_params = {name: p.detach() for name, p in named_parameters(sp)}
    factors = {name: float((p.detach() / sp_params[name]).flatten()[0]) if p.dim() > 1
               else float(torch.equal(p.detach(), sp_params[name])) for name, p in named_parameters(mup)}
    assert factors["sequential.2.attention.query_key_value.weight"] == pytest.approx(0.5 / 2)  # 0.5 x 4^-1/2
    assert factors["sequential.2.mlp.linear2.weight"] == pytest.approx(0.5 / 2)
    assert factors["sequential.0.word_embeddings.weight"] == pytest.approx(0.5)  # vector-like: init scale only
    assert factors["sequential.6.final_linear.weight"] == pytest.approx(0.5 * 2)  # readout x 4^1/2
    assert factors["sequential.2.input_layernorm.weight"] == 1.0  # norms are untouched

    def optimizer(kind, model):
        args = SimpleNamespace(optimizer_type=kind, optimizer={"type": kind, "params": {}}, lr=0.01, weight_decay=0.1,
                               start_weight_decay=None, end_weight_decay=None, weight_decay_incr_style="constant",
                               decoupled_lr=None)
        return build_optimizer(args, model)

    names = {id(p): name for name, p in named_parameters(mup)}
    adam = optimizer("adam", mup)
    by_name = {names[id(p)]: g for g in adam.param_groups for p in g["params"]}
    qkv, emb = by_name["sequential.2.attention.query_key_value.weight"], by_name["sequential.0.word_embeddings.weight"]
    assert (qkv["lr"], qkv["lr_mult"], qkv["weight_decay"]) == pytest.approx((0.01 / 4, 0.25, 0.1 * 4))
    assert (emb["lr"], emb["weight_decay"], "lr_mult" in emb) == (0.01, 0.1, False)
    assert by_name["sequential.2.input_layernorm.weight"]["weight_decay"] == 0.0
    # the schedule keeps the factor every step (megatron.optim.learning_rates: lr x lr_mult)
    AnnealingLR(adam, start_lr=0.02, warmup_iter=0, total_iters=10, decay_style="constant", last_iter=0)
    assert qkv["lr"] == pytest.approx(0.02 / 4) and emb["lr"] == pytest.approx(0.02)
    # SGD (MuSGD): vector-like x width multiplier, matrix-like / (fan-in / fan-out multiplier), here 4 / 4
    sgd = optimizer("sgd", mup)
    by_name = {names[id(p)]: g for g in sgd.param_groups for p in g["params"]}
    assert by_name["sequential.0.word_embeddings.weight"]["lr"] == pytest.approx(0.04)
    assert by_name["sequential.2.attention.query_key_value.weight"]["lr"] == pytest.approx(0.01)
    # without base shapes (standard parametrization) the groups are the plain ones
    assert all("lr_mult" not in g for g in optimizer("adam", sp).param_groups)


def test_conversion_to_hugging_face_refuses_mup_models():
    from megatron.checkpoint_conversion.common import common_problems

    assert any("use_mup=true" in p and "not converted to Hugging Face yet" in p
               for p in common_problems(tiny_config(use_mup=True, pos_emb="rotary")))
    assert common_problems(tiny_config(pos_emb="rotary")) == []
