"""Causal (upper-triangular masked) scaled softmax over attention scores.

Input scores are [..., seq_q, seq_k] with seq_q <= seq_k; query i sees keys
j <= i + (seq_k - seq_q), i.e. the causal mask is aligned to the last key, which is what
incremental decoding with a KV cache needs (seq_q == seq_k is the training case).
The softmax is computed in fp32 and returned in the input dtype.

Fused version: a Triton forward and backward kernel (one program per row), so the masked,
scaled fp32 scores never exist in memory; rows longer than one block (e.g. 32k keys) take the
chunked kernels (online softmax), see megatron.fused_kernels.launch_config.
"""
from __future__ import annotations

import torch

from megatron.fused_kernels.launch_config import softmax_blocks
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "scaled_upper_triang_masked_softmax"


def _check_shape(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() < 2:
        raise ValueError(f"{NAME}: expected scores [..., seq_q, seq_k], got shape {tuple(x.shape)}")
    seq_q, seq_k = x.shape[-2], x.shape[-1]
    if seq_q > seq_k:
        raise ValueError(f"{NAME}: seq_q ({seq_q}) must not exceed seq_k ({seq_k})")
    return seq_q, seq_k


def scaled_upper_triang_masked_softmax_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Pure PyTorch: softmax(scale * x) with future keys masked out, in fp32, cast back."""
    seq_q, seq_k = _check_shape(x)
    future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=x.device).triu(diagonal=seq_k - seq_q + 1)
    scores = (x.float() * scale).masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Triton forward/backward; saves only the softmax output for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        seq_q, seq_k = _check_shape(x)
        check_device(x, NAME)
        kernels = load_kernels("softmax")
        x = x.contiguous()
        y = torch.empty_like(x)
        rows = x.numel() // seq_k if seq_k else 0
        blocks = softmax_blocks(seq_k)
        kernel = kernels.causal_softmax_forward_chunked if blocks.chunked else kernels.causal_softmax_forward
        if rows:
            kernel[(rows,)](x, y, float(scale), seq_q, seq_k, BLOCK=blocks.block_n, num_warps=blocks.num_warps)
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        kernels = load_kernels("softmax")
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        seq_k = y.shape[-1]
        rows = y.numel() // seq_k if seq_k else 0
        blocks = softmax_blocks(seq_k)
        kernel = kernels.softmax_backward_chunked if blocks.chunked else kernels.softmax_backward
        if rows:
            kernel[(rows,)](
                dy, y, dx, y, ctx.scale, 1, 1, seq_k, 0, 0, 0, 0,
                HAS_MASK=False, BLOCK=blocks.block_n, num_warps=blocks.num_warps,
            )
        return dx, None


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused (Triton) causal scaled softmax; same contract as the reference."""
    return ScaledUpperTriangMaskedSoftmax.apply(x, scale)
