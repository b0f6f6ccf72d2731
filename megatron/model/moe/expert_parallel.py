"""The dropless mixture of experts with its experts split over data-parallel ranks (``moe_type: megablocks`` with
moe_expert_parallel_size EP > 1).

Each rank of an expert-parallel group (megatron.mpu.parallel_state) holds E / EP of the experts (rank r: global
experts r x E/EP .. (r+1) x E/EP - 1) and routes its own tokens with the whole router. Per MoE layer:

1. route and sort the (token, choice) slots by expert, as the layer without expert parallelism (layer.py);
2. exchange the slot counts per expert (one all-to-all of EP x E/EP numbers), then send each rank the rows of its
   experts and receive the rows for this rank's experts (all_to_all_rows: sizes vary with the routing);
3. regroup the received rows by local expert, run each expert on its block, undo the regrouping;
4. send the outputs back the way they came and combine them with the router weights.
The all-to-alls carry the gradients back, so an expert's gradient sums the contributions of every rank's tokens.

Why the class is DeepSpeed's ``MoE`` (without its gate or its token-dropping layer): DeepSpeed's engine only treats
parameters as experts (gradients reduced over the expert-data-parallel group and averaged over all data-parallel
ranks, with and without ZeRO 1 / 2; optimizer state and weights saved per expert-parallel rank) in a model with a
``deepspeed.moe.layer.MoE``, and saves each expert in a file of its own from that module's
``deepspeed_moe.experts.deepspeed_experts.{e}`` parameters. So the experts live there, one module per local expert
with GPT-NeoX's per-expert w1 / [w3] / w2 rows ([width, hidden] each), named by the global expert in DeepSpeed's
files (``layer_{i}_expert_{e}_mp_rank_00_model_states.pt``); megatron.checkpoint_conversion stacks them back into
GPT-NeoX's ``mlp.experts.mlp.w1`` & co. for conversion and inference. The router keeps GPT-NeoX's
``mlp.router.layer.weight``. Initialised from the same stacked tensors as the layer without expert parallelism.
One tensor-parallel rank, no pipeline (refused by the argument checks).
"""
from __future__ import annotations

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from megatron.deepspeed_comm import collectives
from megatron.model.moe.layer import GroupedExperts, combine, route, run_by_expert
from megatron.model.moe.router import Router
from megatron.model.moe.stats import MoELayerBase
from megatron.model_config import ModelConfig
from megatron.mpu.collectives import all_to_all_rows
from megatron.optimizers import MOE_EXPERT_FLAG


class LocalExpert(nn.Module):
    """One expert's GPT-NeoX rows: w1 / [w3] / w2, each [width, hidden] (w2 used as h @ w2)."""

    def __init__(self, rows: dict) -> None:
        super().__init__()
        for name, weight in rows.items():
            self.register_parameter(name, weight)


class ExpertParallelDroplessMoE(MoE, MoELayerBase):
    """The dropless layer over an expert-parallel group (module docstring); called with the hidden states, returns
    the output."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        nn.Module.__init__(self)  # DeepSpeed's MoE.__init__ builds its gate and token-dropping layer: not used
        self.setup_stats(config.moe_num_experts, layer_number, config.moe_loss_coeff)
        ep = config.moe_expert_parallel_size
        if parallel_state.get_expert_parallel_world_size() != ep or parallel_state.get_model_parallel_world_size() != 1:
            raise ValueError(f"moe_expert_parallel_size={ep} needs a parallel state with {ep} expert-parallel ranks "
                             f"and one tensor-parallel rank")
        # what DeepSpeed's engine reads of an MoE layer
        self.ep_size, self.num_experts = ep, config.moe_num_experts
        self.num_local_experts = config.moe_num_experts // ep
        self.expert_group_name, self.use_residual, self.enable_expert_tensor_parallelism = \
            parallel_state.expert_group_name, False, False
        self.top_k = config.moe_top_k
        self.group = parallel_state.get_expert_parallel_group()
        self.router = Router(config, initializer, layer_number)
        # the stacked tensors of the layer without expert parallelism, then this rank's experts' rows
        stacked = GroupedExperts(config, initializer, layer_number)
        self.act, self.gated, width = stacked.act, stacked.gated, stacked.width
        first = parallel_state.get_expert_parallel_rank() * self.num_local_experts
        experts = []
        for e in range(first, first + self.num_local_experts):
            rows = {}
            for name, full in stacked.named_parameters():
                weight = nn.Parameter(full.detach()[e * width:(e + 1) * width].clone())
                weight.allreduce, weight.group_name = False, self.expert_group_name  # DeepSpeed's expert mark
                setattr(weight, MOE_EXPERT_FLAG, True)
                rows[name] = weight
            experts.append(LocalExpert(rows))
        self.deepspeed_moe = nn.Module()
        self.deepspeed_moe.experts = nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = nn.ModuleList(experts)
        parallel_state.register_expert_groups_with_deepspeed()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine's call: nothing to do, the parallel state's groups were registered with DeepSpeed in
        __init__."""

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert e's MLP on rows x [n, hidden]."""
        expert = self.deepspeed_moe.experts.deepspeed_experts[e]
        h = x @ expert.w1.t()
        h = self.act(h) * (x @ expert.w3.t()) if self.gated else self.act(h)
        return h @ expert.w2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing, aux, order, counts, token_of_slot = route(self.router, tokens, self.num_experts, self.top_k)
        ep, local = self.ep_size, self.num_local_experts
        # counts[q, l]: rows this rank sends to rank q's local expert l; received[q, l]: rows rank q sends here
        received = torch.empty_like(counts)
        collectives().all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        inbox = all_to_all_rows(tokens[token_of_slot], send, received.sum(1).tolist(), self.group)
        # rows arrive by source rank, then local expert: regroup them by local expert
        offsets = (received.reshape(-1).cumsum(0) - received.reshape(-1)).view(ep, local)
        regroup = torch.cat([torch.arange(int(offsets[q, e]), int(offsets[q, e] + received[q, e]))
                             for e in range(local) for q in range(ep)]).long()
        back = torch.empty_like(regroup)
        back[regroup] = torch.arange(regroup.numel())
        out = run_by_expert(self._expert, inbox[regroup], received.sum(0).tolist())[back]
        out_sorted = all_to_all_rows(out, received.sum(1).tolist(), send, self.group)
        combined = combine(tokens, routing, order, token_of_slot, out_sorted)
        return self._finish(combined, aux, counts, float(order.numel())).view(shape)
