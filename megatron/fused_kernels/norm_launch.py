"""Shared autograd plumbing for the fused LayerNorm and RMSNorm (one Triton kernel pair, IS_RMS)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron.fused_kernels.triton_support import check_device, load_kernels, next_power_of_2, row_warps


def _backward_programs(rows: int, device: torch.device) -> int:
    """Enough programs to fill the GPU, few enough that the partial-gradient buffers stay small."""
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


def _check(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], name: str) -> None:
    width = x.shape[-1]
    for label, param in (("weight", weight), ("bias", bias)):
        if param is not None and tuple(param.shape) != (width,):
            raise ValueError(f"{name}: {label} must have shape ({width},), got {tuple(param.shape)}")


class FusedNorm(torch.autograd.Function):
    """y = norm(x) * weight + bias over the last dim; LayerNorm or RMSNorm by ``is_rms``."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, is_rms: bool, name: str):
        _check(x, weight, bias, name)
        check_device(x, name)
        kernels = load_kernels("norms")
        x = x.contiguous()
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        y = torch.empty_like(x)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = next_power_of_2(width)
        if rows:
            kernels.norm_forward[(rows,)](
                x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd, width, float(eps),
                IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                BLOCK=block, num_warps=row_warps(block),
            )
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.is_rms = is_rms
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        kernels = load_kernels("norms")
        dy = dy.contiguous()
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        dx = torch.empty_like(x)
        programs = _backward_programs(rows, x.device)
        dw_partial = torch.zeros(programs, width, dtype=torch.float32, device=x.device)
        db_partial = torch.zeros(programs, width, dtype=torch.float32, device=x.device)
        block = next_power_of_2(width)
        if rows:
            kernels.norm_backward[(programs,)](
                dy, x, x if weight is None else weight, mean, rstd, dx, dw_partial, db_partial, rows, width,
                IS_RMS=ctx.is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                BLOCK=block, num_warps=row_warps(block),
            )
        dweight = None if weight is None else dw_partial.sum(0).to(weight.dtype)
        dbias = None if bias is None else db_partial.sum(0).to(bias.dtype)
        return dx, dweight, dbias, None, None, None
