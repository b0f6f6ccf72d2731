"""Masked scaled softmax: the Triton kernel matches the reference forward and backward, with
broadcast masks, fully masked rows and no mask."""
import pytest
import torch

from megatron.fused_kernels.launch_config import softmax_blocks
from megatron.fused_kernels.scaled_masked_softmax import scaled_masked_softmax, scaled_masked_softmax_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def _mask(shape, device):
    generator = torch.Generator().manual_seed(3)
    mask = torch.rand(*shape, generator=generator) > 0.6
    mask[..., 1, :] = True  # one fully hidden query row: uniform output, no gradient
    return mask.to(device)


def test_reference_hides_masked_keys_and_fully_masked_rows_are_uniform():
    x = torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[False, True, False, True], [True] * 4, [False] * 4]).view(1, 1, 3, 4)
    y = scaled_masked_softmax_reference(x, mask, 2.0)
    assert torch.all(y[0, 0, 0, 1::2] == 0)
    torch.testing.assert_close(y[0, 0, 1], torch.full((4,), 0.25))
    torch.testing.assert_close(y[0, 0, 2], torch.softmax(2.0 * x[0, 0, 2], -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_shape", [(2, 1, 5, 9), (1, 1, 5, 9), (2, 3, 5, 9), None])
def test_fused_matches_reference(device, dtype, mask_shape):
    shape = (2, 3, 5, 9)
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    mask = None if mask_shape is None else _mask(mask_shape, device)
    y = scaled_masked_softmax(x, mask, 0.6)
    (dx,) = grads(y, [x], dy)
    x_ref = as_fp32_leaf(x)
    y_ref = scaled_masked_softmax_reference(x_ref, None if mask is None else mask.cpu(), 0.6)
    (dx_ref,) = grads(y_ref, [x_ref], dy.float().cpu())
    assert_matches(y, y_ref, dtype, "softmax")
    assert_matches(dx, dx_ref, dtype, "dx")
    if mask is not None:
        assert torch.all(dx.detach().cpu()[mask.expand(shape).cpu()] == 0)


@pytest.mark.parametrize("with_mask", [True, False])
def test_rows_longer_than_one_block_match_reference(device, with_mask):
    """9000 keys: the chunked kernels (online softmax over 4096-key chunks, a partial last one)."""
    shape = (1, 2, 3, 9000)
    assert softmax_blocks(shape[-1]).chunked
    x = randn(*shape, dtype=torch.bfloat16, device=device, scale=4.0)
    dy = randn(*shape, dtype=torch.bfloat16, device=device, seed=1).detach()
    mask = _mask((1, 1, 3, 9000), device) if with_mask else None
    y = scaled_masked_softmax(x, mask, 0.6)
    (dx,) = grads(y, [x], dy)
    x_ref = as_fp32_leaf(x)
    y_ref = scaled_masked_softmax_reference(x_ref, None if mask is None else mask.cpu(), 0.6)
    (dx_ref,) = grads(y_ref, [x_ref], dy.float().cpu())
    assert_matches(y, y_ref, torch.bfloat16, "softmax")
    assert_matches(dx, dx_ref, torch.bfloat16, "dx")


def test_rejects_non_bool_and_non_broadcasting_masks(device):
    x = torch.randn(1, 2, 3, 4, device=device)
    with pytest.raises(ValueError, match="bool"):
        scaled_masked_softmax(x, torch.zeros(1, 1, 3, 4, device=device), 1.0)
    with pytest.raises(ValueError, match="broadcast"):
        scaled_masked_softmax(x, torch.zeros(1, 1, 3, 5, dtype=torch.bool, device=device), 1.0)
