"""Context parallelism: which tokens of a sequence a context-parallel rank holds, and the differentiable ring step.

Load-balanced causal layout (Megatron-LM's): a sequence of length S is cut into 2C chunks of S / 2C tokens;
context-parallel rank r of C holds chunks r and 2C - 1 - r, concatenated. Under a causal mask an early chunk
sees few keys and a late one many, so pairing them gives every rank the same attention work.

``ring_exchange`` passes a tensor one step around the context-parallel group (rank r sends to r + 1 and receives
from r - 1), the step of ring attention (megatron.model.ring_attention) in both its passes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.deepspeed_comm import collectives


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


def ring_exchange(tensor: torch.Tensor, group) -> torch.Tensor:
    """Send ``tensor`` to the next rank of ``group``'s ring and return what the previous rank sent (one
    batch_isend_irecv: gloo and NCCL both have it)."""
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    dst, src = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dst, group), dist.P2POp(dist.irecv, received, src, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return received


def all_reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    """A detached sum over ``group`` (token counts, loss values: nothing here needs a gradient)."""
    total = tensor.detach().clone()
    collectives().all_reduce(total, group=group)
    return total
