"""Bias-GeLU: tanh approximation is Megatron's formula; the Triton kernel matches the reference
forward and backward for both approximations, with and without bias."""
import math

import pytest
import torch

from megatron.fused_kernels.bias_gelu import bias_gelu, bias_gelu_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_tanh_is_megatron_formula():
    x, b = torch.randn(4, 9), torch.randn(9)
    v = x + b
    megatron = v * 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * v * (1 + 0.044715 * v * v)))
    torch.testing.assert_close(bias_gelu_reference(x, b, "tanh"), megatron)
    exact = 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))
    torch.testing.assert_close(bias_gelu_reference(x, b, "none"), exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 7, 45), (6, 1100)])
def test_fused_matches_reference(device, dtype, approximate, with_bias, shape):
    """(3, 7, 45): one partial tile, odd width; (6, 1100): two column blocks, the second partial, and
    more row tiles than backward row groups (each group sums several tiles into the bias gradient)."""
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    bias = randn(shape[-1], dtype=dtype, device=device, seed=2) if with_bias else None
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    params = [x] + ([bias] if with_bias else [])
    y = bias_gelu(x, bias, approximate)
    fused_grads = grads(y, params, dy)
    ref_params = [as_fp32_leaf(t) for t in params]
    y_ref = bias_gelu_reference(ref_params[0], ref_params[1] if with_bias else None, approximate)
    ref_grads = grads(y_ref, ref_params, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for name, got, want in zip(["dx", "dbias"], fused_grads, ref_grads):
        assert_matches(got, want, dtype, name)


def test_large_inputs_saturate_without_nan(device):
    x = torch.tensor([[-60.0, -10.0, 0.0, 10.0, 60.0]], device=device, requires_grad=True)
    y = bias_gelu(x, None, "tanh")
    (dx,) = grads(y, [x], torch.ones(1, 5))
    torch.testing.assert_close(y.detach().cpu(), torch.tensor([[0.0, 0.0, 0.0, 10.0, 60.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(dx.cpu(), torch.tensor([[0.0, 0.0, 0.5, 1.0, 1.0]]), atol=1e-6, rtol=0)


def test_rejects_unknown_approximation(device):
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(torch.randn(2, 3, device=device), None, "erf")
