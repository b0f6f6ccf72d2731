"""SwiGLU gate: silu(gate) * up (flash-attn's ``swiglu(x, y) = silu(x) * y``; use_flashattn_swiglu).

``gate`` and ``up`` have the same shape; they may be non-contiguous row views such as the two
halves of ``h.chunk(2, dim=-1)`` (GPT-NeoX's SwiGLU activation takes ``up, gate = h.chunk(2, -1)``)
as long as the last dim is contiguous, and are then read in place.

Fused version: Triton forward and backward (the backward recomputes silu and writes both grads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused_kernels.launch_config import ELEMENTWISE_BLOCK, elementwise_programs
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "swiglu"


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"{NAME}: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} "
            f"must have the same shape and dtype"
        )


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure PyTorch: F.silu(gate) * up."""
    _check(gate, up)
    return F.silu(gate) * up


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A [rows, width] view with a contiguous last dim, and its row stride (copies only if needed)."""
    width = t.shape[-1]
    rows = t.reshape(-1, width) if t.dim() != 2 else t
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < width):
        rows = rows.contiguous()
    return rows, rows.stride(0)


class FusedSwiGLU(torch.autograd.Function):
    """Triton forward/backward; saves gate and up (as given, without copies where possible)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        _check(gate, up)
        check_device(gate, NAME)
        kernels = load_kernels("swiglu")
        g_rows, g_stride = _as_rows(gate)
        u_rows, u_stride = _as_rows(up)
        y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        n = gate.numel()
        if n:
            kernels.swiglu_forward[(elementwise_programs(n),)](
                g_rows, u_rows, y, n, gate.shape[-1], g_stride, u_stride, BLOCK=ELEMENTWISE_BLOCK
            )
        ctx.save_for_backward(g_rows, u_rows)
        ctx.shape = gate.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g_rows, u_rows = ctx.saved_tensors
        kernels = load_kernels("swiglu")
        dy = dy.contiguous()
        dgate = torch.empty(ctx.shape, dtype=g_rows.dtype, device=dy.device)
        dup = torch.empty(ctx.shape, dtype=u_rows.dtype, device=dy.device)
        n = dy.numel()
        if n:
            kernels.swiglu_backward[(elementwise_programs(n),)](
                dy, g_rows, u_rows, dgate, dup, n, ctx.shape[-1], g_rows.stride(0), u_rows.stride(0),
                BLOCK=ELEMENTWISE_BLOCK,
            )
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused (Triton) SwiGLU; same contract as the reference."""
    return FusedSwiGLU.apply(gate, up)
