"""Normalisation layers (layernorm, rmsnorm, scalenorm) on PyTorch's own kernels.

``grad_reduce_group``: when the norm runs on sequence-sharded activations (sequence parallelism) or on
a rank's own heads (QK layernorm under tensor parallelism) each rank sees part of the data, so the
replicated weights pass through ``copy_to_model_parallel_region`` and their gradients are summed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron.mpu.collectives import copy_to_model_parallel_region


def _shared(param: Optional[torch.Tensor], group) -> Optional[torch.Tensor]:
    if param is None or group is None:
        return param
    return copy_to_model_parallel_region(param, group)


class LayerNorm(nn.Module):
    """F.layer_norm with an optional bias."""

    def __init__(self, dim: int, eps: float, bias: bool = True, grad_reduce_group=None) -> None:
        super().__init__()
        self.eps, self.group = eps, grad_reduce_group
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.size(-1),), _shared(self.weight, self.group), _shared(self.bias, self.group),
                            self.eps)


class RMSNorm(nn.Module):
    """F.rms_norm, plus an optional bias (use_bias_in_norms, as GPT-NeoX)."""

    def __init__(self, dim: int, eps: float, bias: bool = True, grad_reduce_group=None) -> None:
        super().__init__()
        self.eps, self.group = eps, grad_reduce_group
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x, (x.size(-1),), _shared(self.weight, self.group), self.eps)
        bias = _shared(self.bias, self.group)
        return out if bias is None else out + bias


class ScaleNorm(nn.Module):
    """x / max(||x||, eps) * g with one learned scalar g (Nguyen & Salazar, 2019). It has no bias, so
    use_bias_in_norms does not apply to it."""

    def __init__(self, dim: int, eps: float, bias: bool = True, grad_reduce_group=None) -> None:
        super().__init__()
        self.eps, self.group = eps, grad_reduce_group
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=self.eps)
        return x / norm * _shared(self.g, self.group)


def build_norm(neox_args, dim: int, grad_reduce_group=None) -> nn.Module:
    """The norm selected by ``neox_args.norm`` with its epsilon and ``use_bias_in_norms``."""
    kind = getattr(neox_args, "norm", "layernorm") or "layernorm"
    bias = bool(getattr(neox_args, "use_bias_in_norms", True))
    if kind == "layernorm":
        return LayerNorm(dim, float(getattr(neox_args, "layernorm_epsilon", 1e-5)), bias, grad_reduce_group)
    if kind == "rmsnorm":
        return RMSNorm(dim, float(getattr(neox_args, "rms_norm_epsilon", 1e-8)), bias, grad_reduce_group)
    if kind == "scalenorm":
        return ScaleNorm(dim, float(getattr(neox_args, "scalenorm_epsilon", 1e-8)), bias, grad_reduce_group)
    if kind in ("te_layernorm", "te_rmsnorm"):
        raise ValueError(f"norm={kind!r} needs transformer-engine, which is not supported yet; "
                         "use 'layernorm' or 'rmsnorm'")
    raise ValueError(f"norm={kind!r} is not supported; choose layernorm, rmsnorm or scalenorm")
