"""How each parameter of the GPT is split across tensor-parallel ranks, and merging / splitting shards.

Names are GPT2ModelSequential's (``embedding.*``, ``layers.N.*``, ``final_norm.*``, ``head.*``). Splits
follow megatron.mpu's layers: vocabulary-parallel embedding and output head (rows), column-parallel fused
QKV and MLP up projection (rows; a gated MLP's [up | gate] halves are each split, see
``megatron.mpu.utils.shard_of``), row-parallel attention output and MLP down projection (columns), rpe
bias tables (heads, dim 1). Everything else (norms, row-parallel biases, learned positions) is replicated.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint_conversion.errors import ConversionError
from megatron.mpu.utils import shard_of

_COLUMN = ("attention.query_key_value.weight", "attention.query_key_value.bias", "mlp.linear1.weight",
           "mlp.linear1.bias", "word_embeddings.weight", "final_linear.weight")
_ROW = ("attention.dense.weight", "mlp.linear2.weight")


def split_rule(name: str, gated_mlp: bool) -> Optional[Tuple[int, int]]:
    """(dimension, chunks) along which ``name`` is split, or None when every rank holds all of it."""
    if name.endswith(_COLUMN):
        return 0, (2 if gated_mlp and ".mlp.linear1." in f".{name}" else 1)
    if name.endswith(_ROW):
        return 1, 1
    if name.endswith("attention.rpe"):
        return 1, 1
    return None


def merge_shards(name: str, shards: Sequence[torch.Tensor], gated_mlp: bool) -> torch.Tensor:
    """The full tensor from the tensor-parallel ranks' shards (rank order)."""
    rule = split_rule(name, gated_mlp)
    if rule is None or len(shards) == 1:
        first = shards[0]
        for rank, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise ConversionError(f"{name} should be identical on every tensor-parallel rank but rank {rank} "
                                      f"differs from rank 0; the checkpoint is inconsistent")
        return first
    dim, chunks = rule
    pieces = [s.chunk(chunks, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[c] for p in pieces], dim=dim) for c in range(chunks)], dim=dim)


def split_full(name: str, full: torch.Tensor, world: int, gated_mlp: bool) -> List[torch.Tensor]:
    """The shards of ``full`` for ``world`` tensor-parallel ranks (rank order)."""
    rule = split_rule(name, gated_mlp)
    if rule is None or world == 1:
        return [full] * world
    dim, chunks = rule
    try:
        return [shard_of(full, dim, rank, world, chunks) for rank in range(world)]
    except ValueError as exc:
        raise ConversionError(f"{name} of shape {tuple(full.shape)} cannot be split over model_parallel_size="
                              f"{world}: {exc}") from None
