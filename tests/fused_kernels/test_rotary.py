"""Rotary embedding: the reference is the rotate-half rotation (relative-position property,
complex-number form), and the Triton kernel matches it forward and backward."""
import pytest
import torch

from megatron.fused_kernels.rotary import rotary, rotary_reference, rotary_tables
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_equals_complex_rotation_of_half_pairs():
    x = torch.randn(2, 6, 3, 10)
    cos, sin = rotary_tables(6, 8, base=100.0)
    y = rotary_reference(x, cos, sin)
    pairs = torch.complex(x[..., :4], x[..., 4:8])
    angles = torch.outer(torch.arange(6.0), 1.0 / 100.0 ** (torch.arange(0, 8, 2) / 8))
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    torch.testing.assert_close(y[..., :4], rotated.real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[..., 4:8], rotated.imag, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[..., 8:], x[..., 8:])


def test_reference_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        cq, sq = rotary_tables(1, 8, offset=q_pos)
        ck, sk = rotary_tables(1, 8, offset=k_pos)
        return (rotary_reference(q, cq, sq) * rotary_reference(k, ck, sk)).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_first", [False, True])
@pytest.mark.parametrize("rot_dim", [6, 12])
def test_fused_matches_reference(device, dtype, seq_first, rot_dim):
    shape = (5, 2, 3, 12) if seq_first else (2, 5, 3, 12)
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    dy = randn(*shape, dtype=dtype, device=device, seed=1).detach()
    cos, sin = rotary_tables(5, rot_dim, offset=7, device=device)
    y = rotary(x, cos, sin, seq_first)
    (dx,) = grads(y, [x], dy)
    x_ref = as_fp32_leaf(x)
    y_ref = rotary_reference(x_ref, cos.cpu(), sin.cpu(), seq_first)
    (dx_ref,) = grads(y_ref, [x_ref], dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    assert_matches(dx, dx_ref, dtype, "dx")
    assert torch.equal(y.detach()[..., rot_dim:], x.detach()[..., rot_dim:])


def test_rejects_tables_of_wrong_length(device):
    cos, sin = rotary_tables(4, 8, device=device)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary(torch.randn(1, 5, 2, 8, device=device), cos, sin)
