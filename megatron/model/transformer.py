"""One transformer layer (pre-norm, or GPT-J parallel residual), called with (hidden, mask) as DeepSpeed's
pipeline passes it between stages (the sequential model calls it the same way).

Activations are [batch, seq, hidden] (seq sharded across tensor-parallel ranks under
sequence_parallel). Residual forms:
  default         x = x + drop(attn(ln1(x)));  x = x + drop(mlp(ln2(x)))
  gpt_j_residual  x = x + drop(attn(ln1(x))) + drop(mlp(ln2(x)))   (ln2 = ln1 with gpt_j_tied)
In the layers of ``config.moe_layers`` the MLP is a mixture of experts (megatron.model.moe).
Hidden dropout draws from the default stream (identical across TP ranks, where the tensor is
replicated) or, under sequence parallelism, from the model-parallel stream (each rank holds a
different chunk of the sequence).

bias_dropout_fusion: each residual is ``bias_dropout_add(out, bias, residual, hidden_dropout)`` from
megatron.fused_kernels; the bias of the attention's dense / the MLP's linear2 is left out of the linear and
added inside the kernel. The kernel seeds its mask from the same RNG stream as the unfused dropout, but the
mask itself differs from F.dropout's, so only runs without dropout (or in eval) match the unfused model.
Where the flag runs PyTorch's implementation (CUDA, while that measures faster:
megatron.fused_kernels.cuda_choice) the layer takes the unfused path, the bias inside the linears.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.fused_kernels import runs_triton
from megatron.model.attention import ParallelSelfAttention
from megatron.model.checkpoint_layout import LAYER, install_hooks
from megatron.model.config import ModelConfig
from megatron.model.fused import model_fused_ops
from megatron.model.kv_cache import KVCache
from megatron.model.mlp import ParallelMLP
from megatron.model.moe import build_moe_mlp
from megatron.model.norms import build_norm


def sequence_parallel_on(config: ModelConfig, parallel_state) -> bool:
    """sequence_parallel only has an effect with more than one model-parallel rank."""
    return config.sequence_parallel and parallel_state.get_model_parallel_world_size() > 1


class ParallelTransformerLayer(nn.Module):
    """Norms, attention, MLP and residuals of one layer (see module docstring)."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int, rng_tracker,
                 rpe=None) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.rng_tracker = rng_tracker
        self.sequence_parallel = sequence_parallel_on(config, parallel_state)
        group = parallel_state.get_model_parallel_group() if self.sequence_parallel else None
        self.gpt_j_residual, self.gpt_j_tied = config.gpt_j_residual, config.gpt_j_tied
        self.input_layernorm = build_norm(config, config.hidden_size, grad_reduce_group=group)
        self.attention = ParallelSelfAttention(config, parallel_state, initializer, layer_number, rng_tracker, rpe)
        if not (self.gpt_j_residual and self.gpt_j_tied):
            self.post_attention_layernorm = build_norm(config, config.hidden_size, grad_reduce_group=group)
        if layer_number in config.moe_layers:
            self.mlp = build_moe_mlp(config, parallel_state, initializer, layer_number)
        else:
            self.mlp = ParallelMLP(config, parallel_state, initializer, layer_number)
        self.hidden_dropout = config.hidden_dropout
        self.bias_dropout_add = model_fused_ops(config).bias_dropout_add if config.bias_dropout_fusion else None
        install_hooks(self, LAYER, config, parallel_state)
        self.token_drop: Optional[nn.Module] = None  # random-LTD's wrapper, when training drops tokens here
        # (megatron.model.random_ltd: it runs _forward on the kept tokens)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.hidden_dropout == 0.0:
            return x
        ctx = self.rng_tracker.fork() if self.sequence_parallel else contextlib.nullcontext()
        with ctx:
            return F.dropout(x, p=self.hidden_dropout, training=True)

    def forward(self, args: Tuple[torch.Tensor, Optional[torch.Tensor]], kv_cache: Optional[KVCache] = None):
        """(hidden_states, attention_mask) -> (hidden_states, attention_mask): the form DeepSpeed's pipeline
        passes between stages, used by the sequential model too."""
        hidden, mask = args
        if self.token_drop is not None and kv_cache is None:
            return self.token_drop(hidden, attention_mask=mask), mask
        return self._forward(hidden, mask, kv_cache), mask

    def _forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                 kv_cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``positions`` [batch, seq]: where each token of ``x`` sits in its sequence, when not 0 .. seq - 1 (the
        tokens random-LTD kept, megatron.model.random_ltd); given to the attention only then."""
        if self.bias_dropout_add is not None and runs_triton(self.bias_dropout_add, x):
            return self._fused_residual_forward(x, attention_mask, kv_cache, positions)
        normed = self.input_layernorm(x)
        attn = self.attention(normed, attention_mask, kv_cache, **_at(positions))
        if self.gpt_j_residual:
            mlp_in = normed if self.gpt_j_tied else self.post_attention_layernorm(x)
            return x + self._dropout(attn) + self._dropout(self.mlp(mlp_in))
        x = x + self._dropout(attn)
        return x + self._dropout(self.mlp(self.post_attention_layernorm(x)))

    def _fused_residual_forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                kv_cache: Optional[KVCache], positions: Optional[torch.Tensor]) -> torch.Tensor:
        """forward with bias_dropout_fusion: same residual forms, same order of RNG draws."""
        normed = self.input_layernorm(x)
        attn, attn_bias = self.attention.forward_with_bias(normed, attention_mask, kv_cache, **_at(positions))
        if self.gpt_j_residual:
            mlp_in = normed if self.gpt_j_tied else self.post_attention_layernorm(x)
            x = self._bias_dropout_add(attn, attn_bias, x)
            return self._bias_dropout_add(*self.mlp.forward_with_bias(mlp_in), x)
        x = self._bias_dropout_add(attn, attn_bias, x)
        return self._bias_dropout_add(*self.mlp.forward_with_bias(self.post_attention_layernorm(x)), x)

    def _bias_dropout_add(self, out: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor):
        dropping = self.training and self.hidden_dropout > 0.0
        ctx = self.rng_tracker.fork() if self.sequence_parallel and dropping else contextlib.nullcontext()
        with ctx:
            return self.bias_dropout_add(out, bias, residual, self.hidden_dropout, self.training)


def _at(positions: Optional[torch.Tensor]) -> dict:
    """The attention's ``positions`` keyword when there are any (other layer types take none)."""
    return {} if positions is None else {"positions": positions}
