"""residual + dropout(x + bias, p) for the end of each attention / MLP block (bias_dropout_fusion).

``bias`` may be None; otherwise shape [width], added along the last dim. With
``training=False`` or ``p == 0`` no element is dropped.

Fused version: Triton forward and backward. The dropout mask is Philox randomness keyed by a
seed drawn from torch's generator on x's device (so torch.manual_seed and the model-parallel
RNG tracker govern it) and by the element index; the backward regenerates the mask from the
seed, so neither the mask nor x + bias is stored. The mask is therefore not the one
torch.nn.functional.dropout would draw: compare with the reference through ``keep_mask``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.triton_support import ELEMENTWISE_BLOCK, check_device, elementwise_programs, load_kernels

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
        n = x.numel()
        if n:
            kernels.bias_dropout_add_forward[(elementwise_programs(n),)](
                x, x if bias is None else bias, residual, y, seed, n, x.shape[-1], float(p), scale,
                HAS_BIAS=bias is not None, DROPOUT=dropout, BLOCK=ELEMENTWISE_BLOCK,
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
        if ctx.dropout:
            kernels = load_kernels("bias_dropout_add")
            dx = torch.empty(dy.shape, dtype=ctx.x_dtype, device=dy.device)
            n = dy.numel()
            if n:
                kernels.dropout_backward[(elementwise_programs(n),)](
                    dy, dx, seed, n, ctx.p, ctx.scale, BLOCK=ELEMENTWISE_BLOCK
                )
        else:
            dx = dy.to(ctx.x_dtype)
        dbias = dx.reshape(-1, dx.shape[-1]).float().sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx, dbias, dy.to(ctx.residual_dtype), None, None


def bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float, training: bool = True
) -> torch.Tensor:
    """Fused (Triton) residual + dropout(x + bias); same contract as the reference (own RNG stream)."""
    return FusedBiasDropoutAdd.apply(x, bias, residual, p, training)
