"""Autograd-aware collectives for Megatron-style tensor and sequence parallelism.

Each function takes the model-parallel process group explicitly. With a group of size 1 (or ``None``,
the single-process case) every function is the identity, so the same model code serves TP=1 and TP>1.

Tensor parallelism (hidden dimension = last dimension):
  copy_to_model_parallel_region     forward identity,   backward all-reduce
  reduce_from_model_parallel_region forward all-reduce, backward identity
  scatter_to_model_parallel_region  forward keep own last-dim chunk, backward all-gather
  gather_from_model_parallel_region forward all-gather last dim,     backward keep own chunk
Sequence parallelism (sequence dimension ``seq_dim``; activations are [batch, seq, hidden] here):
  scatter_to_sequence_parallel_region       forward keep own seq chunk, backward all-gather
  gather_from_sequence_parallel_region      forward all-gather, backward reduce-scatter (the gathered
                                            tensor feeds a column-parallel matmul, so its gradient
                                            is a partial sum on every rank) or keep own chunk
  reduce_scatter_to_sequence_parallel_region forward reduce-scatter, backward all-gather
Expert parallelism (rows = first dimension):
  all_to_all_rows                   forward rows out[i] -> rank i, rows in from each rank (sizes given);
                                    backward the same exchange the other way
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.mpu.deepspeed_comm import collectives


def group_size(group) -> int:
    """World size of ``group``; 1 for ``None`` (no distributed world)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    comm = collectives()
    # torch 2.13 names it all_gather_single; older releases (and deepspeed.comm) only have all_gather_into_tensor.
    fn = getattr(comm, "all_gather_single", None) or comm.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    comm = collectives()
    fn = getattr(comm, "reduce_scatter_single", None) or comm.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    collectives().all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world != 0:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by {world} ranks")
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.size(0),) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, moved, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = group_size(group)
    if world == 1:
        return x
    if x.size(dim) % world != 0:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by {world} ranks")
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((moved.size(0) // world,) + tuple(moved.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, moved, group)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, backward_reduce_scatter):
        ctx.group, ctx.dim, ctx.rs = group, dim, backward_reduce_scatter
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.rs:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient (input replicated across TP ranks)."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results across TP ranks; gradient passes through."""
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, -1, group)


def gather_from_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's chunk along the last dimension."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, -1, group, False)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """Keep this rank's chunk of the sequence dimension."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, seq_dim, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, seq_dim: int = 1, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """All-gather the sequence dimension; backward reduce-scatters (or splits) the gradient."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, seq_dim, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
    """Sum partial results across TP ranks and keep this rank's sequence chunk."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToRegion.apply(x, seq_dim, group)


def all_reduce_sum(x: torch.Tensor, group: Optional[object]) -> torch.Tensor:
    """Non-differentiable in-place sum across ``group`` (a no-op for size 1)."""
    return _all_reduce(x, group)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send: List[int], receive: List[int], group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = x.new_empty((sum(receive),) + tuple(x.shape[1:]))
        collectives().all_to_all_single(out, x.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        collectives().all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(x: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
    """Rows send[0] of ``x`` (the first ones) go to rank 0 of ``group``, the next send[1] to rank 1, ...; returns
    the rows received, receive[i] from rank i, in rank order (every rank must know what it receives: exchange the
    sizes first). The gradient makes the reverse trip. Identity for a group of one."""
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, list(send), list(receive), group)


def all_to_all_equal(x: torch.Tensor, group) -> torch.Tensor:
    """Non-differentiable all-to-all of equal shares: the i-th of ``group_size`` equal row blocks of ``x`` goes to
    rank i, and block i of the result came from rank i (e.g. counts that size a following ``all_to_all_rows``). It
    runs on ``x``'s device and reads nothing back; identity for a group of one."""
    if group_size(group) == 1:
        return x
    out = torch.empty_like(x)
    collectives().all_to_all_single(out, x.contiguous(), group=group)
    return out
