"""Normalisation layers (layernorm, non_parametric_layernorm, rmsnorm, scalenorm) on PyTorch's own kernels, or with
layernorm_fusion / rmsnorm_fusion on what megatron.fused_kernels picks for the flag (``norm_fn``, chosen by
:func:`build_norm`: on CUDA PyTorch's fused F.layer_norm / F.rms_norm while they measure faster than the Triton
kernels).

``grad_reduce_group``: when the norm runs on sequence-sharded activations (sequence parallelism) or on
a rank's own heads (QK layernorm under tensor parallelism) each rank sees part of the data, so the
replicated weights pass through ``copy_to_model_parallel_region`` and their gradients are summed.

Parameter names are GPT-NeoX's, so checkpoints hold the same keys: LayerNorm ``weight`` / ``bias``
(torch.nn.LayerNorm's), RMSNorm ``scale`` / ``offset`` (GPT-NeoX's RMSNorm), ScaleNorm ``g``. (GPT-NeoX's
RMSNorm never has an offset and its LayerNorm always has a bias, whatever use_bias_in_norms says; how such
checkpoints load is megatron.model.checkpoint_layout's.)
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from megatron.fused_kernels import layer_norm_reference, rms_norm_reference
from megatron.model.config import ModelConfig
from megatron.model.fused import model_fused_ops
from megatron.mpu.collectives import copy_to_model_parallel_region

# norm_fn(x, weight | None, bias | None, eps) over the last dimension (megatron.fused_kernels' contract).
NormFn = Callable[[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], float], torch.Tensor]


def _shared(param: Optional[torch.Tensor], group) -> Optional[torch.Tensor]:
    if param is None or group is None:
        return param
    return copy_to_model_parallel_region(param, group)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias: F.layer_norm, or the fused kernel passed as ``norm_fn``."""

    def __init__(self, dim: int, eps: float, bias: bool = True, grad_reduce_group=None,
                 norm_fn: NormFn = layer_norm_reference) -> None:
        super().__init__()
        self.eps, self.group, self.norm_fn = eps, grad_reduce_group, norm_fn
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, _shared(self.weight, self.group), _shared(self.bias, self.group), self.eps)


class NonParametricLayerNorm(nn.Module):
    """LayerNorm with no learnable weight or bias (GPT-NeoX's norm 'non_parametric_layernorm', its PR #1338:
    torch.nn.LayerNorm with elementwise_affine=False; OLMo's LayerNorm): it has no parameters, so nothing to
    share across ranks and nothing in checkpoints."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_reference(x, None, None, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm (``scale``) plus an optional bias (``offset``, use_bias_in_norms): F.rms_norm, or the fused
    kernel passed as ``norm_fn``."""

    def __init__(self, dim: int, eps: float, bias: bool = True, grad_reduce_group=None,
                 norm_fn: NormFn = rms_norm_reference) -> None:
        super().__init__()
        self.eps, self.group, self.norm_fn = eps, grad_reduce_group, norm_fn
        self.scale = nn.Parameter(torch.ones(dim))
        self.offset = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_fn(x, _shared(self.scale, self.group), _shared(self.offset, self.group), self.eps)


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


def build_norm(config: ModelConfig, dim: int, grad_reduce_group=None) -> nn.Module:
    """The norm selected by ``config.norm`` with its epsilon and ``use_bias_in_norms``, fused when
    layernorm_fusion / rmsnorm_fusion is on."""
    if config.norm == "layernorm":
        return LayerNorm(dim, config.norm_epsilon, config.use_bias_in_norms, grad_reduce_group,
                         model_fused_ops(config).layer_norm)
    if config.norm == "non_parametric_layernorm":
        return NonParametricLayerNorm(dim, config.norm_epsilon)
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.norm_epsilon, config.use_bias_in_norms, grad_reduce_group,
                       model_fused_ops(config).rms_norm)
    if config.norm == "scalenorm":
        return ScaleNorm(dim, config.norm_epsilon, config.use_bias_in_norms, grad_reduce_group)
    raise ValueError(f"norm={config.norm!r} is not supported; choose layernorm, non_parametric_layernorm, rmsnorm or "
                     f"scalenorm")
