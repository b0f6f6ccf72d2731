"""Per-token cross entropy: the Triton kernel matches F.cross_entropy forward and backward,
over one and several vocabulary blocks, with ignored tokens, strided rows and bf16 logits."""
import pytest
import torch

from megatron.fused_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from tests.fused_kernels.helpers import DTYPES, as_fp32_leaf, assert_matches, grads, randn


def test_reference_is_negative_log_likelihood():
    logits, targets = torch.randn(5, 11), torch.randint(0, 11, (5,))
    expected = -torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(cross_entropy_reference(logits, targets), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [37, 5003])  # 5003 spans two vocabulary blocks
def test_fused_matches_reference(device, dtype, vocab):
    tokens = 6
    logits = randn(tokens, vocab, dtype=dtype, device=device, scale=4.0)
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(5))
    targets[2] = -100
    targets = targets.to(device)
    dloss = torch.linspace(0.5, 2.0, tokens, device=device)
    loss = cross_entropy(logits, targets)
    (dlogits,) = grads(loss, [logits], dloss)
    logits_ref = as_fp32_leaf(logits)
    loss_ref = cross_entropy_reference(logits_ref, targets.cpu())
    (dlogits_ref,) = grads(loss_ref, [logits_ref], dloss.cpu())
    assert_matches(loss, loss_ref, torch.float32, "loss")
    assert_matches(dlogits, dlogits_ref, dtype, "dlogits")
    assert loss[2].item() == 0.0 and torch.all(dlogits[2] == 0)


def test_strided_rows_and_custom_ignore_index(device):
    wide = randn(4, 23, dtype=torch.float32, device=device)
    logits = wide[:, :20]
    targets = torch.tensor([3, 0, 19, 7], device=device)
    loss = cross_entropy(logits, targets, ignore_index=7)
    (dwide,) = grads(loss, [wide], torch.ones(4))
    wide_ref = as_fp32_leaf(wide)
    loss_ref = cross_entropy_reference(wide_ref[:, :20], targets.cpu(), ignore_index=7)
    (dwide_ref,) = grads(loss_ref, [wide_ref], torch.ones(4))
    assert_matches(loss, loss_ref, torch.float32, "loss")
    assert_matches(dwide, dwide_ref, torch.float32, "dlogits")


def test_out_of_range_target_gives_nan(device):
    loss = cross_entropy(torch.randn(2, 5, device=device), torch.tensor([1, 5], device=device))
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1])


def test_rejects_non_int64_targets(device):
    with pytest.raises(ValueError, match="int64"):
        cross_entropy(torch.randn(2, 5, device=device), torch.tensor([1, 2], dtype=torch.int32, device=device))
