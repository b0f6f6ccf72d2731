"""The fused-kernel choice for the model: which op implementations its layers call, by fusion flag.

Every layer asks :func:`model_fused_ops` for a :class:`~megatron.fused_kernels.FusedOps`; a flag that is
off gives the pure-PyTorch reference, so the unfused model never imports triton. Flags that are on but
cannot run here (no triton, or no GPU without TRITON_INTERPRET=1), or that name an op this model does not
contain (e.g. rope_fusion without rotary embeddings), raise one ConfigError naming the flag and the fix,
when the model is built rather than at the first forward.

Bias fusion (bias_gelu_fusion, bias_dropout_fusion) needs the linear layer's output *before* its bias;
:func:`column_parallel_no_bias` and :func:`row_parallel_no_bias` run the tensor-parallel linears that
way and hand the bias over to the fused op, with the same collectives as the layers' own forward.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.fused_kernels import FusedOps
from megatron.mpu import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_model_parallel_region,
)
from megatron.neox_arguments.validation import SOFTMAX_FUSION_FLAGS, fusion_flag_problems
from megatron.neox_arguments.errors import ConfigError

SOFTMAX_FLAGS = SOFTMAX_FUSION_FLAGS


def _on(neox_args, flag: str) -> bool:
    return bool(getattr(neox_args, flag, False))


def softmax_fusion_on(neox_args) -> bool:
    """True when either fused-softmax flag asks attention to take the explicit-scores path."""
    return any(_on(neox_args, flag) for flag in SOFTMAX_FLAGS)


def model_fused_ops(neox_args) -> FusedOps:
    """The ops this model's layers call, fused where the flag is on (see module docstring).

    Raises ConfigError naming the flag when a fused op cannot be used here.
    """
    problems = fusion_flag_problems(neox_args)
    if problems:
        raise ConfigError(problems)
    try:
        return FusedOps.from_args(neox_args)
    except RuntimeError as err:  # triton missing, or no device for it: one message with the fix
        raise ConfigError([str(err)]) from None


def column_parallel_no_bias(layer: ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` without adding ``layer.bias`` (the caller fuses it into the next op)."""
    if layer.gather_output:
        raise ValueError("column_parallel_no_bias needs a ColumnParallelLinear with gather_output=False")
    if layer.sequence_parallel:
        x = gather_from_sequence_parallel_region(x, layer.group, seq_dim=1)
    else:
        x = copy_to_model_parallel_region(x, layer.group)
    return F.linear(x, layer.weight)


def row_parallel_no_bias(layer: RowParallelLinear, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(output without bias, bias)`` of ``layer(x)``: output + bias equals ``layer(x)``.

    Under sequence parallelism the returned bias passes through copy_to_model_parallel_region, as in
    the layer's forward, so that its gradient is summed over the ranks' sequence chunks.
    """
    if not layer.input_is_parallel:
        x = scatter_to_model_parallel_region(x, layer.group)
    out = F.linear(x, layer.weight)
    if layer.sequence_parallel:
        out = reduce_scatter_to_sequence_parallel_region(out, layer.group, seq_dim=1)
        bias = None if layer.bias is None else copy_to_model_parallel_region(layer.bias, layer.group)
    else:
        out = reduce_from_model_parallel_region(out, layer.group)
        bias = layer.bias
    return out, bias
