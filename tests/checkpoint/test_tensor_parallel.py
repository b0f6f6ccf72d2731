"""Merging and splitting tensor-parallel shards agrees with how the model's layers shard themselves."""
import pytest
import torch

from megatron.errors import ConversionError
from megatron.checkpoint.tensor_parallel import merge_shards, split_full, split_rule
from megatron.mpu.utils import shard_of
from tests.model.helpers import tiny_config

MHA = tiny_config()
GATED = tiny_config(activation="swiglu")
GQA = tiny_config(num_kv_heads=2)  # 4 query heads, 2 kv heads, head_dim 8: blocks of 32, 16, 16 rows


@pytest.mark.parametrize("name,config,rule", [
    ("layers.0.attention.query_key_value.weight", MHA, (0, 1)),
    ("layers.0.attention.query_key_value.bias", GQA, (0, (32, 16, 16))),
    ("layers.3.mlp.linear1.weight", GATED, (0, 2)),
    ("layers.3.mlp.linear1.bias", MHA, (0, 1)),
    ("layers.1.attention.dense.weight", MHA, (1, 1)),
    ("layers.1.mlp.linear2.weight", GATED, (1, 1)),
    ("layers.1.attention.rpe.weight", MHA, (1, 1)),
    ("layers.1.attention.alibi_embed.slopes", MHA, (0, 1)),
    ("embedding.word_embeddings.weight", MHA, (0, 1)),
    ("head.final_linear.weight", MHA, (0, 1)),
    ("layers.1.attention.dense.bias", MHA, None),
    ("layers.0.input_layernorm.weight", MHA, None),
    ("final_norm.norm.scale", MHA, None),
    ("embedding.position_embeddings.weight", MHA, None),
    # DeepSpeed's residual MoE MLP is a whole copy of the expert on every tensor rank, as the experts (not split)
    ("layers.0.mlp.mlp.linear1.weight", GATED, None),
    ("mlp.mlp.linear2.weight", GATED, None),
    ("layers.0.mlp.deepspeed_moe.experts.deepspeed_experts.1.linear1.weight", GATED, None),
    ("layers.0.mlp.experts.mlp.w1", GATED, (0, 1)),
])
def test_split_rules(name, config, rule):
    assert split_rule(name, config) == rule


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("name,config,rows", [("layers.0.mlp.linear1.weight", GATED, 16),
                                              ("layers.0.mlp.linear1.weight", MHA, 16),
                                              ("layers.0.attention.dense.weight", MHA, 16),
                                              ("layers.0.attention.query_key_value.weight", GQA, 64)])
def test_split_matches_layer_sharding_and_merge_inverts_it(world, name, config, rows):
    full = torch.randn(rows, 8)
    dim, chunks = split_rule(name, config)
    shards = split_full(name, full, world, config)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, shard_of(full, dim, rank, world, chunks))
    assert torch.equal(merge_shards(name, shards, config), full)


def test_gated_merge_keeps_up_and_gate_halves_apart():
    up, gate = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    shards = split_full("layers.0.mlp.linear1.weight", torch.cat((up, gate)), 2, GATED)
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    merged = merge_shards("layers.0.mlp.linear1.weight", shards, GATED)
    assert torch.equal(merged, torch.cat((up, gate)))


def test_gqa_ranks_hold_their_queries_keys_and_values():
    """GPT-NeoX's GQA rows: rank r holds [its query heads | its key heads | its value heads]."""
    full = torch.arange(64.0).view(64, 1)  # q heads 0-3 rows 0-31, k heads 0-1 rows 32-47, v heads rows 48-63
    shards = split_full("layers.0.attention.query_key_value.weight", full, 2, GQA)
    assert shards[1].flatten().tolist() == list(range(16, 32)) + list(range(40, 48)) + list(range(56, 64))


def test_replicated_tensors_must_agree():
    with pytest.raises(ConversionError, match="identical on every tensor-parallel rank"):
        merge_shards("final_norm.norm.weight", [torch.ones(4), torch.zeros(4)], MHA)


def test_unsplittable_size_is_refused():
    with pytest.raises(ConversionError, match="model_parallel_size=4"):
        split_full("layers.0.attention.dense.weight", torch.randn(4, 6), 4, MHA)
