"""RWKV: the chunked time mix equals its recurrence (outputs, last state, gradients), GPT-NeoX's widths and
initial tables, and the rules of the keys."""

import math

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.rwkv import wkv_chunked, wkv_recurrent
from megatron.mpu import SingleProcessState
from tests.model.helpers import tiny_config

FP32_TOLERANCE = dict(rtol=1e-5, atol=2e-5)


def wkv_inputs(b=2, heads=3, s=37, n=4, decay_scale=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(b, heads, s, n, generator=g) for _ in range(3))
    w = torch.randn(b, heads, s, n, generator=g) + decay_scale
    tensors = dict(r=r, k=k, v=v, log_decay=-torch.exp(w), u=torch.randn(heads, n, generator=g),
                   state=torch.randn(b, heads, n, n, generator=g))
    return {k: t.requires_grad_() for k, t in tensors.items()}


@pytest.mark.parametrize("decay_scale", [0.0, -6.0, 4.0], ids=["ordinary", "slow_decay", "fast_decay"])
def test_chunked_time_mix_equals_the_recurrence(decay_scale):
    """37 steps (chunks of 16 and a partial one), from a non-zero state; fast decay (exp(-e^4) per step ~ 1e-24)
    and slow decay (~0.998) both stay finite: the chunked form only exponentiates differences <= 0."""
    results = []
    for fn in (wkv_recurrent, wkv_chunked):
        inputs = wkv_inputs(decay_scale=decay_scale)
        y, state = fn(**inputs)
        g = torch.Generator().manual_seed(99)  # fixed cotangents: a loss linear in the outputs
        ((y * torch.randn(y.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()).backward()
        results.append((y, state, {k: t.grad for k, t in inputs.items()}))
    (ref_y, ref_state, ref_grads), (y, state, grads) = results
    torch.testing.assert_close(y, ref_y, **FP32_TOLERANCE)
    torch.testing.assert_close(state, ref_state, **FP32_TOLERANCE)
    for name, grad in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        torch.testing.assert_close(grads[name], grad, **FP32_TOLERANCE, msg=name)


def test_widths_follow_gpt_neox():
    config = tiny_config(hidden_size=64, attention_config=[[["rwkv"], 2]])
    assert (config.rwkv_dim_att, config.rwkv_head_size, config.rwkv_ffn_dim) == (64, 16, 224)  # int(3.5 * 64)
    config = tiny_config(hidden_size=64, attention_config=[[["rwkv"], 2]], dim_att=128, ffn_dim=100, head_size=32)
    assert (config.rwkv_dim_att, config.rwkv_head_size, config.rwkv_ffn_dim) == (128, 32, 100)
    assert config.problems() == []
    assert tiny_config(hidden_size=64, attention_config=[[["rwkv"], 2]], intermediate_size=200).rwkv_ffn_dim == 192
    assert any("head_size=4 must equal" in p for p in
               tiny_config(attention_config=[[["rwkv"], 2]], head_size=4).problems())


def test_initial_tables_are_gpt_neox_s():
    """Layer 1 of 2: ratio_0_to_1 = 1, ratio_1_to_almost0 = 0.5 (GPT-NeoX's formulas, written out here)."""
    model = build_model(tiny_config(attention_config=[[["rwkv"], 2]]), SingleProcessState())
    att = model.layers[1].att
    c, dim = 32, 32
    i = 5
    assert att.time_maa_k[0, 0, i].item() == pytest.approx(1 - (i / c) ** 0.5)
    assert att.time_maa_v[0, 0, i].item() == pytest.approx(1 - ((i / c) ** 0.5 + 0.3))
    assert att.time_decay[0, 0, i].item() == pytest.approx(-6 + 5 * (i / (dim - 1)) ** 2.0)
    zigzag = ((i + 1) % 3 - 1) * 0.1
    assert att.time_faaaa.flatten()[i].item() == pytest.approx(1 - i / (dim - 1) + zigzag)
    assert att.ln_x.eps == pytest.approx(64e-5) and att.ln_x.num_groups == 4
    assert math.isclose(float(model.layers[0].att.time_faaaa.detach().flatten()[0]), 0.0)  # layer 0: only the zigzag
