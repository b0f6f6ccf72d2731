"""Tensor-parallel layers: vocabulary-parallel embedding, column- and row-parallel linear.

Every layer is initialised from the *full* tensor: ``init_fn`` fills a full-size fp32 tensor, the layer
keeps this rank's shard and drops the rest. With an ``init_fn`` seeded per tensor (see
``megatron.model.init_functions``) the weights are then the same whatever the parallel layout. Each split
parameter carries ``model_parallel`` (split across ranks) and ``partition_dim`` (the dimension that is split).

The linear layers take an optional LoRA adapter (``lora``: megatron.mpu.lora, attached by megatron.model.lora), whose
update is added to this rank's output before any reduction.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.collectives import (
    copy_to_model_parallel_region,
    gather_from_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
)
from megatron.mpu.utils import Chunks, divide, shard_of

InitFn = Callable[[torch.Tensor], None]


def _fill_shard(param: torch.Tensor, full_shape: Tuple[int, ...], init_fn: Optional[InitFn], dim: int,
                rank: int, world: int, chunks: Chunks = 1) -> None:
    """Initialise ``param`` with this rank's shard of a full tensor built by ``init_fn``."""
    with torch.no_grad():
        if init_fn is None:
            param.zero_()
            return
        full = torch.empty(full_shape, dtype=torch.float32)
        init_fn(full)
        param.copy_(shard_of(full, dim, rank, world, chunks))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across the model-parallel ranks.

    With ``sequence_parallel`` the output is reduce-scattered over the sequence dimension (dim 1)
    instead of all-reduced.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel_state, init_fn: Optional[InitFn],
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = parallel_state.get_model_parallel_group()
        world = parallel_state.get_model_parallel_world_size()
        rank = parallel_state.get_model_parallel_rank()
        self.num_embeddings = num_embeddings
        self.per_rank = divide(num_embeddings, world, "padded vocabulary size")
        self.vocab_start = rank * self.per_rank
        self.vocab_end = self.vocab_start + self.per_rank
        self.world = world
        self.sequence_parallel = sequence_parallel and world > 1
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim))
        _fill_shard(self.weight, (num_embeddings, embedding_dim), init_fn, 0, rank, world)
        self.weight.model_parallel = world > 1
        self.weight.partition_dim = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group, seq_dim=1)
        return reduce_from_model_parallel_region(out, self.group)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A's output rows split across ranks; each rank yields its output columns.

    ``chunks`` other than 1: the output dimension is concatenated blocks (``chunks`` equal ones, e.g. a GLU's
    up|gate, or blocks of the given sizes, e.g. grouped-query attention's query|key|value), each split across
    ranks, so the local output is this rank's share of every block. With ``sequence_parallel``
    the input arrives sequence-sharded and is all-gathered first.
    """

    def __init__(self, input_size: int, output_size: int, parallel_state, init_fn: Optional[InitFn],
                 bias: bool = True, gather_output: bool = False, chunks: Chunks = 1,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.group = parallel_state.get_model_parallel_group()
        world = parallel_state.get_model_parallel_world_size()
        rank = parallel_state.get_model_parallel_rank()
        if gather_output and chunks != 1 and world > 1:
            raise ValueError("ColumnParallelLinear cannot gather the output of a chunked (GLU) projection")
        self.input_size, self.output_size = input_size, output_size
        self.output_per_rank = divide(output_size, world, "column-parallel output size")
        self.gather_output = gather_output
        self.chunks = chunks
        self.sequence_parallel = sequence_parallel and world > 1
        self.weight = nn.Parameter(torch.empty(self.output_per_rank, input_size))
        _fill_shard(self.weight, (output_size, input_size), init_fn, 0, rank, world, chunks)
        self.weight.model_parallel = world > 1
        self.weight.partition_dim = 0
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_per_rank))
            self.bias.model_parallel = world > 1
            self.bias.partition_dim = 0
        else:
            self.register_parameter("bias", None)
        self.lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.local_input(x)
        out = F.linear(local, self.weight, self.bias)
        if self.lora is not None:
            out = out + self.lora(local)
        if self.gather_output:
            out = gather_from_model_parallel_region(out, self.group)
        return out

    def forward_without_bias(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``forward(x)`` before the bias is added, for a fused op that adds it itself."""
        if self.gather_output:
            raise ValueError("forward_without_bias needs a ColumnParallelLinear with gather_output=False")
        local = self.local_input(x)
        out = F.linear(local, self.weight)
        return out if self.lora is None else out + self.lora(local)

    def local_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this rank multiplies by its weight shard: ``x`` whole (all-gathered over the sequence under
        sequence parallelism), with the backward that sums its gradient over the ranks."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group, seq_dim=1)
        return copy_to_model_parallel_region(x, self.group)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A's input columns split across ranks; partial products are summed.

    ``chunks`` other than 1: the input dimension is concatenated blocks, each split across ranks (as
    ColumnParallelLinear's output), so the local input is this rank's share of every block.

    With ``sequence_parallel`` the sum is a reduce-scatter over the sequence dimension. The bias is
    replicated; under sequence parallelism each rank only sees its sequence chunk, so the bias passes
    through ``copy_to_model_parallel_region`` which all-reduces its gradient.
    """

    def __init__(self, input_size: int, output_size: int, parallel_state, init_fn: Optional[InitFn],
                 bias: bool = True, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 chunks: Chunks = 1) -> None:
        super().__init__()
        self.group = parallel_state.get_model_parallel_group()
        world = parallel_state.get_model_parallel_world_size()
        rank = parallel_state.get_model_parallel_rank()
        if chunks != 1 and not input_is_parallel and world > 1:
            raise ValueError("RowParallelLinear with chunks needs input_is_parallel=True")
        self.chunks = chunks
        self.input_size, self.output_size = input_size, output_size
        self.world = world
        self.input_per_rank = divide(input_size, world, "row-parallel input size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and world > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs RowParallelLinear(input_is_parallel=True)")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_per_rank))
        _fill_shard(self.weight, (output_size, input_size), init_fn, 1, rank, world, chunks)
        self.weight.model_parallel = world > 1
        self.weight.partition_dim = 1
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
        else:
            self.register_parameter("bias", None)
        self.lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:  # nothing to sum: one fused matmul + bias (addmm)
            out = F.linear(x, self.weight, self.bias)
            return out if self.lora is None else out + self.lora(x)
        out, bias = self.forward_without_bias(x)
        return out if bias is None else out + bias

    def forward_without_bias(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(output without bias, bias)``, output + bias == ``forward(x)``, for a fused op that adds the
        bias itself. Under sequence parallelism the bias passes through copy_to_model_parallel_region, as
        in forward, so that its gradient is summed over the ranks' sequence chunks."""
        if not self.input_is_parallel:
            x = scatter_to_model_parallel_region(x, self.group)
        out = F.linear(x, self.weight)
        if self.lora is not None:  # its partial sum joins the base layer's in the one reduction below
            out = out + self.lora(x)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, self.group, seq_dim=1)
            bias = None if self.bias is None else copy_to_model_parallel_region(self.bias, self.group)
        else:
            out = reduce_from_model_parallel_region(out, self.group)
            bias = self.bias
        return out, bias
