"""Random-LTD's token operations where DeepSpeed's CUDA op does not load (megatron.model.random_ltd): the draw, the
gather and scatter with their gradients, and the mask between the kept tokens, against plain indexing."""
import torch

import pytest

from megatron.model.batch import causal_attention_mask
from megatron.model.gpt2_model import build_model
from megatron.model.random_ltd import (deepspeed_kernels_load, gather_tokens, kept_mask, sample_tokens,
                                       scatter_tokens)
from megatron.model.transformer import ParallelTransformerLayer
from megatron.mpu import SingleProcessState
from tests.model.helpers import tiny_config


def test_the_cuda_op_is_not_used_on_cpu():
    assert not deepspeed_kernels_load(torch.device("cpu"))


def test_draw_gather_scatter_and_their_gradients_match_indexing():
    torch.manual_seed(0)
    indices = sample_tokens(5, 12, batch=3, layers=2, device=torch.device("cpu"))
    assert indices.shape == (2, 3, 5)
    assert all(len(set(row.tolist())) == 5 and row.tolist() == sorted(row.tolist()) for row in indices.reshape(6, 5))
    layer = indices[1]
    hidden = torch.randn(3, 12, 4, requires_grad=True)
    weight = torch.randn(4, 4)
    out = scatter_tokens(hidden, gather_tokens(hidden, layer) @ weight, layer)

    reference_in = hidden.detach().clone().requires_grad_(True)
    expected = reference_in.clone()
    for b in range(3):
        expected[b, layer[b]] = reference_in[b, layer[b]] @ weight
    assert torch.equal(out, expected)
    upstream = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * upstream).sum(), hidden)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), reference_in)
    assert torch.allclose(grad, expected_grad)  # dropped tokens: passed through; kept ones: through the layer


def test_the_mask_between_kept_tokens_is_cut_per_sample():
    indices = torch.tensor([[0, 2, 3], [1, 4, 5]])
    dense = torch.rand(2, 1, 6, 6) > 0.5
    cut = kept_mask(dense, indices)
    for b in range(2):
        assert torch.equal(cut[b, 0], dense[b, 0][indices[b]][:, indices[b]])
    shared = kept_mask(dense[:1], indices)  # one mask for the batch: each sample's own rows and columns
    assert torch.equal(shared[1, 0], dense[0, 0][indices[1]][:, indices[1]])
    causal_only = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    assert kept_mask(None, indices) is None and kept_mask(causal_only, indices) is causal_only


@pytest.mark.parametrize("overrides", [{}, {"rotary_pct": 0.5, "num_kv_heads": 2}])
def test_a_rotary_layer_on_the_kept_tokens_is_the_full_sequence_with_the_dropped_tokens_hidden(overrides):
    """Kept tokens rotated at their places in the whole sequence (the draw's indices as positions): the layer's
    output on them equals the full sequence's, where every query is shown only the kept keys (and itself); at
    their places in the shortened sequence instead, it does not."""
    torch.manual_seed(0)
    model = build_model(tiny_config(pos_emb="rotary", **overrides), SingleProcessState()).eval()
    layer = next(m for m in model.modules() if isinstance(m, ParallelTransformerLayer))
    with torch.no_grad():  # sharp attention, so that where a key sits matters (at init it is nearly uniform)
        layer.attention.query_key_value.weight.mul_(30.0)
    x = torch.randn(2, 16, 32)
    indices = sample_tokens(6, 16, batch=2, layers=1, device=torch.device("cpu"))[0]
    dropped = torch.ones(2, 16, dtype=torch.bool).scatter(1, indices, False)
    hidden = causal_attention_mask(16) | dropped[:, None, None, :]
    hidden = hidden & ~torch.eye(16, dtype=torch.bool)  # a dropped query still sees itself (no empty row)
    with torch.no_grad():
        expected = gather_tokens(layer._forward(x, hidden), indices)
        kept = layer._forward(gather_tokens(x, indices), None, None, indices)
        shortened = layer._forward(gather_tokens(x, indices), None)
    scale = expected.abs().max().item()
    difference, misplaced = ((kept - expected).abs().max().item() / scale,
                             (shortened - expected).abs().max().item() / scale)
    print(f"relative difference: at the kept places {difference:.2e}, at the shortened places {misplaced:.2e}")
    assert difference <= 1e-5 and misplaced > 1e-2, (difference, misplaced)
