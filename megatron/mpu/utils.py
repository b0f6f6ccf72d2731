"""Small shape helpers shared by the tensor-parallel layers."""
from __future__ import annotations

import torch


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division, with a clear error naming ``what`` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def shard_of(full: torch.Tensor, dim: int, rank: int, world_size: int, chunks: int = 1) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``.

    ``chunks`` > 1 means the dimension is a concatenation of ``chunks`` equal blocks (e.g. the gate and
    up projections of a GLU) and each rank keeps its share of every block, concatenated in order.
    """
    if world_size == 1:
        return full
    blocks = full.chunk(chunks, dim=dim) if chunks > 1 else (full,)
    parts = []
    for block in blocks:
        if block.size(dim) % world_size != 0:
            raise ValueError(f"dimension {dim} of size {block.size(dim)} does not split over {world_size} ranks")
        parts.append(block.chunk(world_size, dim=dim)[rank])
    return torch.cat(parts, dim=dim).contiguous()
