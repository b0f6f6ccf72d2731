"""Context parallelism: which tokens of a sequence a context-parallel rank holds, and the differentiable ring step.

Load-balanced causal layout (Megatron-LM's): a sequence of length S is cut into 2C chunks of S / 2C tokens;
context-parallel rank r of C holds chunks r and 2C - 1 - r, concatenated. Under a causal mask an early chunk
sees few keys and a late one many, so pairing them gives every rank the same attention work.

``ring_shift`` passes a tensor one step around the context-parallel group (rank r sends to r + 1 and receives
from r - 1) with send/recv, which gloo and NCCL both have; its backward passes the gradient the other way, so
autograd runs through a ring of exchanges (megatron.model.ring_attention).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist


def chunk_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions [S / C] held by ``cp_rank``: chunks cp_rank and 2C - 1 - cp_rank of the 2C chunks."""
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} must be divisible by 2 x context_parallel_size "
                         f"({2 * cp_size}) for the load-balanced causal chunks")
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat((first, second))


def split_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced share of ``tensor`` along its sequence dimension ``dim`` (a copy)."""
    if cp_size == 1:
        return tensor
    index = chunk_positions(tensor.size(dim), cp_rank, cp_size, tensor.device)
    return tensor.index_select(dim, index)


def _exchange(tensor: torch.Tensor, group, to_next: bool) -> torch.Tensor:
    """Send ``tensor`` one step around the ring (to the next rank, or to the previous one) and return what the
    neighbour on the other side sent."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    step = 1 if to_next else -1
    dst, src = ranks[(me + step) % len(ranks)], ranks[(me - step) % len(ranks)]
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dst, group), dist.P2POp(dist.irecv, received, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(tensor, group, to_next=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        return _exchange(grad, ctx.group, to_next=False), None


def ring_shift(tensor: torch.Tensor, group) -> torch.Tensor:
    """The tensor of the previous rank of the context-parallel ring (differentiable; see module docstring)."""
    return _RingShift.apply(tensor, group)


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """A detached sum over ``group`` (token counts, loss values: nothing here needs a gradient)."""
    from megatron.deepspeed_comm import collectives

    total = tensor.detach().clone()
    collectives().all_reduce(total, group=group)
    return total
