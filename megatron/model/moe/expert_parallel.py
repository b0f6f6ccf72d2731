"""The dropless mixture of experts with its experts split over data-parallel ranks (``moe_type: megablocks`` with
moe_expert_parallel_size EP > 1).

Each rank of an expert-parallel group (megatron.mpu.parallel_state) holds E / EP of the experts (rank r: global
experts r x E/EP .. (r+1) x E/EP - 1) and routes its own tokens with the whole router. Per MoE layer:

1. route and sort the (token, choice) slots by expert, as the layer without expert parallelism (layer.py);
2. exchange the slot counts per expert (one all-to-all of EP x E/EP numbers, on the device), read them and the
   layer's own counts back to the host together (the layer's one host sync: every size below is host arithmetic),
   then send each rank the rows of its experts and receive the rows for this rank's experts (all_to_all_rows:
   sizes vary with the routing);
3. regroup the received rows by local expert, run each expert on its block, undo the regrouping;
4. send the outputs back the way they came and combine them with the router weights.
The all-to-alls carry the gradients back, so an expert's gradient sums the contributions of every rank's tokens.

With T tensor-parallel ranks too (EP x TP): the expert-parallel groups join data-parallel ranks of the same
tensor-parallel rank (parallel_state), and the experts are split over both as GPT-NeoX's dMoE splits them over T
ranks, then each block over EP: tensor-parallel rank t holds the block t x E/T .. (t+1) x E/T - 1, and expert-parallel
rank r of it E / (EP x T) experts of that block. Every tensor-parallel rank holds the same tokens and routes them
identically; each exchanges only the slots of its block's experts over its expert-parallel group (steps 2-4), puts
them at their place among all sorted slots (zeros elsewhere), and one all-reduce over the tensor-parallel group
gives every rank every slot's output, as the layer without expert parallelism does. The router's gradients are then
equal on the tensor-parallel ranks; the input's gradient through the experts is summed over them. The experts are
marked ``model_parallel`` (each tensor-parallel rank holds others: megatron.mpu.grad_norm counts them on every rank).
With sequence_parallel each tensor-parallel rank holds a chunk of the sequence: the chunks are all-gathered, routed
and exchanged as above, and each rank's partial sums (its block's slots only) are reduce-scattered back into the
chunks instead of the all-reduce (megatron.model.moe.layer.sequence_parallel_moe, as the layer without expert
parallelism): the same tokens per rank, routing and gradients as without sequence_parallel.
DeepSpeed writes each tensor-parallel rank's experts in its own files (``..._expert_{j}_mp_rank_{t}_...``, j the
expert's index in the block), so stacked per rank they are the dMoE layout's ``experts.mlp.w1`` shard of rank t.

Why the class is DeepSpeed's ``MoE`` (without its gate or its token-dropping layer): DeepSpeed's engine only treats
parameters as experts (gradients reduced over the expert-data-parallel group and averaged over all data-parallel
ranks, with and without ZeRO 1 / 2; optimizer state and weights saved per expert-parallel rank) in a model with a
``deepspeed.moe.layer.MoE``, and saves each expert in a file of its own from that module's
``deepspeed_moe.experts.deepspeed_experts.{e}`` parameters. So the experts live there, one module per local expert
with GPT-NeoX's per-expert w1 / [w3] / w2 rows ([width, hidden] each), named by the global expert in DeepSpeed's
files (``layer_{i}_expert_{e}_mp_rank_00_model_states.pt``); megatron.checkpoint_conversion stacks them back into
GPT-NeoX's ``mlp.experts.mlp.w1`` & co. for conversion and inference. The router keeps GPT-NeoX's
``mlp.router.layer.weight``. Initialised from the same stacked tensors as the layer without expert parallelism.
In a pipeline (PP x DP) each stage's experts are in files of their own (megatron.model.moe.pipeline).
"""
from __future__ import annotations

import torch
from deepspeed.moe.layer import MoE
from torch import nn

from megatron.model.config import ModelConfig
from megatron.model.moe.dispatch import slot_positions
from megatron.model.moe.layer import (GroupedExperts, SlotCounts, combine_all, expert_mlp, route, run_by_expert,
                                      sequence_parallel_moe)
from megatron.model.moe.router import Router
from megatron.model.moe.stats import MoELayerBase
from megatron.model.parameter_marks import MOE_EXPERT_FLAG
from megatron.mpu import copy_to_model_parallel_region, reduce_from_model_parallel_region
from megatron.mpu.collectives import all_to_all_equal, all_to_all_rows


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
        if parallel_state.get_expert_parallel_world_size() != ep:
            raise ValueError(f"moe_expert_parallel_size={ep} needs a parallel state with {ep} expert-parallel ranks")
        tp, tp_rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
        if config.moe_num_experts % (ep * tp):
            raise ValueError(f"moe_num_experts={config.moe_num_experts} must be divisible by moe_expert_parallel_size "
                             f"x model_parallel_size = {ep} x {tp}")
        self.tp, self.model_group = tp, parallel_state.get_model_parallel_group()
        self.sequence_parallel = config.sequence_parallel and tp > 1
        # what DeepSpeed's engine reads of an MoE layer
        self.ep_size, self.num_experts = ep, config.moe_num_experts
        self.num_local_experts = config.moe_num_experts // (ep * tp)
        # this tensor-parallel rank's block of experts (GPT-NeoX's dMoE split), shared out over the expert group
        self.block = range(tp_rank * self.num_experts // tp, (tp_rank + 1) * self.num_experts // tp)
        self.expert_group_name, self.use_residual, self.enable_expert_tensor_parallelism = \
            parallel_state.expert_group_name, False, False
        self.top_k = config.moe_top_k
        self.group = parallel_state.get_expert_parallel_group()
        self.router = Router(config, initializer, layer_number)
        # the stacked tensors of the layer without expert parallelism, then this rank's experts' rows
        stacked = GroupedExperts(config, initializer, layer_number)
        self.act, self.gated, width = stacked.act, stacked.gated, stacked.width
        first = self.block.start + parallel_state.get_expert_parallel_rank() * self.num_local_experts
        self.first_expert = first  # the global index of local expert 0 (megatron.model.moe.naming)
        experts = []
        for e in range(first, first + self.num_local_experts):
            rows = {}
            for name, full in stacked.named_parameters():
                weight = nn.Parameter(full.detach()[e * width:(e + 1) * width].clone())
                weight.allreduce, weight.group_name = False, self.expert_group_name  # DeepSpeed's expert mark
                setattr(weight, MOE_EXPERT_FLAG, True)
                weight.model_parallel = tp > 1  # each tensor-parallel rank holds other experts (gradient norm)
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
        weights = (expert.w1, expert.w3, expert.w2) if self.gated else (expert.w1, expert.w2)
        return expert_mlp(x, *weights, act=self.act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # x is this rank's chunk of the sequence (module docstring)
            return self._finish(*sequence_parallel_moe(x, self.router, self.model_group, self.num_experts,
                                                       self.top_k, self.block, self._read_counts,
                                                       self._exchange_and_run))
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing, aux, order, counts, token_of_slot = route(self.router, tokens, self.num_experts, self.top_k)
        slots = self._read_counts(counts)
        # this tensor-parallel rank's block of experts: its slots start .. stop of the sorted ones (all with TP 1)
        start, stop = slots.span(self.block)
        if self.tp > 1:  # each rank runs its experts' share of the slots: the input's gradient sums over the ranks
            tokens_in = copy_to_model_parallel_region(tokens, self.model_group)
        else:
            tokens_in = tokens
        out_block = self._exchange_and_run(tokens_in[token_of_slot[start:stop]], slots)
        if self.tp > 1:  # every slot's output on every tensor-parallel rank, as the layer without expert parallelism
            out_sorted = torch.cat([out_block.new_zeros(start, shape[-1]), out_block,
                                    out_block.new_zeros(order.numel() - stop, shape[-1])])
            out_sorted = reduce_from_model_parallel_region(out_sorted, self.model_group)
        else:
            out_sorted = out_block
        combined = combine_all(routing, order, token_of_slot, slot_positions(order, self.top_k), out_sorted)
        return self._finish(combined, aux, counts, float(order.numel())).view(shape)

    def _read_counts(self, counts: torch.Tensor) -> SlotCounts:
        """The slot counts of all experts and those the expert-parallel ranks send to this rank's experts, on the
        host with one sync: the counts' all-to-all (of this block's EP x local experts' counts: counts[q, l] go to
        rank q's local expert l) runs on the device, then both are read back together."""
        received = all_to_all_equal(counts[self.block.start:self.block.stop], self.group)
        host = torch.cat([counts, received]).tolist()
        local = self.num_local_experts
        arrived = host[counts.numel():]
        return SlotCounts(host[:counts.numel()], [arrived[q * local:(q + 1) * local] for q in range(self.ep_size)])

    def _exchange_and_run(self, rows: torch.Tensor, slots: SlotCounts) -> torch.Tensor:
        """The outputs of ``rows`` (sorted by expert: the slots of this tensor-parallel rank's block of EP x local
        experts) from the expert-parallel ranks that hold their experts, in the same order. Sizes are host
        arithmetic on ``slots`` (``_read_counts``)."""
        ep, local = self.ep_size, self.num_local_experts
        block = slots.per_expert[self.block.start:self.block.stop]
        received = slots.received  # received[q][l]: rows rank q sends to local expert l
        send = [sum(block[q * local:(q + 1) * local]) for q in range(ep)]
        receive = [sum(row) for row in received]
        inbox = all_to_all_rows(rows, send, receive, self.group)
        # rows arrive by source rank, then local expert: regroup them by local expert, then back
        pieces = inbox.split([received[q][e] for q in range(ep) for e in range(local)])
        by_expert = torch.cat([pieces[q * local + e] for e in range(local) for q in range(ep)])
        out = run_by_expert(self._expert, by_expert, [sum(received[q][e] for q in range(ep)) for e in range(local)])
        done = out.split([received[q][e] for e in range(local) for q in range(ep)])
        out = torch.cat([done[e * ep + q] for q in range(ep) for e in range(local)])
        return all_to_all_rows(out, receive, send, self.group)
