"""Fused LayerNorm matches F.layer_norm forward and backward (x, weight, bias), also for rows that several
backward programs share and for rows wider than one block (the chunked kernels)."""
import pytest
import torch

from megatron.fused_kernels.layer_norm import layer_norm, layer_norm_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_normalises_rows():
    x = torch.randn(4, 10) * 3 + 2
    y = layer_norm_reference(x, None, None, 1e-5)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(y.var(-1, unbiased=False), torch.ones(4), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight_and_bias", "weight_only", "none"])
# (300, 24): several rows per tile, more tiles than backward programs; 5000 columns: chunked backward
# (its column-sum kernel looping over 3 row tiles);
# 9000: chunked forward and backward, with a partial last chunk.
@pytest.mark.parametrize("shape", [(3, 5, 24), (7, 33), (300, 24), (9, 5000), (2, 9000)])
def test_fused_matches_reference(device, dtype, affine, shape):
    width = shape[-1]
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    weight = randn(width, dtype=dtype, device=device, seed=2) if affine != "none" else None
    bias = randn(width, dtype=dtype, device=device, seed=3) if affine == "weight_and_bias" else None
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    params = [t for t in (x, weight, bias) if t is not None]
    y = layer_norm(x, weight, bias, 1e-5)
    fused_grads = grads(y, params, dy)
    ref_params = [as_fp32_leaf(t) for t in params]
    x_ref = ref_params[0]
    w_ref = ref_params[1] if weight is not None else None
    b_ref = ref_params[2] if bias is not None else None
    y_ref = layer_norm_reference(x_ref, w_ref, b_ref, 1e-5)
    ref_grads = grads(y_ref, ref_params, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for name, got, want in zip(["dx", "dweight", "dbias"], fused_grads, ref_grads):
        assert_matches(got, want, dtype, name)


def test_rejects_wrong_weight_shape(device):
    with pytest.raises(ValueError, match="weight"):
        layer_norm(torch.randn(2, 8, device=device), torch.ones(7, device=device), None, 1e-5)
