"""Block-sparse attention (sparse_fixed, sparse_variable, bigbird, bslongformer): the layouts follow DeepSpeed's
sparsity-config semantics (hand-drawn expectations below), the SDPA-masked layer equals a block-sparse
reference that attends only over each query block's layout tiles (outputs and gradients), and KV-cache decoding
equals the full forward. TP=2 is in tests/model/test_block_tensor_parallel.py."""

import math

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.block_sparse import make_layout
from megatron.mpu import SingleProcessState
from megatron.model.sparsity_config import SparsitySettings
from tests.model.helpers import tiny_config
from tests.model.kv_helpers import assert_decoding_matches_full_forward


def grid(text: str) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in row.split()] for row in text.strip().splitlines()])


def test_fixed_layout_local_windows_and_global_columns_per_head():
    """6 blocks, windows of 3, one global block; head 0 uses each window's last block, head 1 its middle one
    (num_different_global_patterns 2), seen by every later row."""
    settings = SparsitySettings("sparse_fixed", block=2, different_layout_per_head=True, num_local_blocks=3,
                                num_global_blocks=1, num_different_global_patterns=2)
    layout = make_layout(settings, 2, 12, seed=0)
    assert torch.equal(layout[0], grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        . . x x . .
        . . x x x .
        . . x x x x"""))
    assert torch.equal(layout[1], grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        . x . x . .
        . x . x x .
        . x . x x x"""))


def test_fixed_layout_trailing_partial_window_has_a_global_block():
    layout = make_layout(SparsitySettings("sparse_fixed", block=1, num_local_blocks=2), 1, 5, seed=0)
    assert torch.equal(layout[0], grid("""
        x . . . .
        x x . . .
        . x x . .
        . x x x .
        . x . x x"""))


def test_variable_layout_window_sizes_repeat_the_last_and_global_ranges():
    settings = SparsitySettings("sparse_variable", block=1, local_window_blocks=(1, 2), global_block_indices=(0,),
                                global_block_end_indices=(1,))
    assert torch.equal(make_layout(settings, 1, 6, seed=0)[0], grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        x . . x . .
        x . . x x .
        x . . . . x"""))


def test_bslongformer_layout_sliding_window_and_global_row_and_column():
    settings = SparsitySettings("bslongformer", block=1, num_sliding_window_blocks=3, global_block_indices=(2,))
    assert torch.equal(make_layout(settings, 1, 6, seed=0)[0], grid("""
        x . . . . .
        x x . . . .
        x x x . . .
        . . x x . .
        . . x x x .
        . . x . x x"""))


def test_bigbird_layout_random_blocks_are_earlier_and_seeded():
    settings = SparsitySettings("bigbird", block=1, different_layout_per_head=True, num_random_blocks=2,
                                num_sliding_window_blocks=3, num_global_blocks=1)
    base = make_layout(SparsitySettings("bigbird", block=1, num_random_blocks=0, num_sliding_window_blocks=3), 1, 16,
                       seed=0)[0]
    layout = make_layout(settings, 3, 16, seed=5)
    assert torch.equal(layout, make_layout(settings, 3, 16, seed=5))
    assert not torch.equal(layout, make_layout(settings, 3, 16, seed=6))
    assert not torch.equal(layout[0], layout[1])  # a random draw per head
    assert torch.equal(layout, layout.tril()) and (layout >= base).all()
    extra = (layout & ~base).sum(-1)  # each row adds at most its 2 random blocks
    assert extra.max() <= 2 and extra.sum() > 0


def _settings_overrides(kind):
    sparsity = {"sparse_fixed": dict(block=4, num_local_blocks=2, different_layout_per_head=True,
                                     num_different_global_patterns=2),
                "sparse_variable": dict(block=4, num_random_blocks=1, local_window_blocks=[1, 2],
                                        global_block_indices=[1]),
                "bigbird": dict(block=4, num_random_blocks=1, different_layout_per_head=True),
                "bslongformer": dict(block=2, num_sliding_window_blocks=3, global_block_indices=[0, 5],
                                     global_block_end_indices=[1, 6])}[kind]
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sparsity.items()))


KINDS = ["sparse_fixed", "sparse_variable", "bigbird", "bslongformer"]


def _block_sparse_reference(q, k, v, layout, block):
    """Causal attention that, for each query block, gathers only the key blocks its layout row marks."""
    b, h, s, d = q.shape
    out_rows = []
    for head in range(h):
        rows = []
        for i in range(s // block):
            cols = [j for j in range(i + 1) if layout[head, i, j]]
            keys = torch.cat([k[:, head, j * block:(j + 1) * block] for j in cols], dim=1)
            vals = torch.cat([v[:, head, j * block:(j + 1) * block] for j in cols], dim=1)
            key_pos = torch.cat([torch.arange(j * block, (j + 1) * block) for j in cols])
            query_pos = torch.arange(i * block, (i + 1) * block)
            scores = q[:, head, i * block:(i + 1) * block] @ keys.transpose(1, 2) / math.sqrt(d)
            scores = scores.masked_fill(key_pos.unsqueeze(0) > query_pos.unsqueeze(1), float("-inf"))
            rows.append(torch.softmax(scores, dim=-1) @ vals)
        out_rows.append(torch.cat(rows, dim=1))
    return torch.stack(out_rows, dim=1)


@pytest.mark.parametrize("kind", KINDS)
def test_masked_layer_equals_block_sparse_reference_outputs_and_grads(kind):
    """Both attention paths (SDPA with the boolean mask; explicit scores, as under the fusion flags)."""
    config = tiny_config(attention_config=[kind, "global"], sparsity_config=_settings_overrides(kind))
    attention = build_model(config, SingleProcessState()).layers[0].attention
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    params = [x] + list(attention.parameters())

    qkv = attention.query_key_value(x).view(2, 16, 4, 3, 8)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    layout = attention.block_sparse.layout.expand(4, -1, -1)
    context = _block_sparse_reference(q, k, v, layout, attention.block_sparse.block)
    want = attention.dense(context.transpose(1, 2).reshape(2, 16, 32))
    want_grads = torch.autograd.grad(want.square().sum(), params)
    # the layout really is sparse: all tiles (dense causal attention) give another output
    dense = _block_sparse_reference(q, k, v, torch.ones_like(layout), attention.block_sparse.block)
    assert not torch.allclose(context, dense, atol=1e-4)

    causal = torch.ones(16, 16, dtype=torch.bool).triu(1).view(1, 1, 16, 16)
    for explicit in (False, True):
        attention.force_explicit = explicit
        got = attention(x, causal)
        grads = torch.autograd.grad(got.square().sum(), params)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_kv_cache_decoding_equals_full_forward():
    """One model with a layer of each type (per-head layouts, random blocks)."""
    sparsity = (("block", 4), ("different_layout_per_head", True), ("global_block_indices", (1,)),
                ("num_different_global_patterns", 2), ("num_local_blocks", 2), ("num_random_blocks", 1))
    model = build_model(tiny_config(num_layers=4, pos_emb="rotary", attention_config=KINDS, sparsity_config=sparsity),
                        SingleProcessState()).eval()
    assert_decoding_matches_full_forward(model)


def test_positions_beyond_the_layout_are_refused():
    model = build_model(tiny_config(attention_config=["bigbird", "global"], sparsity_config=(("block", 4),),
                                    pos_emb="rotary", max_position_embeddings=32), SingleProcessState()).eval()
    tokens = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="seq_length=16"):
        model((tokens, torch.arange(20).unsqueeze(0), None))
