"""Tensor-parallel MLP: column-parallel up projection, activation, row-parallel down projection.

Width rule (as GPT-NeoX): inner = intermediate_size, else expansion_factor * hidden, else 4 * hidden.
Plain activations: inner rounded up to a multiple of mlp_multiple_of. Gated activations keep the
parameter count of the plain MLP: each half is int(inner * 2 / 3) // 2 rounded up to mlp_multiple_of,
and the fused up projection holds [up | gate] (each half split across tensor-parallel ranks).

bias_gelu_fusion (activation 'gelu' only): the up projection's bias and the GeLU run as one fused kernel.
It computes the exact erf GeLU (approximate='none'), the function the unfused model uses (F.gelu), not
Megatron's tanh approximation, so fusing never changes what the model computes.

use_flashattn_swiglu (activation 'swiglu' only): the fused Triton SwiGLU kernel computes silu(gate) * up,
flash-attn's swiglu, in one pass.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from megatron.model.activations import get_activation
from megatron.model.fused import model_fused_ops
from megatron.mpu import ColumnParallelLinear, RowParallelLinear

# The GeLU of the unfused model (F.gelu's default): the exact erf form.
GELU_APPROXIMATION = "none"


def _round_up(value: int, multiple: int) -> int:
    return multiple * ((value + multiple - 1) // multiple)


def mlp_width(neox_args, gated: bool) -> int:
    """Width of the activation's output (the down projection's input)."""
    hidden = neox_args.hidden_size
    multiple = int(getattr(neox_args, "mlp_multiple_of", 1) or 1)
    if getattr(neox_args, "intermediate_size", None):
        inner = int(neox_args.intermediate_size)
    elif getattr(neox_args, "expansion_factor", None):
        inner = int(float(neox_args.expansion_factor) * hidden)
    else:
        inner = 4 * hidden
    if gated:
        return _round_up(int(inner * 2 / 3) // 2, multiple)
    return _round_up(inner, multiple)


class ParallelMLP(nn.Module):
    """linear2(act(linear1(x))) with linear1 column-parallel and linear2 row-parallel."""

    def __init__(self, neox_args, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        name = getattr(neox_args, "activation", "gelu") or "gelu"
        self.activation, gated = get_activation(name)
        # model_fused_ops refuses bias_gelu_fusion for any activation other than plain gelu.
        self.bias_gelu = model_fused_ops(neox_args).bias_gelu if getattr(neox_args, "bias_gelu_fusion", False) \
            else None
        # use_flashattn_swiglu: the Triton SwiGLU kernel (fusion_flag_problems refuses it for other activations).
        self.fused_swiglu = model_fused_ops(neox_args).swiglu if getattr(neox_args, "use_flashattn_swiglu", False) \
            else None
        width = mlp_width(neox_args, gated)
        bias = bool(getattr(neox_args, "use_bias_in_mlp", True))
        sp = bool(getattr(neox_args, "sequence_parallel", False))
        hidden = neox_args.hidden_size
        self.linear1 = ColumnParallelLinear(
            hidden, width * (2 if gated else 1), parallel_state,
            initializer.weight(layer_number, "mlp.linear1"), bias=bias, chunks=2 if gated else 1,
            sequence_parallel=sp)
        self.linear2 = RowParallelLinear(
            width, hidden, parallel_state, initializer.output_weight(layer_number, "mlp.linear2"),
            bias=bias, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self._inner(x))

    def forward_with_bias(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(output without linear2's bias, that bias), for bias_dropout_fusion to add it in its kernel."""
        return self.linear2.forward_without_bias(self._inner(x))

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias_gelu is not None:
            return self.bias_gelu(self.linear1.forward_without_bias(x), self.linear1.bias, GELU_APPROXIMATION)
        if self.fused_swiglu is not None:
            up, gate = self.linear1(x).chunk(2, dim=-1)
            return self.fused_swiglu(gate, up)
        return self.activation(self.linear1(x))
