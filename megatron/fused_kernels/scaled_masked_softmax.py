"""Scaled softmax with an explicit boolean mask over attention scores.

Scores are [batch, heads, seq_q, seq_k]; the mask (True = hidden) broadcasts to them, e.g.
[batch, 1, seq_q, seq_k] or [1, 1, seq_q, seq_k], or is None. As in Megatron, hidden scores
are replaced by -10000 after scaling (not -inf), so a fully hidden row gives a uniform
distribution instead of NaN; hidden positions get no gradient. Computed in fp32, returned in
the input dtype.

Fused version: a Triton forward and backward kernel (one program per row) that reads the
mask through broadcast strides, so it is never expanded in memory; rows longer than one block
(e.g. 32k keys) take the chunked kernels (online softmax), see megatron.fused_kernels.launch_config.
"""
from __future__ import annotations

from typing import Optional

import torch

from megatron.fused_kernels.launch_config import softmax_blocks
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "scaled_masked_softmax"
MASK_FILL_VALUE = -10000.0


def _check(x: torch.Tensor, mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Validate shapes; return the mask expanded (as a stride-0 view) to x's shape."""
    if x.dim() != 4:
        raise ValueError(f"{NAME}: expected scores [batch, heads, seq_q, seq_k], got shape {tuple(x.shape)}")
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise ValueError(f"{NAME}: mask must be torch.bool (True = hidden), got {mask.dtype}")
    try:
        return mask.expand(x.shape)
    except RuntimeError as err:
        raise ValueError(f"{NAME}: mask of shape {tuple(mask.shape)} does not broadcast to {tuple(x.shape)}") from err


def scaled_masked_softmax_reference(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Pure PyTorch: softmax(masked_fill(scale * x, mask, -10000)) in fp32, cast back."""
    mask = _check(x, mask)
    scores = x.float() * scale
    if mask is not None:
        scores = scores.masked_fill(mask, MASK_FILL_VALUE)
    return torch.softmax(scores, dim=-1).to(x.dtype)


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Triton forward/backward; saves the softmax output and the (unexpanded) mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
        expanded = _check(x, mask)
        check_device(x, NAME)
        kernels = load_kernels("softmax")
        x = x.contiguous()
        y = torch.empty_like(x)
        _, heads, seq_q, seq_k = x.shape
        mask_arg, strides = _mask_argument(expanded, y)
        rows = x.numel() // seq_k if seq_k else 0
        blocks = softmax_blocks(seq_k)
        kernel = kernels.masked_softmax_forward_chunked if blocks.chunked else kernels.masked_softmax_forward
        if rows:
            kernel[(rows,)](
                x, mask_arg, y, float(scale), heads, seq_q, seq_k, *strides,
                FILL=MASK_FILL_VALUE, HAS_MASK=expanded is not None, BLOCK=blocks.block_n, num_warps=blocks.num_warps,
            )
        ctx.save_for_backward(y, mask)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, mask = ctx.saved_tensors
        kernels = load_kernels("softmax")
        expanded = None if mask is None else mask.expand(y.shape)
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        _, heads, seq_q, seq_k = y.shape
        mask_arg, strides = _mask_argument(expanded, y)
        rows = y.numel() // seq_k if seq_k else 0
        blocks = softmax_blocks(seq_k)
        kernel = kernels.softmax_backward_chunked if blocks.chunked else kernels.softmax_backward
        if rows:
            kernel[(rows,)](
                dy, y, dx, mask_arg, ctx.scale, heads, seq_q, seq_k, *strides,
                HAS_MASK=expanded is not None, BLOCK=blocks.block_n, num_warps=blocks.num_warps,
            )
        return dx, None, None


def _mask_argument(expanded: Optional[torch.Tensor], placeholder: torch.Tensor):
    """The mask as a byte view plus its 4 (possibly zero) strides; a placeholder when absent."""
    if expanded is None:
        return placeholder, (0, 0, 0, 0)
    as_bytes = expanded.view(torch.uint8)
    return as_bytes, tuple(as_bytes.stride())


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Fused (Triton) masked scaled softmax; same contract as the reference."""
    return ScaledMaskedSoftmax.apply(x, mask, scale)
