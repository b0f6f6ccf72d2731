"""residual + dropout(x + bias, p) for the end of each attention / MLP block (bias_dropout_fusion).

``bias`` may be None; otherwise shape [width], added along the last dim. With
``training=False`` or ``p == 0`` no element is dropped.

Fused version: Triton forward and backward over [rows, width] tiles. The dropout mask is Philox
randomness keyed by a seed drawn from torch's generator on x's device (so torch.manual_seed and
the model-parallel RNG tracker govern it) and by the element's place in its tile (one Philox call
per four elements); the backward regenerates the mask from the seed, so neither the mask nor
x + bias is stored, and sums dx over rows as it writes it (the bias gradient). Without dropout the
backward runs no kernel of its own: dx is dy and the bias gradient one fp32-accumulated sum. The
mask is not the one torch.nn.functional.dropout would draw: compare with the reference through
``keep_mask``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.launch_config import cdiv, elementwise_blocks, partial_buffer, row_groups, sum_partials
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "bias_dropout_add"
_MAX_ELEMENTS = 2**31 - 1


def _check(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{NAME}: dropout probability must be in [0, 1], got {p}")
    if residual.shape != x.shape:
        raise ValueError(f"{NAME}: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"{NAME}: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    p: float,
    training: bool = True,
    keep_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pure PyTorch: residual + F.dropout(x + bias, p, training).

    ``keep_mask`` (bool, x's shape) replaces torch's random draw, to check another
    implementation's output for a known mask: residual + (x + bias) * keep / (1 - p).
    """
    _check(x, bias, residual, p)
    value = x if bias is None else x + bias
    if keep_mask is None:
        return residual + F.dropout(value, p=p, training=training)
    if not training or p == 0.0:
        return residual + value
    scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
    return residual + value * keep_mask.to(value.dtype) * scale


class FusedBiasDropoutAdd(torch.autograd.Function):
    """Triton forward/backward; saves only the seed (a one-element tensor)."""

    @staticmethod
    def forward(ctx, x, bias, residual, p: float, training: bool):
        _check(x, bias, residual, p)
        check_device(x, NAME)
        if x.numel() > _MAX_ELEMENTS:
            raise ValueError(f"{NAME}: tensors of more than {_MAX_ELEMENTS} elements are not supported")
        kernels = load_kernels("bias_dropout_add")
        x, residual = x.contiguous(), residual.contiguous()
        out_dtype = torch.promote_types(x.dtype, residual.dtype)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        dropout = training and p > 0.0
        # Draw from torch's generator only when dropping, so eval steps leave the RNG stream untouched.
        if dropout:
            seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=x.device)
        else:
            seed = torch.zeros(1, dtype=torch.int32, device=x.device)
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        blocks = elementwise_blocks(width)
        if rows:
            kernels.bias_dropout_add_forward[(cdiv(rows, blocks.block_m), cdiv(width, blocks.block_n))](
                x, x if bias is None else bias, residual, y, seed, rows, width, float(p), scale,
                HAS_BIAS=bias is not None, DROPOUT=dropout, BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                num_warps=blocks.num_warps,
            )
        ctx.save_for_backward(seed)
        ctx.dropout, ctx.p, ctx.scale = dropout, float(p), scale
        ctx.x_dtype, ctx.residual_dtype = x.dtype, residual.dtype
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (seed,) = ctx.saved_tensors
        dy = dy.contiguous()
        width = dy.shape[-1]
        rows = dy.numel() // width if width else 0
        if not ctx.dropout:
            dx = dy.to(ctx.x_dtype)
            dbias = dy.reshape(rows, width).sum(0, dtype=torch.float32).to(ctx.bias_dtype) if ctx.has_bias else None
            return dx, dbias, dy.to(ctx.residual_dtype), None, None
        kernels = load_kernels("bias_dropout_add")
        dx = torch.empty(dy.shape, dtype=ctx.x_dtype, device=dy.device)
        blocks = elementwise_blocks(width)
        column_blocks = cdiv(width, blocks.block_n)
        groups = row_groups(dy.device, rows, blocks, column_blocks)
        db_partial = partial_buffer(groups, width, ctx.has_bias, dy.device)
        if rows:
            kernels.dropout_backward[(groups, column_blocks)](
                dy, dx, seed, db_partial, rows, width, ctx.p, ctx.scale, HAS_BIAS=ctx.has_bias,
                BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps,
            )
        dbias = sum_partials(db_partial, rows, ctx.bias_dtype)
        return dx, dbias, dy.to(ctx.residual_dtype), None, None


def bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float, training: bool = True
) -> torch.Tensor:
    """Fused (Triton) residual + dropout(x + bias); same contract as the reference (own RNG stream)."""
    return FusedBiasDropoutAdd.apply(x, bias, residual, p, training)
