"""Tensor-parallel MLP: column-parallel up projection, activation, row-parallel down projection.

Width: ``config.ffn_width`` (GPT-NeoX's rule, derived in megatron.model.config.mlp_width). Gated activations
fuse the up projection as [up | gate], each half split across tensor-parallel ranks.

bias_gelu_fusion (activation 'gelu' only): the up projection's bias and the GeLU run as one fused kernel.
It computes the exact erf GeLU (approximate='none'), the function the unfused model uses (F.gelu), not
Megatron's tanh approximation, so fusing never changes what the model computes. Where the flag runs
PyTorch's implementation (CUDA, while that measures faster: megatron.fused_kernels.cuda_choice) the layer
takes the unfused path, the bias inside the up projection's GEMM.

use_flashattn_swiglu (activation 'swiglu' only): the fused Triton SwiGLU kernel computes silu(gate) * up,
flash-attn's swiglu, in one pass.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from megatron.fused_kernels import runs_triton
from megatron.model.activations import get_activation
from megatron.model.config import ModelConfig
from megatron.model.fused import model_fused_ops
from megatron.mpu import ColumnParallelLinear, RowParallelLinear

# The GeLU of the unfused model (F.gelu's default): the exact erf form.
GELU_APPROXIMATION = "none"


class ParallelMLP(nn.Module):
    """linear2(act(linear1(x))) with linear1 column-parallel and linear2 row-parallel."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        self.activation, gated = get_activation(config.activation, config.onnx_safe)
        ops = model_fused_ops(config)  # refuses fusion flags that do not fit the activation
        self.bias_gelu = ops.bias_gelu if config.bias_gelu_fusion else None
        self.fused_swiglu = ops.swiglu if config.use_flashattn_swiglu else None
        width, bias, sp, hidden = config.ffn_width, config.use_bias_in_mlp, config.sequence_parallel, \
            config.hidden_size
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
        if self.bias_gelu is not None and runs_triton(self.bias_gelu, x):
            return self.bias_gelu(self.linear1.forward_without_bias(x), self.linear1.bias, GELU_APPROXIMATION)
        if self.fused_swiglu is not None:
            up, gate = self.linear1(x).chunk(2, dim=-1)
            return self.fused_swiglu(gate, up)
        return self.activation(self.linear1(x))
