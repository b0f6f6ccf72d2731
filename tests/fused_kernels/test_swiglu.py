"""SwiGLU: the Triton kernel matches silu(gate) * up forward and backward, also when gate and up
are the strided halves of one projection."""
import pytest
import torch
import torch.nn.functional as F

from megatron.fused_kernels.swiglu import swiglu, swiglu_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_is_silu_gate_times_up():
    gate, up = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(swiglu_reference(gate, up), gate * torch.sigmoid(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["separate", "halves_of_one_projection"])
def test_fused_matches_reference(device, dtype, layout):
    if layout == "separate":
        gate = randn(2, 7, 19, dtype=dtype, device=device, scale=2.0)
        up = randn(2, 7, 19, dtype=dtype, device=device, seed=2)
        leaves, split = [gate, up], lambda ts: ts
    else:
        projection = randn(2, 7, 38, dtype=dtype, device=device, scale=2.0)
        leaves = [projection]

        def split(ts):
            up_half, gate_half = ts[0].chunk(2, dim=-1)
            return [gate_half, up_half]

    dy = randn(2, 7, 19, dtype=dtype, device=device, seed=1).detach()
    y = swiglu(*split(leaves))
    fused_grads = grads(y, leaves, dy)
    ref_leaves = [as_fp32_leaf(t) for t in leaves]
    y_ref = swiglu_reference(*split(ref_leaves))
    ref_grads = grads(y_ref, ref_leaves, dy.float().cpu())
    assert_matches(y, y_ref, dtype, "y")
    for index, (got, want) in enumerate(zip(fused_grads, ref_grads)):
        assert_matches(got, want, dtype, f"grad {index}")


def test_rejects_mismatched_inputs(device):
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(2, 3, device=device), torch.randn(2, 4, device=device))


def test_reference_matches_neox_swiglu_activation_convention():
    h = torch.randn(4, 10)
    up, gate = h.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_reference(gate, up), F.silu(gate) * up)
