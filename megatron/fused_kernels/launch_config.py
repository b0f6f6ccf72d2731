"""Block sizes, warps and program counts of every Triton kernel launch, in one place: the wrappers
launch what these functions return, and ``tests/fused_kernels/cuda_compile_check.py`` compiles what
they return on both sides of every edge below (with ``--all``: every power-of-two width up to 131072)
for sm_80 and sm_90 and fails on any register spill (ptxas -v), so a block size that spills cannot
reach a GPU.

The rule behind the numbers: each thread holds about ELEMENTS_PER_THREAD values of a row tensor
(fewer in the norm backward, which keeps more tensors live), which keeps the kernels well under 128
registers a thread (ptxas -v, Triton 3.9): more warps for wider rows, up to 32 (1024 threads). A row
that would need more than that in one block is split into column chunks that the kernel loops over
(the ``*_chunked`` kernels): past SOFTMAX_SINGLE_BLOCK keys, NORM_FORWARD_SINGLE_BLOCK columns in
the norm forward and NORM_BACKWARD_SINGLE_BLOCK in the norm backward. Narrow rows are grouped
into tiles of several rows (ROW_TILE elements), so each program still moves a few KiB.

Registers a thread at these settings (ptxas -v of Triton 3.9, sm_80 / sm_90, bf16, LayerNorm with
weight and bias; ``python -m tests.fused_kernels.cuda_compile_check --all``: all 282 configurations
at most 66 registers, no spills, at least 24 warps an SM): norm forward 1x2048 tile, 8 warps: 55 / 40;
norm backward 1x2048, 16 warps: 60 / 60, 1x4096, 32 warps: 55 / 52; softmax 8192 keys, 32 warps:
32-40; the chunked kernels 29-56; bias_gelu backward 2x1024, 8 warps: 48 / 55. Before, at 16 warps,
the norm backward spilled at 8192 columns (16 bytes) and 16384 (836), the softmax at 32768 keys
(48-228 bytes even at 32 warps), and the norm backward at 4096 columns with 8 warps took 154 registers (one
program an SM).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.fused_kernels.triton_support import next_power_of_2

ELEMENTS_PER_THREAD = 8
NORM_BACKWARD_ELEMENTS_PER_THREAD = 4
MAX_WARPS = 32
ROW_TILE = 2048
"""Elements per program for narrow rows (several rows per program)."""
NORM_FORWARD_SINGLE_BLOCK = 8192
NORM_BACKWARD_SINGLE_BLOCK = 4096
SOFTMAX_SINGLE_BLOCK = 8192
CHUNK = 4096
"""Columns per loop step of the chunked row kernels."""
ELEMENTWISE_MAX_COLUMNS = 1024
ELEMENTWISE_MIN_COLUMNS = 16
"""bias_dropout_add splits a tile into four column quarters: at least 4 columns each."""
COLUMN_SUM_MAX_COLUMNS = 512
CROSS_ENTROPY_BLOCK = 4096
ELEMENTWISE_BLOCK = 1024
"""Elements per program of the flat elementwise kernels (swiglu)."""
CPU_PROGRAMS = 4
"""Programs of the persistent / column-group kernels under Triton's CPU interpreter."""


@dataclass(frozen=True)
class Blocks:
    """One launch's tile: ``block_m`` rows x ``block_n`` columns, ``num_warps`` warps; ``chunked``
    when the row is wider than ``block_n`` and the kernel loops over column chunks of that size."""

    block_m: int
    block_n: int
    num_warps: int
    chunked: bool = False


def warps_for(tile: int, per_thread: int = ELEMENTS_PER_THREAD) -> int:
    """Warps (a power of two in 4..32) so that each thread holds about ``per_thread`` of ``tile`` elements."""
    return min(MAX_WARPS, max(4, next_power_of_2(tile // (32 * per_thread))))


def _row_blocks(width: int, single_block: int, per_thread: int) -> Blocks:
    block_n = next_power_of_2(width)
    if block_n > single_block:
        return Blocks(1, CHUNK, warps_for(CHUNK, per_thread), chunked=True)
    block_m = max(1, ROW_TILE // block_n)
    return Blocks(block_m, block_n, warps_for(block_m * block_n, per_thread))


def norm_forward_blocks(width: int) -> Blocks:
    """LayerNorm / RMSNorm forward: whole rows in a tile, or chunks past NORM_FORWARD_SINGLE_BLOCK."""
    return _row_blocks(width, NORM_FORWARD_SINGLE_BLOCK, ELEMENTS_PER_THREAD)


def norm_backward_blocks(width: int) -> Blocks:
    """LayerNorm / RMSNorm backward (dx and, when not chunked, the weight/bias partials)."""
    return _row_blocks(width, NORM_BACKWARD_SINGLE_BLOCK, NORM_BACKWARD_ELEMENTS_PER_THREAD)


def column_sum_blocks(width: int) -> Blocks:
    """The chunked norm backward's weight/bias-gradient kernel: tiles of rows x a column block."""
    block_n = min(COLUMN_SUM_MAX_COLUMNS, next_power_of_2(width))
    block_m = ROW_TILE // block_n
    return Blocks(block_m, block_n, warps_for(block_m * block_n))


def softmax_blocks(seq_k: int) -> Blocks:
    """One row of attention scores per program; chunked past SOFTMAX_SINGLE_BLOCK keys."""
    block_n = next_power_of_2(seq_k)
    if block_n > SOFTMAX_SINGLE_BLOCK:
        return Blocks(1, CHUNK, warps_for(CHUNK), chunked=True)
    return Blocks(1, block_n, warps_for(block_n))


def elementwise_blocks(width: int) -> Blocks:
    """bias_gelu / bias_dropout_add tiles: rows x a column block of at most ELEMENTWISE_MAX_COLUMNS."""
    block_n = min(ELEMENTWISE_MAX_COLUMNS, max(ELEMENTWISE_MIN_COLUMNS, next_power_of_2(width)))
    block_m = ROW_TILE // block_n
    return Blocks(block_m, block_n, warps_for(block_m * block_n))


def cross_entropy_blocks(vocab: int) -> Blocks:
    """One token per program, looping over the vocabulary in blocks (an online log-sum-exp)."""
    block_n = min(CROSS_ENTROPY_BLOCK, next_power_of_2(vocab))
    return Blocks(1, block_n, warps_for(block_n, per_thread=16))


def elementwise_programs(n: int, block: int = ELEMENTWISE_BLOCK) -> int:
    """Number of programs covering n elements in blocks of ``block`` (swiglu)."""
    return (n + block - 1) // block


def resident_programs(device: torch.device, num_warps: int) -> int:
    """Programs of ``num_warps`` warps that keep the GPU busy at 32 warps an SM (the kernels here stay
    under 64 registers a thread, where 32 warps an SM fit); CPU_PROGRAMS under the interpreter."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count * max(1, MAX_WARPS // num_warps)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def row_groups(device: torch.device, rows: int, blocks: Blocks, column_blocks: int = 1) -> int:
    """How many row groups a persistent / column-group kernel splits ``rows`` into: enough programs
    (groups x column_blocks) to fill the GPU, never more groups than row tiles. Each group writes one
    row of fp32 partial sums, which the caller adds up."""
    tiles = cdiv(rows, blocks.block_m)
    return max(1, min(tiles, cdiv(resident_programs(device, blocks.num_warps), column_blocks)))


def partial_buffer(groups: int, width: int, wanted: bool, device: torch.device) -> torch.Tensor:
    """[groups, width] fp32 partial sums of a parameter's gradient (every group writes its row), or a
    one-element placeholder when the parameter does not exist."""
    return torch.empty((groups, width) if wanted else (1, 1), dtype=torch.float32, device=device)


def sum_partials(partial: torch.Tensor, rows: int, dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    """The parameter's gradient in ``dtype`` (None: no parameter): the fp32 partials summed, zeros when
    there were no rows (then no kernel wrote them)."""
    if dtype is None:
        return None
    if not rows:
        return torch.zeros(partial.shape[-1], dtype=dtype, device=partial.device)
    return partial.sum(0).to(dtype)
