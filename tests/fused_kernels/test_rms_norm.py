"""Fused RMSNorm matches F.rms_norm (+ optional bias) forward and backward."""
import pytest
import torch

from megatron.fused_kernels.rms_norm import rms_norm, rms_norm_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_gives_unit_root_mean_square():
    x = torch.randn(4, 10) * 5
    y = rms_norm_reference(x, torch.ones(10), None, 1e-8)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(y, x / x.pow(2).mean(-1, keepdim=True).add(1e-8).sqrt())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 5, 24), (6, 17), (300, 24), (2, 9000)])  # see test_layer_norm
def test_fused_matches_reference(device, dtype, with_bias, shape):
    width = shape[-1]
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    weight = randn(width, dtype=dtype, device=device, seed=2)
    bias = randn(width, dtype=dtype, device=device, seed=3) if with_bias else None
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    params = [t for t in (x, weight, bias) if t is not None]
    y = rms_norm(x, weight, bias, 1e-6)
    fused_grads = grads(y, params, dy)
    ref_params = [as_fp32_leaf(t) for t in params]
    y_ref = rms_norm_reference(ref_params[0], ref_params[1], ref_params[2] if with_bias else None, 1e-6)
    ref_grads = grads(y_ref, ref_params, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for name, got, want in zip(["dx", "dweight", "dbias"], fused_grads, ref_grads):
        assert_matches(got, want, dtype, name)
