"""RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * weight (+ bias), the
semantics of torch.nn.functional.rms_norm (eps inside the square root), with the optional
bias of use_bias_in_norms.

Fused version: Triton forward and backward shared with LayerNorm
(:mod:`megatron.fused_kernels.norm_launch`, IS_RMS=True).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.norm_launch import FusedNorm

NAME = "rms_norm"


def rms_norm_reference(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None, eps: float = 1e-8
) -> torch.Tensor:
    """Pure PyTorch: F.rms_norm over the last dimension plus the optional bias."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return y if bias is None else y + bias


def rms_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor] = None, eps: float = 1e-8
) -> torch.Tensor:
    """Fused (Triton) RMSNorm; same contract as the reference."""
    return FusedNorm.apply(x, weight, bias, eps, True, NAME)
