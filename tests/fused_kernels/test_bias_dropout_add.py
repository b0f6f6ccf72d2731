"""Bias-dropout-add: without dropout the Triton kernel equals the reference; with dropout its
mask is reproducible from torch's seed, drops about p of the elements, and forward and
backward equal the reference evaluated with that same mask."""
import pytest
import torch

from megatron.fused_kernels import launch_config
from megatron.fused_kernels.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn

SHAPE = (4, 6, 33)
# (6, 1100): two column blocks, the second partial, and more row tiles than backward row groups.
SHAPES = [SHAPE, (6, 1100)]


def _inputs(dtype, device, shape=SHAPE):
    x = randn(*shape, dtype=dtype, device=device)
    bias = randn(shape[-1], dtype=dtype, device=device, seed=2)
    residual = randn(*shape, dtype=dtype, device=device, seed=3)
    dy = randn(*shape, dtype=dtype, device=device, seed=4).detach()
    return x, bias, residual, dy


def _keep_mask(seed: int, p: float, device: str, shape=SHAPE) -> torch.Tensor:
    """The fused kernel's keep mask for this torch seed (it depends on the seed and index only)."""
    torch.manual_seed(seed)
    probe = bias_dropout_add(torch.ones(shape, device=device), None, torch.zeros(shape, device=device), p)
    return probe != 0


def test_reference_with_keep_mask_scales_kept_values():
    x, residual = torch.randn(3, 4), torch.randn(3, 4)
    keep = torch.rand(3, 4) > 0.5
    y = bias_dropout_add_reference(x, None, residual, 0.5, keep_mask=keep)
    torch.testing.assert_close(y, residual + torch.where(keep, 2 * x, torch.zeros_like(x)))
    torch.testing.assert_close(bias_dropout_add_reference(x, None, residual, 0.5, training=False), residual + x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, training", [(0.0, True), (0.3, False)])
@pytest.mark.parametrize("shape", SHAPES)
def test_without_dropout_matches_reference(device, dtype, p, training, shape):
    x, bias, residual, dy = _inputs(dtype, device, shape)
    y = bias_dropout_add(x, bias, residual, p, training)
    fused_grads = grads(y, [x, bias, residual], dy)
    ref = [as_fp32_leaf(t) for t in (x, bias, residual)]
    y_ref = bias_dropout_add_reference(*ref, p, training)
    ref_grads = grads(y_ref, ref, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for name, got, want in zip(["dx", "dbias", "dresidual"], fused_grads, ref_grads):
        assert_matches(got, want, dtype, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dropout_matches_reference_with_the_same_mask(device, dtype, shape):
    p = 0.25
    keep = _keep_mask(1234, p, device, shape)
    dropped = 1.0 - keep.float().mean().item()
    assert abs(dropped - p) < 0.08, f"dropped fraction {dropped} for p={p}"
    x, bias, residual, dy = _inputs(dtype, device, shape)
    torch.manual_seed(1234)
    y = bias_dropout_add(x, bias, residual, p)
    fused_grads = grads(y, [x, bias, residual], dy)
    ref = [as_fp32_leaf(t) for t in (x, bias, residual)]
    y_ref = bias_dropout_add_reference(*ref, p, keep_mask=keep.cpu())
    ref_grads = grads(y_ref, ref, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for name, got, want in zip(["dx", "dbias", "dresidual"], fused_grads, ref_grads):
        assert_matches(got, want, dtype, name)


def test_mask_follows_torch_seed(device):
    same = _keep_mask(7, 0.5, device), _keep_mask(7, 0.5, device)
    assert torch.equal(*same)
    assert not torch.equal(same[0], _keep_mask(8, 0.5, device))


def test_each_element_has_its_own_draw(device):
    """One Philox call serves four column quarters of a tile: the quarters, and the rows, must not repeat
    each other's mask (a repeat agrees on ~100% of places, independent draws on ~50% at p = 0.5)."""
    shape = (16, 1024)
    quarter = launch_config.elementwise_blocks(shape[-1]).block_n // 4
    keep = _keep_mask(3, 0.5, device, shape).cpu()
    for other in (keep[:, quarter:2 * quarter], keep[:, 3 * quarter:4 * quarter], keep[1:, :quarter]):
        agreement = (keep[:other.shape[0], :quarter] == other).float().mean().item()
        assert 0.4 < agreement < 0.6, f"masks agree on {agreement:.2f} of places"


def test_p_one_drops_everything(device):
    x, bias, residual, _ = _inputs(torch.float32, device)
    y = bias_dropout_add(x, bias, residual, 1.0)
    assert torch.equal(y.detach(), residual.detach())


def test_rejects_bad_probability(device):
    x = torch.randn(2, 3, device=device)
    with pytest.raises(ValueError, match="probability"):
        bias_dropout_add(x, None, x, 1.5)


def test_fp32_residual_with_bf16_branch(device):
    x = randn(*SHAPE, dtype=torch.bfloat16, device=device)
    residual = randn(*SHAPE, dtype=torch.float32, device=device, seed=3)
    dy = randn(*SHAPE, dtype=torch.float32, device=device, seed=4).detach()
    y = bias_dropout_add(x, None, residual, 0.1, training=False)
    dx, dresidual = grads(y, [x, residual], dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dresidual.dtype == torch.float32
    torch.testing.assert_close(y.detach().cpu(), (residual.detach() + x.detach().float()).cpu())
    torch.testing.assert_close(dx.float().cpu(), dy.to(torch.bfloat16).float().cpu())
    torch.testing.assert_close(dresidual.cpu(), dy.cpu())


def test_no_dropout_leaves_torch_rng_untouched(device):
    x, bias, residual, _ = _inputs(torch.float32, device)
    torch.manual_seed(5)
    expected = torch.rand(3, device=device)
    torch.manual_seed(5)
    bias_dropout_add(x, bias, residual, 0.5, training=False)
    bias_dropout_add(x, bias, residual, 0.0, training=True)
    assert torch.equal(torch.rand(3, device=device), expected)
