"""GeLU(x + bias) for the MLP: ``approximate="tanh"`` is Megatron's fused bias-GeLU
(0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))), ``approximate="none"`` the exact erf GeLU
(what Hugging Face GPT-NeoX's "gelu" is). ``bias`` may be None (use_bias_in_mlp: false);
otherwise it has shape [width] and is added along the last dim.

Fused version: Triton forward and backward over [rows, width] tiles; the backward recomputes
x + bias from the saved inputs (no intermediate is stored) and sums dx over rows in fp32 as it
writes it (the bias gradient: per-group partials, then one small sum).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.launch_config import cdiv, elementwise_blocks, partial_buffer, row_groups, sum_partials
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "bias_gelu"
APPROXIMATIONS = ("tanh", "none")


def _check(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"{NAME}: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"{NAME}: bias must have shape ({x.shape[-1]},), got {tuple(bias.shape)}")


def bias_gelu_reference(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "tanh") -> torch.Tensor:
    """Pure PyTorch: F.gelu(x + bias, approximate=...)."""
    _check(x, bias, approximate)
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


class FusedBiasGelu(torch.autograd.Function):
    """Triton forward/backward; saves x and bias only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str) -> torch.Tensor:
        _check(x, bias, approximate)
        check_device(x, NAME)
        kernels = load_kernels("bias_gelu")
        x = x.contiguous()
        y = torch.empty_like(x)
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        blocks = elementwise_blocks(width)
        if rows:
            kernels.bias_gelu_forward[(cdiv(rows, blocks.block_m), cdiv(width, blocks.block_n))](
                x, x if bias is None else bias, y, rows, width, HAS_BIAS=bias is not None,
                EXACT=approximate == "none", BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                num_warps=blocks.num_warps,
            )
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, bias = ctx.saved_tensors
        kernels = load_kernels("bias_gelu")
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        blocks = elementwise_blocks(width)
        column_blocks = cdiv(width, blocks.block_n)
        groups = row_groups(x.device, rows, blocks, column_blocks)
        db_partial = partial_buffer(groups, width, bias is not None, x.device)
        if rows:
            kernels.bias_gelu_backward[(groups, column_blocks)](
                dy, x, x if bias is None else bias, dx, db_partial, rows, width, HAS_BIAS=bias is not None,
                EXACT=ctx.approximate == "none", BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n,
                num_warps=blocks.num_warps,
            )
        dbias = sum_partials(db_partial, rows, None if bias is None else bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "tanh") -> torch.Tensor:
    """Fused (Triton) bias-GeLU; same contract as the reference."""
    return FusedBiasGelu.apply(x, bias, approximate)
