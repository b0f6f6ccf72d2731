"""Small shape helpers shared by the tensor-parallel layers."""
from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

Chunks = Union[int, Sequence[int]]
"""How a split dimension is made of blocks: a number of equal blocks, or the blocks' sizes."""


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    """Exact integer division, with a clear error naming ``what`` when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by {denominator}")
    return numerator // denominator


def block_sizes(size: int, chunks: Chunks) -> Tuple[int, ...]:
    """The sizes of the blocks a dimension of ``size`` is made of (see ``Chunks``)."""
    if isinstance(chunks, int):
        if size % chunks:
            raise ValueError(f"a dimension of size {size} does not split into {chunks} equal blocks")
        return (size // chunks,) * chunks
    sizes = tuple(int(c) for c in chunks)
    if sum(sizes) != size:
        raise ValueError(f"blocks {sizes} do not add up to the dimension's size {size}")
    return sizes


def shard_of(full: torch.Tensor, dim: int, rank: int, world_size: int, chunks: Chunks = 1) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``.

    ``chunks`` other than 1 means the dimension is a concatenation of blocks (``chunks`` equal ones, e.g.
    the up and gate projections of a GLU, or blocks of the given sizes, e.g. the query, key and value rows
    of grouped-query attention) and each rank keeps its share of every block, concatenated in order.
    """
    if world_size == 1:
        return full
    blocks = full.split(list(block_sizes(full.size(dim), chunks)), dim=dim) if chunks != 1 else (full,)
    parts = []
    for block in blocks:
        if block.size(dim) % world_size != 0:
            raise ValueError(f"dimension {dim} of size {block.size(dim)} does not split over {world_size} ranks")
        parts.append(block.chunk(world_size, dim=dim)[rank])
    return torch.cat(parts, dim=dim).contiguous()


def join_shards(shards: Sequence[torch.Tensor], dim: int, chunks: Chunks = 1) -> torch.Tensor:
    """The full tensor from every rank's ``shard_of`` (rank order): the inverse of ``shard_of``."""
    world = len(shards)
    if world == 1:
        return shards[0]
    full_size = shards[0].size(dim) * world
    local = [size // world for size in block_sizes(full_size, chunks)]
    pieces = [shard.split(local, dim=dim) for shard in shards]
    return torch.cat([torch.cat([p[block] for p in pieces], dim=dim) for block in range(len(local))], dim=dim)
