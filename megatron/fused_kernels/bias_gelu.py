"""GeLU(x + bias) for the MLP: ``approximate="tanh"`` is Megatron's fused bias-GeLU
(0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))), ``approximate="none"`` the exact erf GeLU
(what Hugging Face GPT-NeoX's "gelu" is). ``bias`` may be None (use_bias_in_mlp: false);
otherwise it has shape [width] and is added along the last dim.

Fused version: Triton forward and backward; the backward recomputes x + bias from the saved
inputs (no intermediate is stored) and the bias gradient is the fp32 row sum of dx.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.triton_support import ELEMENTWISE_BLOCK, check_device, elementwise_programs, load_kernels

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
        n = x.numel()
        if n:
            kernels.bias_gelu_forward[(elementwise_programs(n),)](
                x, x if bias is None else bias, y, n, x.shape[-1],
                HAS_BIAS=bias is not None, EXACT=approximate == "none", BLOCK=ELEMENTWISE_BLOCK,
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
        n = x.numel()
        if n:
            kernels.bias_gelu_backward[(elementwise_programs(n),)](
                dy, x, x if bias is None else bias, dx, n, x.shape[-1],
                HAS_BIAS=bias is not None, EXACT=ctx.approximate == "none", BLOCK=ELEMENTWISE_BLOCK,
            )
        dbias = None if bias is None else dx.reshape(-1, x.shape[-1]).float().sum(0).to(bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor], approximate: str = "tanh") -> torch.Tensor:
    """Fused (Triton) bias-GeLU; same contract as the reference."""
    return FusedBiasGelu.apply(x, bias, approximate)
