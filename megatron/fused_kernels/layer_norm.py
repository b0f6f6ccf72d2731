"""LayerNorm over the last dimension, with optional weight and bias (use_bias_in_norms).

Fused version: Triton forward (one program per row, fp32 statistics) and backward (dx per row,
weight/bias gradients accumulated per program in registers then summed), shared with RMSNorm
in :mod:`megatron.fused_kernels.norm_launch`. PyTorch's own F.layer_norm is the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels.norm_launch import FusedNorm

NAME = "layer_norm"


def layer_norm_reference(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5
) -> torch.Tensor:
    """Pure PyTorch: F.layer_norm over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float = 1e-5
) -> torch.Tensor:
    """Fused (Triton) LayerNorm; same contract as the reference."""
    return FusedNorm.apply(x, weight, bias, eps, False, NAME)
