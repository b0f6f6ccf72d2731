"""Block-sparse attention layouts with DeepSpeed's sparsity-config semantics, applied as SDPA masks.

DeepSpeed's sparse attention (its Triton kernels) computes only the [block x block] tiles its layout marks,
and GPT-NeoX adds the causal mask inside them. Here the same layout is expanded to a boolean mask over
positions (tile (i, j) of head h allowed <=> a query in block i may see the keys of block j) and combined
with the causal / batch mask, so the layer runs on PyTorch SDPA on any device, with the numbers of
DeepSpeed's kernels (every layout keeps each block's diagonal tile, so no query row is empty).

Layouts (``make_layout``; [heads, blocks, blocks], all "unidirectional" as GPT-NeoX configures them):
  * sparse_fixed (FixedSparsityConfig): the sequence in windows of num_local_blocks; each block sees the
    earlier blocks of its window; the last num_global_blocks of every window (with different_layout_per_head,
    head h uses the (h % num_different_global_patterns)-th group from the end) are seen by every later block,
    and a trailing partial window has one such group too.
  * sparse_variable (VariableSparsityConfig): num_random_blocks random key blocks per row (drawn from all
    blocks), local windows of local_window_blocks[0], [1], ... (the last size repeats), global key blocks
    global_block_indices (or [start, end) ranges with global_block_end_indices) seen by every later block.
  * bigbird (BigBirdSparsityConfig): num_random_blocks random earlier blocks per row, a sliding window of
    num_sliding_window_blocks centred on the row, the first num_global_blocks rows and columns; lower triangle.
  * bslongformer (BSLongformerSparsityConfig): the sliding window plus global rows and columns at
    global_block_indices (or ranges); lower triangle.

Random blocks come from a ``random.Random`` seeded with the model seed and the layer number (DeepSpeed draws
from the process's global ``random``), so every rank builds the same layout. The layout is built for all
heads and each tensor-parallel rank takes its heads' rows, so TP=2 computes what TP=1 does. The layout spans
seq_length (DeepSpeed's max_seq_length): shorter sequences use its top-left corner; positions beyond it
(decoding past seq_length) are refused.
"""
from __future__ import annotations

import random

import torch

from megatron.model.sparsity_config import SparsitySettings


def _local_windows(layout: torch.Tensor, h: int, start: int, size: int) -> None:
    """Causal windows of ``size`` blocks from block ``start`` on (each block sees its window's earlier blocks)."""
    blocks = layout.size(1)
    for i in range(start, blocks, size):
        end = min(i + size, blocks)
        layout[h, i:end, i:end] |= torch.ones(end - i, end - i, dtype=torch.bool).tril()


def _fixed(s: SparsitySettings, layout: torch.Tensor, h: int) -> None:
    blocks, local, width = layout.size(1), s.num_local_blocks, s.num_global_blocks
    _local_windows(layout, h, 0, local)
    first = local - (1 + h % s.num_different_global_patterns) * width
    whole = blocks - blocks % local
    for i in range(first, whole, local):
        layout[h, i:, i:i + width] = True
    if whole < blocks:  # the trailing partial window's global group
        start = min(whole + first, blocks - width)
        layout[h, start:, start:start + width] = True


def _random(s: SparsitySettings, layout: torch.Tensor, h: int, rng: random.Random, causal_draw: bool) -> None:
    """num_random_blocks random key blocks per row, drawn from all blocks or (causal_draw) from blocks <= row;
    a row with fewer earlier blocks than that takes them all (where DeepSpeed's random.sample would raise)."""
    blocks = layout.size(1)
    for row in range(blocks):
        population = range(row + 1) if causal_draw else range(blocks)
        layout[h, row, rng.sample(population, min(s.num_random_blocks, len(population)))] = True


def _global_ranges(s: SparsitySettings, blocks: int):
    ends = s.global_block_end_indices or tuple(i + 1 for i in s.global_block_indices)
    return [(a, min(b, blocks)) for a, b in zip(s.global_block_indices, ends) if a < blocks]


def _variable(s: SparsitySettings, layout: torch.Tensor, h: int, rng: random.Random) -> None:
    blocks = layout.size(1)
    _random(s, layout, h, rng, causal_draw=False)
    start = 0
    for size in s.local_window_blocks:
        end = min(start + size, blocks)
        if end > start:
            layout[h, start:end, start:end] |= torch.ones(end - start, end - start, dtype=torch.bool).tril()
        start += size
    _local_windows(layout, h, start, s.local_window_blocks[-1])
    for a, b in _global_ranges(s, blocks):
        layout[h, a:, a:b] = True


def _sliding(s: SparsitySettings, layout: torch.Tensor, h: int) -> None:
    blocks, w = layout.size(1), s.num_sliding_window_blocks // 2
    rows = torch.arange(blocks)
    layout[h] |= (rows.unsqueeze(1) - rows.unsqueeze(0)).abs() <= w


def _bigbird(s: SparsitySettings, layout: torch.Tensor, h: int, rng: random.Random) -> None:
    _random(s, layout, h, rng, causal_draw=True)
    _sliding(s, layout, h)
    layout[h, :s.num_global_blocks, :] = True
    layout[h, :, :s.num_global_blocks] = True


def _bslongformer(s: SparsitySettings, layout: torch.Tensor, h: int) -> None:
    _sliding(s, layout, h)
    for a, b in _global_ranges(s, layout.size(1)):
        layout[h, a:b, :] = True
        layout[h, :, a:b] = True


def make_layout(settings: SparsitySettings, num_heads: int, seq_length: int, seed: int) -> torch.Tensor:
    """The [num_heads, blocks, blocks] boolean layout of ``settings`` over ``seq_length`` (a multiple of the
    block); one head's layout copied to all unless different_layout_per_head."""
    blocks = seq_length // settings.block
    layout_heads = num_heads if settings.different_layout_per_head else 1
    layout = torch.zeros(num_heads, blocks, blocks, dtype=torch.bool)
    rng = random.Random(seed)
    for h in range(layout_heads):
        if settings.kind == "sparse_fixed":
            _fixed(settings, layout, h)
        elif settings.kind == "sparse_variable":
            _variable(settings, layout, h, rng)
        elif settings.kind == "bigbird":
            _bigbird(settings, layout, h, rng)
        elif settings.kind == "bslongformer":
            _bslongformer(settings, layout, h)
        else:
            raise ValueError(f"no block-sparse layout for attention type {settings.kind!r}")
    if settings.kind in ("bigbird", "bslongformer"):
        layout = layout.tril()
    if layout_heads == 1:
        layout[1:] = layout[0]
    return layout


class BlockSparseMask:
    """This rank's heads' layout, expanded to a position mask on demand: ``allowed(q_pos, k_pos)`` is
    [heads or 1, q, k], True where a query may see a key (before the causal mask)."""

    def __init__(self, settings: SparsitySettings, num_heads: int, seq_length: int, seed: int,
                 first_head: int, local_heads: int) -> None:
        layout = make_layout(settings, num_heads, seq_length, seed)[first_head:first_head + local_heads]
        self.per_head = settings.different_layout_per_head
        self.layout = layout if self.per_head else layout[:1]
        self.block, self.seq_length = settings.block, seq_length

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        last = int(max(q_pos.max(), k_pos.max())) if q_pos.numel() and k_pos.numel() else 0
        if last >= self.seq_length:
            raise ValueError(f"a block-sparse layer's layout spans seq_length={self.seq_length} positions (as "
                             f"DeepSpeed's max_seq_length); position {last} is beyond it: generate at most "
                             f"seq_length tokens in all")
        if self.layout.device != q_pos.device:
            self.layout = self.layout.to(q_pos.device)
        qb = torch.div(q_pos, self.block, rounding_mode="floor")
        kb = torch.div(k_pos, self.block, rounding_mode="floor")
        return self.layout[:, qb.unsqueeze(-1), kb.unsqueeze(0)]


def layer_seed(seed: int, layer_number: int) -> int:
    """The random-block seed of a layer: the model seed and the layer number (every rank draws the same)."""
    return seed * 1_000_003 + layer_number
