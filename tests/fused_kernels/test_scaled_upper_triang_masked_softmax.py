"""Causal scaled softmax: the Triton kernel matches the reference forward and backward."""
import pytest
import torch

from megatron.fused_kernels.scaled_upper_triang_masked_softmax import (
    scaled_upper_triang_masked_softmax,
    scaled_upper_triang_masked_softmax_reference,
)
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_is_causal_and_normalised():
    x = torch.randn(2, 5, 5)
    y = scaled_upper_triang_masked_softmax_reference(x, 0.5)
    assert torch.all(y.triu(diagonal=1) == 0)
    torch.testing.assert_close(y.sum(-1), torch.ones(2, 5))
    torch.testing.assert_close(y[:, 2, :3], torch.softmax(0.5 * x[:, 2, :3], -1))


def test_reference_aligns_mask_to_last_key_when_decoding():
    x = torch.randn(1, 2, 6)
    y = scaled_upper_triang_masked_softmax_reference(x, 1.0)
    assert torch.all(y[0, 0, 5] == 0) and torch.all(y[0, 0, :5] > 0) and torch.all(y[0, 1] > 0)


@pytest.mark.parametrize("dtype", DTYPES)
# (2, 3, 9000): rows longer than one block (the chunked kernels), queries aligned to the last key so
# that the first query sees 8998 keys (its last chunk partly visible) and the last all 9000.
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (3, 5, 5), (1, 2, 3, 11), (2, 3, 9000)])
def test_fused_matches_reference(device, dtype, shape):
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    y = scaled_upper_triang_masked_softmax(x, 0.37)
    (dx,) = grads(y, [x], dy)
    x_ref = as_fp32_leaf(x)
    y_ref = scaled_upper_triang_masked_softmax_reference(x_ref, 0.37)
    (dx_ref,) = grads(y_ref, [x_ref], dy.float().cpu())
    assert_matches(y, y_ref, dtype, "softmax")
    assert_matches(dx, dx_ref, dtype, "dx")
    visible = torch.ones(shape[-2], shape[-1], dtype=torch.bool).tril(diagonal=shape[-1] - shape[-2])
    assert torch.all(y.detach().cpu()[..., visible] > 0) and torch.all(y.detach().cpu()[..., ~visible] == 0)


def test_rejects_more_queries_than_keys(device):
    with pytest.raises(ValueError, match="seq_q"):
        scaled_upper_triang_masked_softmax(torch.randn(1, 4, 3, device=device), 1.0)
