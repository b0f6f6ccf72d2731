"""Rotary position embedding, rotate-half layout as in Hugging Face GPT-NeoX, applied to the
first ``rot_dim = cos.shape[-1]`` dims of each head (rotary_pct); the other dims pass through.

Layout: x is [batch, seq, heads, head_dim] (or [seq, batch, heads, head_dim] with
``seq_first=True``); cos and sin are [seq, rot_dim] tables for the positions of x (slice them
at the cache offset when decoding), as built by :func:`rotary_tables`:
``cos = cat(cos(p * f), cos(p * f))`` with ``f = base^(-2i/rot_dim)``. The rotation is computed
in fp32 and returned in x's dtype; cos and sin get no gradient.

Fused version: one Triton kernel per pass (the backward is the transposed rotation).
"""
from __future__ import annotations

import torch

from megatron.fused_kernels.triton_support import check_device, load_kernels, next_power_of_2

NAME = "rotary"


def rotary_tables(
    seq_len: int, rot_dim: int, base: float = 10000.0, offset: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables [seq_len, rot_dim] for positions offset .. offset + seq_len - 1."""
    if rot_dim % 2:
        raise ValueError(f"{NAME}: the rotary dimension must be even, got {rot_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    positions = torch.arange(offset, offset + seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_first: bool) -> int:
    if x.dim() != 4:
        raise ValueError(f"{NAME}: expected x [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    seq = x.shape[0] if seq_first else x.shape[1]
    rot_dim = cos.shape[-1]
    if cos.shape != sin.shape or tuple(cos.shape) != (seq, rot_dim):
        raise ValueError(
            f"{NAME}: cos and sin must both be [seq={seq}, rot_dim], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if rot_dim % 2 or rot_dim > x.shape[-1] or rot_dim == 0:
        raise ValueError(f"{NAME}: rot_dim must be even and in 2..head_dim ({x.shape[-1]}), got {rot_dim}")
    return rot_dim


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_first: bool = False) -> torch.Tensor:
    """Pure PyTorch: x_rot * cos + rotate_half(x_rot) * sin on the first rot_dim dims (fp32 math)."""
    rot_dim = _check(x, cos, sin, seq_first)
    view = (slice(None), None, None) if seq_first else (slice(None), None)
    c, s = cos.float()[view], sin.float()[view]
    rotated_part, passed = x.split([rot_dim, x.size(-1) - rot_dim], dim=-1)  # backward: a cat, not zero fills
    rotated_part = rotated_part.float()
    first, second = rotated_part.chunk(2, dim=-1)
    out = rotated_part * c + torch.cat((-second, first), dim=-1) * s
    return torch.cat((out.to(x.dtype), passed), dim=-1)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_first: bool, backward: bool) -> torch.Tensor:
    kernels = load_kernels("rotary")
    x = x.contiguous()
    y = torch.empty_like(x)
    if seq_first:
        seq, batch, heads, head_dim = x.shape
    else:
        batch, seq, heads, head_dim = x.shape
    rot_dim = cos.shape[-1]
    pass_width = head_dim - rot_dim
    rows = batch * seq * heads
    if rows and head_dim:
        kernels.rotary_kernel[(rows,)](
            x, cos, sin, y, batch, seq, heads, head_dim, rot_dim // 2, pass_width,
            SEQ_FIRST=seq_first, BACKWARD=backward, HAS_PASS=pass_width > 0,
            BLOCK_ROT=next_power_of_2(rot_dim // 2), BLOCK_PASS=next_power_of_2(max(pass_width, 1)),
        )
    return y


class FusedRotary(torch.autograd.Function):
    """Triton forward (rotation) and backward (transposed rotation); saves only cos and sin."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_first: bool) -> torch.Tensor:
        _check(x, cos, sin, seq_first)
        check_device(x, NAME)
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.seq_first = seq_first
        return _launch(x, cos, sin, seq_first, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, ctx.seq_first, backward=True), None, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_first: bool = False) -> torch.Tensor:
    """Fused (Triton) rotary embedding; same contract as the reference."""
    return FusedRotary.apply(x, cos, sin, seq_first)
