"""Merging and splitting tensor-parallel shards agrees with how the model's layers shard themselves."""
import pytest
import torch

from megatron.checkpoint_conversion import ConversionError
from megatron.checkpoint_conversion.tensor_parallel import merge_shards, split_full, split_rule
from megatron.mpu.utils import shard_of


@pytest.mark.parametrize("name,gated,rule", [
    ("layers.0.attention.query_key_value.weight", False, (0, 1)),
    ("layers.3.mlp.linear1.weight", True, (0, 2)),
    ("layers.3.mlp.linear1.bias", False, (0, 1)),
    ("layers.1.attention.dense.weight", False, (1, 1)),
    ("layers.1.mlp.linear2.weight", True, (1, 1)),
    ("embedding.word_embeddings.weight", False, (0, 1)),
    ("head.final_linear.weight", False, (0, 1)),
    ("layers.1.attention.dense.bias", False, None),
    ("layers.0.input_layernorm.weight", False, None),
    ("embedding.position_embeddings.weight", False, None),
])
def test_split_rules(name, gated, rule):
    assert split_rule(name, gated) == rule


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name,gated", [("layers.0.mlp.linear1.weight", True), ("layers.0.mlp.linear1.weight", False),
                                        ("layers.0.attention.dense.weight", False)])
def test_split_matches_layer_sharding_and_merge_inverts_it(world, name, gated):
    full = torch.randn(16, 8)
    dim, chunks = split_rule(name, gated)
    shards = split_full(name, full, world, gated)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, shard_of(full, dim, rank, world, chunks))
    assert torch.equal(merge_shards(name, shards, gated), full)


def test_gated_merge_keeps_up_and_gate_halves_apart():
    up, gate = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    shards = split_full("layers.0.mlp.linear1.weight", torch.cat((up, gate)), 2, True)
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    merged = merge_shards("layers.0.mlp.linear1.weight", shards, True)
    assert torch.equal(merged, torch.cat((up, gate)))


def test_replicated_tensors_must_agree():
    with pytest.raises(ConversionError, match="identical on every tensor-parallel rank"):
        merge_shards("final_norm.norm.weight", [torch.ones(4), torch.zeros(4)], False)


def test_unsplittable_size_is_refused():
    with pytest.raises(ConversionError, match="model_parallel_size=4"):
        split_full("layers.0.attention.dense.weight", torch.randn(4, 6), 4, False)
