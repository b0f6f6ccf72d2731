"""LoRA adapters for the tensor-parallel linear layers, split as their base layer is.

An adapter adds ``scale * B A dropout(x)`` (A [r, in], B [out, r], scale alpha / r) to its base layer's output,
as Hugging Face peft's ``lora.Linear``. Its factors are split so that no rank ever needs the whole product:

* column-parallel base (output rows split): A is replicated, B is split by output rows as the base weight is
  (``chunks`` too: a GLU's [up | gate] or grouped-query attention's [q | k | v] blocks). Every rank holds the same A
  and computes the same A x, but its gradient reaches A only through this rank's rows of B, so A's gradient is summed
  over the ranks (``copy_to_model_parallel_region`` on A: identity forward, all-reduce backward).
* row-parallel base (input columns split): A is split by input columns, B replicated. A_t x_t is this rank's share
  of A x; ``B (A_t x_t)`` is then a partial output added to the base layer's partial output before the base layer sums
  them over the ranks (so one reduction serves both). B's gradient is again summed over the ranks.

Dropout on the adapter's input follows the model's rule (megatron.mpu.random): a column-parallel adapter's input is
replicated over the ranks and draws the same mask on each from the default stream; a row-parallel adapter's input is
this rank's partition, whose mask comes from the model-parallel stream of the model's RNG tracker (``rng_tracker``, as
attention dropout's), so the ranks' masks are independent and together are one mask over the whole input.

Both factors start as the full tensors would (A kaiming-uniform as peft and torch.nn.Linear start a weight, from a
generator seeded per adapter, so the same whatever the tensor-parallel split; B zeros): the untrained adapter adds
exactly zero. Split factors carry ``model_parallel`` / ``partition_dim`` like the base layers' weights.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.collectives import copy_to_model_parallel_region
from megatron.mpu.utils import Chunks, shard_of


def kaiming_uniform_full(rows: int, columns: int, seed: int) -> torch.Tensor:
    """peft's A: ``nn.init.kaiming_uniform_(weight, a=sqrt(5))`` of the full [rows, columns] tensor, seeded."""
    full = torch.empty(rows, columns, dtype=torch.float32)
    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return full


class LoRAAdapter(nn.Module):
    """The low-rank update of one tensor-parallel linear layer (``column``: of a ColumnParallelLinear, else of a
    RowParallelLinear); ``forward(x)`` takes what the base layer multiplies by its weight shard on this rank and
    returns this rank's share of the update (column: its output columns; row: its partial sum). ``rng_tracker``: the
    model's RNG tracker, whose model-parallel stream draws a row-parallel adapter's dropout mask (needed then)."""

    def __init__(self, input_size: int, output_size: int, rank: int, alpha: float, dropout: float, column: bool,
                 group, tp_rank: int, tp_world: int, seed: int, chunks: Chunks = 1, rng_tracker=None) -> None:
        super().__init__()
        if dropout > 0 and not column and rng_tracker is None:
            raise ValueError("a row-parallel LoRA adapter with dropout needs the model's rng_tracker")
        self.rank, self.scale, self.column, self.group = rank, float(alpha) / rank, column, group
        self.rng_tracker = rng_tracker
        self.tp_rank, self.tp_world, self.chunks = tp_rank, tp_world, chunks
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        full_a = kaiming_uniform_full(rank, input_size, seed)
        split = tp_world > 1
        if column:
            self.lora_A = nn.Parameter(full_a)
            self.lora_B = nn.Parameter(torch.zeros(output_size // tp_world, rank))
            self.lora_B.model_parallel, self.lora_B.partition_dim = split, 0
            self.lora_B.lora_chunks = chunks
        else:
            self.lora_A = nn.Parameter(shard_of(full_a, 1, tp_rank, tp_world, chunks))
            self.lora_A.model_parallel, self.lora_A.partition_dim = split, 1
            self.lora_A.lora_chunks = chunks
            self.lora_B = nn.Parameter(torch.zeros(output_size, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.column:
            a, b = copy_to_model_parallel_region(self.lora_A, self.group), self.lora_B
        else:
            a, b = self.lora_A, copy_to_model_parallel_region(self.lora_B, self.group)
        return F.linear(F.linear(self._dropped(x), a), b) * self.scale

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout of the input: a row-parallel adapter's partition on the tracker's model-parallel stream."""
        partitioned = not self.column and isinstance(self.dropout, nn.Dropout) and self.training
        with self.rng_tracker.fork() if partitioned else contextlib.nullcontext():
            return self.dropout(x)
