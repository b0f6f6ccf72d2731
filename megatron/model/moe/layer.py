"""The dropless mixture-of-experts MLP (``moe_type: megablocks``), in plain PyTorch.

Every token reaches its ``moe_top_k`` experts; nothing is dropped and there is no capacity. Per MoE layer:

1. ``router`` (megatron.model.moe.router) picks k experts per token and their combine weights, and computes the
   load-balancing loss;
2. the T x k (token, choice) slots are sorted by expert (a stable sort: within an expert, token order), each
   token's row gathered once per slot;
3. each expert runs its MLP on its contiguous block of rows (one matmul pair per expert: the grouped GEMM of
   MegaBlocks, as a loop);
4. each slot's output is scaled by its combine weight and summed back into its token's row.

Parameters carry GPT-NeoX's names and layouts (its ParallelDroplessMoE), so checkpoints cross unchanged:
``router.layer.weight`` [E, hidden]; ``experts.mlp.w1`` [E * F, hidden] (expert e's rows e*F .. (e+1)*F);
``experts.mlp.w2`` [E * F, hidden] (the down projection, used as x @ w2_e); with a GLU expert activation
(moe_glu, or a gated ``activation``) also ``experts.mlp.w3`` [E * F, hidden]: expert e computes
``(act(x @ w1_e^T) * (x @ w3_e^T)) @ w2_e`` (GPT-NeoX's grouped LLaMA MLP, Mixtral's w1 / w3 / w2). No biases.
F is ``config.expert_ffn_width``.

The layer returns ``(output, None)`` from ``forward_with_bias`` like the dense MLP (it has no bias to fuse).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activations import _GATED, _PLAIN
from megatron.model.moe.router import Router
from megatron.model.moe.stats import MoELayerBase
from megatron.model_config import GATED_ACTIVATIONS, ModelConfig
from megatron.optimizers import MOE_EXPERT_FLAG


def expert_activation(name: str):
    """(the elementwise function, whether the expert is gated) of an expert activation name."""
    if name in GATED_ACTIVATIONS:
        return _GATED[name], True
    return _PLAIN[name], False


class GroupedExperts(nn.Module):
    """E expert MLPs stored as GPT-NeoX's stacked w1 / [w3] / w2; ``forward`` runs each expert on its block."""

    def __init__(self, config: ModelConfig, initializer, layer_number: int) -> None:
        super().__init__()
        self.num_experts, self.width, self.hidden = config.moe_num_experts, config.expert_ffn_width, \
            config.hidden_size
        self.act, self.gated = expert_activation(config.expert_activation)
        rows = self.num_experts * self.width
        self.w1 = nn.Parameter(torch.empty(rows, self.hidden))
        initializer.weight(layer_number, "mlp.experts.mlp.w1")(self.w1.data)
        if self.gated:
            self.w3 = nn.Parameter(torch.empty(rows, self.hidden))
            initializer.weight(layer_number, "mlp.experts.mlp.w3")(self.w3.data)
        self.w2 = nn.Parameter(torch.empty(rows, self.hidden))
        initializer.output_weight(layer_number, "mlp.experts.mlp.w2")(self.w2.data)
        for weight in self.parameters():
            setattr(weight, MOE_EXPERT_FLAG, True)  # create_moe_param_group: their own optimizer group

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on rows x [n, hidden]."""
        rows = slice(e * self.width, (e + 1) * self.width)
        h = F.linear(x, self.w1[rows])
        h = self.act(h) * F.linear(x, self.w3[rows]) if self.gated else self.act(h)
        return h @ self.w2[rows]

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """x [sum(counts), hidden], rows grouped by expert (counts[e] rows for expert e) -> same shape."""
        outputs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outputs.append(self.expert(e, x[start:start + n]))
            start += n
        if not outputs:
            return x.new_zeros(0, self.hidden)
        return torch.cat(outputs, dim=0)


def permutation(experts: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) of the flattened slots [T * k]: ``order`` sorts them by expert (stable: within an expert in
    token, then choice order); counts[e] is the number of slots of expert e."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


class DroplessMoE(MoELayerBase):
    """GPT-NeoX's ParallelDroplessMoE function (module docstring): ``router`` and ``experts.mlp``."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__(config.moe_num_experts, layer_number, config.moe_loss_coeff)
        self.num_experts, self.top_k = config.moe_num_experts, config.moe_top_k
        self.router = Router(config, initializer, layer_number)
        self.experts = nn.Module()
        self.experts.mlp = GroupedExperts(config, initializer, layer_number)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing, aux = self.router(tokens)
        order, counts = permutation(routing.experts, self.num_experts)
        token_of_slot = order // self.top_k
        counts_list = counts.tolist()
        out_sorted = self.experts.mlp(tokens[token_of_slot], counts_list)
        weights = routing.weights.reshape(-1)[order].to(out_sorted.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of_slot, out_sorted * weights.unsqueeze(-1))
        out = self._finish(out, aux, counts, float(order.numel()))
        return out.view(shape)
