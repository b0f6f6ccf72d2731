"""Shared autograd plumbing for the Triton LayerNorm and RMSNorm (one kernel family, IS_RMS).

Which kernels run is decided by the row width (:mod:`megatron.fused_kernels.launch_config`): rows
that fit one block take the single-pass kernels (forward: tiles of whole rows; backward: persistent
programs that also sum the weight/bias gradients), wider rows the chunked ones (forward in two
passes over the row; backward dx per row, then a column-sum kernel for the weight/bias gradients).
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.fused_kernels.launch_config import (
    cdiv,
    column_sum_blocks,
    norm_backward_blocks,
    norm_forward_blocks,
    partial_buffer,
    row_groups,
    sum_partials,
)
from megatron.fused_kernels.triton_support import check_device, load_kernels


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
        blocks = norm_forward_blocks(width)
        args = (x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd)
        flags = dict(IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                     num_warps=blocks.num_warps)
        if rows and blocks.chunked:
            kernels.norm_forward_chunked[(rows,)](*args, width, float(eps), BLOCK_N=blocks.block_n, **flags)
        elif rows:
            kernels.norm_forward[(cdiv(rows, blocks.block_m),)](
                *args, rows, width, float(eps), BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, **flags
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
        w = x if weight is None else weight
        flags = dict(IS_RMS=ctx.is_rms, HAS_WEIGHT=weight is not None)
        blocks = norm_backward_blocks(width)
        if blocks.chunked:  # dx row by row, then the weight/bias gradients by column blocks
            sums = column_sum_blocks(width)
            column_blocks = cdiv(width, sums.block_n)
            groups = row_groups(x.device, rows, sums, column_blocks)
        else:  # one persistent pass: dx and the weight/bias partials of each program's rows
            groups = row_groups(x.device, rows, blocks)
        dw_partial = partial_buffer(groups, width, weight is not None, x.device)
        db_partial = partial_buffer(groups, width, bias is not None, x.device)
        if rows and blocks.chunked:
            kernels.norm_backward_dx_chunked[(rows,)](
                dy, x, w, mean, rstd, dx, width, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps, **flags
            )
            if weight is not None or bias is not None:
                kernels.norm_backward_dwdb[(groups, column_blocks)](
                    dy, x, mean, rstd, dw_partial, db_partial, rows, width, HAS_BIAS=bias is not None,
                    BLOCK_M=sums.block_m, BLOCK_N=sums.block_n, num_warps=sums.num_warps, **flags
                )
        elif rows:
            kernels.norm_backward[(groups,)](
                dy, x, w, mean, rstd, dx, dw_partial, db_partial, rows, width, HAS_BIAS=bias is not None,
                BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, num_warps=blocks.num_warps, **flags
            )
        dweight = sum_partials(dw_partial, rows, None if weight is None else weight.dtype)
        dbias = sum_partials(db_partial, rows, None if bias is None else bias.dtype)
        return dx, dweight, dbias, None, None, None
