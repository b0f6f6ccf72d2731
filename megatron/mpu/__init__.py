"""Model parallelism: the parallel-state object, tensor-parallel layers, collectives, cross entropy (also in chunks
of tokens together with the output head's matmul), RNG streams and batch broadcast; and
megatron.mpu.host_collectives, the one home for the values that cross ranks outside the model (flags, counts,
metrics, norms, objects: on the group's device, NCCL's or gloo's). Nothing here keeps global state; pass a
ParallelState around.

May import: nothing of megatron.
"""
from megatron.mpu.chunked_cross_entropy import linear_cross_entropy, weighted_linear_cross_entropy
from megatron.mpu.collectives import (copy_to_model_parallel_region, gather_from_model_parallel_region,
                                      gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
                                      reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region,
                                      scatter_to_sequence_parallel_region)
from megatron.mpu.cross_entropy import vocab_parallel_cross_entropy
from megatron.mpu.data import broadcast_data
from megatron.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.mpu.parallel_state import ParallelState, SingleProcessState, build_parallel_state
from megatron.mpu.random import RNGStatesTracker, model_parallel_seed
from megatron.mpu.utils import block_sizes, divide, join_shards, shard_of

__all__ = [
    "ParallelState", "SingleProcessState", "build_parallel_state",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "copy_to_model_parallel_region", "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region", "gather_from_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy", "linear_cross_entropy", "weighted_linear_cross_entropy",
    "broadcast_data", "RNGStatesTracker", "model_parallel_seed",
    "block_sizes", "divide", "join_shards", "shard_of",
]
