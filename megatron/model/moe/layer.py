"""The dropless mixture-of-experts MLP (``moe_type: megablocks``), in plain PyTorch.

Every token reaches its ``moe_top_k`` experts; nothing is dropped and there is no capacity. Per MoE layer:

1. ``router`` (megatron.model.moe.router) picks k experts per token and their combine weights, and computes the
   load-balancing loss;
2. the T x k (token, choice) slots are sorted by expert (a stable sort: within an expert, token order), each
   token's row gathered once per slot;
3. each expert runs its MLP on its contiguous block of rows (one matmul pair per expert: the grouped GEMM of
   MegaBlocks, as a loop);
4. each slot's output is scaled by its combine weight and summed back into its token's row.

Steps 2 and 4 move rows as permutations (megatron.model.moe.dispatch), their gradients gathers too.

Parameters carry GPT-NeoX's names and layouts (its ParallelDroplessMoE), so checkpoints cross unchanged:
``router.layer.weight`` [E, hidden]; ``experts.mlp.w1`` [E * F, hidden] (expert e's rows e*F .. (e+1)*F);
``experts.mlp.w2`` [E * F, hidden] (the down projection, used as x @ w2_e), each split by rows (by expert) over
the tensor-parallel ranks; with a GLU expert activation
(moe_glu, or a gated ``activation``) also ``experts.mlp.w3`` [E * F, hidden]: expert e computes
``(act(x @ w1_e^T) * (x @ w3_e^T)) @ w2_e`` (GPT-NeoX's grouped LLaMA MLP, Mixtral's w1 / w3 / w2). No biases.
F is ``config.expert_ffn_width``.

The layer returns ``(output, None)`` from ``forward_with_bias`` like the dense MLP (it has no bias to fuse).
With moe_expert_parallel_size > 1 its experts are split over data-parallel ranks instead (expert_parallel.py, one
module per expert); ``stack_expert_parallel_experts`` turns that checkpoint form back into the stacked tensors.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.model.activations import elementwise_activation
from megatron.model.config import ModelConfig
from megatron.model.moe.dispatch import combine_slots, dispatch, slot_positions
from megatron.model.moe.router import Router, expert_counts
from megatron.model.moe.stats import MoELayerBase
from megatron.model.parameter_marks import MOE_EXPERT_FLAG
from megatron.mpu import (copy_to_model_parallel_region, gather_from_sequence_parallel_region,
                          reduce_from_model_parallel_region, reduce_scatter_to_sequence_parallel_region)
from megatron.mpu.collectives import group_size


class GroupedExperts(nn.Module):
    """This rank's experts (all E, or E / T of them on T tensor-parallel ranks: rank r holds experts
    r * E / T .. (r + 1) * E / T - 1) stored as GPT-NeoX's stacked w1 / [w3] / w2; ``forward`` runs each local
    expert on its block of rows. The full tensors are initialised and this rank keeps its rows, so a seed gives
    the same experts for any tensor-parallel size."""

    def __init__(self, config: ModelConfig, initializer, layer_number: int, tp_rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        self.num_experts, self.width, self.hidden = config.moe_num_experts // tp, config.expert_ffn_width, \
            config.hidden_size
        self.act, self.gated = elementwise_activation(config.expert_activation, config.onnx_safe)
        rows = self.num_experts * self.width
        local = slice(tp_rank * rows, (tp_rank + 1) * rows)
        names = ["w1", "w3", "w2"] if self.gated else ["w1", "w2"]
        for name in names:
            full = torch.empty(rows * tp, self.hidden)
            init = initializer.output_weight if name == "w2" else initializer.weight
            init(layer_number, f"mlp.experts.mlp.{name}")(full)
            weight = nn.Parameter(full[local].clone())
            setattr(weight, MOE_EXPERT_FLAG, True)  # create_moe_param_group: their own optimizer group
            weight.model_parallel = tp > 1  # a tensor-parallel shard (gradient norm, checkpoint conversion)
            self.register_parameter(name, weight)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP on rows x [n, hidden] (one expert on its own: tests and references; ``forward`` splits the
        weights once for all experts instead)."""
        return expert_mlp(x, *self.per_expert_weights()[e], act=self.act)

    def per_expert_weights(self) -> List[Tuple[torch.Tensor, ...]]:
        """The stacked w1 / [w3] / w2 split into this rank's experts with one ``unbind`` each: [(w1_e, [w3_e,] w2_e)
        for e], each [width, hidden]. Split once per forward, the backward stacks the experts' gradients into the
        weight's gradient in one copy; slicing ``w[rows]`` per expert instead zero-fills a gradient as large as the
        whole stacked weight for every expert (half the CPU time of an MoE step, measured)."""
        names = ["w1", "w3", "w2"] if self.gated else ["w1", "w2"]
        split = [getattr(self, name).view(self.num_experts, self.width, self.hidden).unbind(0) for name in names]
        return list(zip(*split))

    def forward(self, x: torch.Tensor, counts) -> torch.Tensor:
        """x [sum(counts), hidden], rows grouped by expert (counts[e] rows for expert e) -> same shape."""
        weights = self.per_expert_weights()
        return run_by_expert(lambda e, rows: expert_mlp(rows, *weights[e], act=self.act), x, counts)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, *rest: torch.Tensor, act) -> torch.Tensor:
    """One expert's MLP on rows x [n, hidden]: ``act(x @ w1^T) @ w2``, or with a GLU expert (w1, w3, w2)
    ``(act(x @ w1^T) * (x @ w3^T)) @ w2``; each weight [width, hidden]."""
    h = act(F.linear(x, w1))
    if len(rest) == 2:
        h = h * F.linear(x, rest[0])
    return h @ rest[-1]


def run_by_expert(expert: Callable[[int, torch.Tensor], torch.Tensor], x: torch.Tensor, counts) -> torch.Tensor:
    """x [sum(counts), hidden], rows grouped by expert (counts[e] rows for expert e), each block through
    ``expert(e, rows)`` -> same shape. The rows are split once (one gradient concatenation in the backward)."""
    outputs = [expert(e, rows) for e, rows in enumerate(x.split(list(counts))) if rows.shape[0]]
    return torch.cat(outputs, dim=0) if outputs else x.new_zeros(0, x.shape[-1])


def route(router: nn.Module, tokens: torch.Tensor, num_experts: int, top_k: int):
    """(routing, auxiliary loss, order, counts, token of each sorted slot) of tokens [T, hidden]: the router's choice
    and the slots sorted by expert (``permutation``)."""
    routing, aux = router(tokens)
    order, counts = permutation(routing.experts, num_experts)
    return routing, aux, order, counts, order // top_k


def weighted_slots(routing, order: torch.Tensor, out_sorted: torch.Tensor) -> torch.Tensor:
    """Each sorted slot's output [slots, hidden] times its router weight (``order``: those slots' ids)."""
    return out_sorted * routing.weights.reshape(-1)[order].to(out_sorted.dtype).unsqueeze(-1)


def combine(tokens: torch.Tensor, routing, order: torch.Tensor, token_of_slot: torch.Tensor,
            out_sorted: torch.Tensor) -> torch.Tensor:
    """Some sorted slots' outputs [slots, hidden] (``order`` / ``token_of_slot``: those slots') times their router
    weights, summed into their tokens' rows of a [T, hidden] zero tensor (``combine_all`` when every slot is there)."""
    return torch.zeros_like(tokens).index_add_(0, token_of_slot, weighted_slots(routing, order, out_sorted))


def combine_all(routing, order: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor,
                out_sorted: torch.Tensor) -> torch.Tensor:
    """Every sorted slot's output [T x k, hidden] times its router weight, summed into its token's row: ``combine``'s
    numbers, as gathers (megatron.model.moe.dispatch)."""
    return combine_slots(weighted_slots(routing, order, out_sorted), token_of_slot, positions)


EXPERT_PARALLEL_KEY = re.compile(r"^(.*\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w[123])$")
"""A dropless expert's rows as the expert-parallel layer keeps them (megatron.model.moe.expert_parallel): prefix,
global expert, tensor."""


def stack_expert_parallel_experts(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with the dropless experts of an expert-parallel checkpoint (one [width, hidden] tensor per expert
    and tensor, from DeepSpeed's per-expert files) stacked in expert order into GPT-NeoX's ``experts.mlp.w1`` & co.;
    everything else as it is."""
    rows: Dict[Tuple[str, str], Dict[int, torch.Tensor]] = {}
    out = {}
    for key, value in state.items():
        match = EXPERT_PARALLEL_KEY.match(key)
        if match:
            rows.setdefault((match.group(1), match.group(3)), {})[int(match.group(2))] = value
        else:
            out[key] = value
    for (prefix, name), experts in rows.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}experts.mlp.{name}: the checkpoint has experts {sorted(experts)}, not all of "
                             f"0 .. {max(experts)}")
        out[f"{prefix}experts.mlp.{name}"] = torch.cat([experts[e] for e in range(len(experts))])
    return out


def permutation(experts: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) of the flattened slots [T * k]: ``order`` sorts them by expert (stable: within an expert in
    token, then choice order); counts[e] is the number of slots of expert e."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    return order, expert_counts(flat, num_experts)


@dataclasses.dataclass(frozen=True)
class SlotCounts:
    """A layer's slot counts on the host, read back from the device at once: the one host sync of a dropless MoE
    layer (everything the dispatch needs to know on the host follows from them by host arithmetic)."""

    per_expert: List[int]
    """Slots (of this rank's tokens) routed to each of all E experts."""
    received: Optional[List[List[int]]] = None
    """Expert parallelism: received[q][l], the slots expert-parallel rank q sends to this rank's local expert l."""

    def span(self, block: range) -> Tuple[int, int]:
        """(start, stop) of the sorted slots that go to the experts ``block``."""
        start = sum(self.per_expert[:block.start])
        return start, start + sum(self.per_expert[block.start:block.stop])


class DroplessMoE(MoELayerBase):
    """GPT-NeoX's ParallelDroplessMoE function (module docstring): ``router`` and ``experts.mlp``.

    On T tensor-parallel ranks (GPT-NeoX's dMoE layout) every rank holds all tokens and the whole router, and
    E / T of the experts: it routes all tokens (identically on every rank), runs its experts on their slots, and
    one all-reduce of the [T x k, hidden] slot outputs gives every rank all of them; the combine step is then
    the same on every rank, so the router's gradients are equal on all ranks without a reduction. The input's
    gradient through the experts is summed over the ranks (copy_to_model_parallel_region). With sequence_parallel
    see ``sequence_parallel_moe``."""

    def __init__(self, config: ModelConfig, parallel_state, initializer, layer_number: int) -> None:
        super().__init__()
        self.setup_stats(config.moe_num_experts, layer_number, config.moe_loss_coeff)
        self.num_experts, self.top_k = config.moe_num_experts, config.moe_top_k
        self.group = parallel_state.get_model_parallel_group()
        tp, tp_rank = parallel_state.get_model_parallel_world_size(), parallel_state.get_model_parallel_rank()
        self.tp = tp
        self.sequence_parallel = config.sequence_parallel and tp > 1
        self.local_experts = range(tp_rank * self.num_experts // tp, (tp_rank + 1) * self.num_experts // tp)
        self.router = Router(config, initializer, layer_number)
        self.experts = nn.Module()
        self.experts.mlp = GroupedExperts(config, initializer, layer_number, tp_rank, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return self._sequence_parallel_forward(x)
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing, aux, order, counts, token_of_slot = route(self.router, tokens, self.num_experts, self.top_k)
        slots = SlotCounts(counts.tolist())  # the layer's one host sync
        positions = slot_positions(order, self.top_k)
        if self.tp == 1:
            out_sorted = self.experts.mlp(dispatch(tokens, token_of_slot, positions), slots.per_expert)
        else:
            start, stop = slots.span(self.local_experts)
            expert_in = copy_to_model_parallel_region(tokens, self.group)[token_of_slot[start:stop]]
            local_out = self.experts.mlp(expert_in, slots.per_expert[self.local_experts.start:self.local_experts.stop])
            out_sorted = torch.cat([local_out.new_zeros(start, shape[-1]), local_out,
                                    local_out.new_zeros(order.numel() - stop, shape[-1])])
            out_sorted = reduce_from_model_parallel_region(out_sorted, self.group)
        out = combine_all(routing, order, token_of_slot, positions, out_sorted)
        return self._finish(out, aux, counts, float(order.numel())).view(shape)

    def _sequence_parallel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, seq / T, hidden] is this rank's chunk of the sequence (sequence_parallel): see
        ``sequence_parallel_moe``; this rank's experts run on their slots."""
        block = self.local_experts
        out, aux, counts, slots = sequence_parallel_moe(
            x, self.router, self.group, self.num_experts, self.top_k, block, lambda counts: SlotCounts(counts.tolist()),
            lambda rows, slot_counts: self.experts.mlp(rows, slot_counts.per_expert[block.start:block.stop]))
        return self._finish(out, aux, counts, slots)


def sequence_parallel_moe(x: torch.Tensor, router: nn.Module, group, num_experts: int, top_k: int, block: range,
                          read_counts: Callable[[torch.Tensor], SlotCounts],
                          run_block: Callable[[torch.Tensor, SlotCounts], torch.Tensor]):
    """(output chunk, auxiliary loss, slots per expert, number of slots) of a dropless layer whose tensor-parallel
    rank holds the experts ``block`` of all, on x [batch, seq / T, hidden], this rank's chunk of the sequence
    (sequence_parallel over ``group``, T ranks). ``read_counts(counts)`` brings the slot counts per expert (a device
    tensor [E]) to the host, the layer's one sync; ``run_block(rows, slot_counts)`` returns the outputs of the
    block's experts for ``rows`` [slots of the block, hidden], grouped by expert.

    The chunks are all-gathered, every rank routes all tokens (identically: the same tokens, capacity and load
    statistics as without sequence_parallel), runs its block's experts on their slots and combines their outputs
    into partial sums [batch, seq, hidden]; one reduce-scatter adds the ranks' partial sums and leaves each rank its
    chunk (no all-reduce of the [tokens x k, hidden] slot outputs).

    Gradients: the all-gather's backward adds the ranks' gradients of the gathered tokens, which through the experts
    are partial (this rank's experts only) and through the router whole on every rank, so the router's input
    gradient is divided by T first (``_ScaleGradient``); the combine weights' gradients are partial and summed over
    the ranks (copy_to_model_parallel_region), so the router's own gradients are whole and equal on every rank, as
    without sequence_parallel."""
    tp = group_size(group)
    full = gather_from_sequence_parallel_region(x, group, seq_dim=1)
    tokens = full.reshape(-1, full.shape[-1])
    routing, aux, order, counts, token_of_slot = route(router, _ScaleGradient.apply(tokens, 1.0 / tp), num_experts,
                                                       top_k)
    routing = dataclasses.replace(routing, weights=copy_to_model_parallel_region(routing.weights, group))
    slot_counts = read_counts(counts)
    start, stop = slot_counts.span(block)
    mine = token_of_slot[start:stop]
    local_out = run_block(tokens[mine], slot_counts)
    partial = combine(tokens, routing, order[start:stop], mine, local_out)
    out = reduce_scatter_to_sequence_parallel_region(partial.view(full.shape), group, seq_dim=1)
    return out, aux, counts, float(order.numel())


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None
