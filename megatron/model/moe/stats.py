"""What the MoE layers add to training besides their output: the auxiliary loss's gradient and the expert load.

Auxiliary loss. Each MoE layer's load-balancing loss enters the backward pass where it is computed: the layer's
output passes through ``AttachAuxLoss``, whose backward gives the loss the gradient ``moe_loss_coeff x scale``. The
result is the gradient of ``lm_loss + moe_loss_coeff x sum(layer losses)`` without carrying the losses to the loss
function: it works the same on every pipeline stage and under activation checkpointing (whose first forward runs
without gradients; the recomputation attaches the loss). ``scale`` is what the engine applies to the LM loss before
its backward (1 / gradient_accumulation_steps, times the fp16 loss scale), set by the training loop with
``set_aux_loss_scale``.

Expert load. Each layer counts, over the training forwards since the last report, the (token, choice) slots routed
to each expert (before any capacity drop), the slots kept, and its auxiliary loss; ``moe_metrics`` sums them over all
ranks (one all-reduce) for the logger. Recomputed forwards (activation checkpointing, inside the backward) and
evaluation forwards are not counted. The counters are added up on the layer's device and read on the host only
when reported: counting never makes a forward wait for the device.
"""
from __future__ import annotations

from typing import Dict, List, Union

import torch
from torch import nn

from megatron.mpu.host_collectives import all_reduce


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in the backward, ``aux`` gets the gradient ``grad`` (a float)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, grad: float) -> torch.Tensor:
        ctx.grad = grad
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.grad, dtype=ctx.aux_dtype, device=grad_output.device)
        return grad_output, aux_grad, None


def in_backward() -> bool:
    """True inside an autograd backward pass (where activation checkpointing recomputes forwards)."""
    return torch._C._current_graph_task_id() != -1


class ExpertLoad:
    """Counters of one MoE layer since the last report (module docstring)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.routed = torch.zeros(self.num_experts, dtype=torch.float64)
        self.kept: Union[float, torch.Tensor] = 0.0
        self.aux_sum: Union[float, torch.Tensor] = 0.0
        self.forwards = 0

    def record(self, routed: torch.Tensor, kept: Union[float, torch.Tensor], aux: torch.Tensor) -> None:
        """Adds one forward's counts where they are: tensors stay on the layer's device (in float64), so a training
        forward never waits for the device to count; ``moe_metrics`` reads the totals when it reports."""
        routed, aux = routed.detach().to(torch.float64), aux.detach().to(torch.float64)
        kept = kept.detach().to(torch.float64) if torch.is_tensor(kept) else float(kept)
        if self.forwards == 0:  # start from this forward's values: no host zeros copied to the device
            self.routed, self.kept, self.aux_sum = routed, kept, aux
        else:
            self.routed, self.kept, self.aux_sum = self.routed + routed, self.kept + kept, self.aux_sum + aux
        self.forwards += 1


class MoELayerBase(nn.Module):
    """What both MoE layers share: the auxiliary-loss attachment and the load counters (``setup_stats`` after
    nn.Module's __init__, so that it also mixes into DeepSpeed's MoE class)."""

    def setup_stats(self, num_experts: int, layer_number: int, loss_coeff: float) -> None:
        self.layer_number = layer_number
        self.loss_coeff = float(loss_coeff)
        self.aux_loss_scale = 1.0
        self.load = ExpertLoad(num_experts)

    def _finish(self, output: torch.Tensor, aux: torch.Tensor, routed: torch.Tensor,
                kept: Union[float, torch.Tensor]) -> torch.Tensor:
        if self.training and not in_backward():
            self.load.record(routed, kept, aux)
        if self.training and aux.requires_grad and self.loss_coeff > 0:
            output = AttachAuxLoss.apply(output, aux, self.loss_coeff * self.aux_loss_scale)
        return output

    def forward_with_bias(self, x: torch.Tensor):
        """(output, None): the layer adds its own biases (for bias_dropout_fusion's call)."""
        return self(x), None


def moe_layers(model: nn.Module) -> List[MoELayerBase]:
    return [m for m in model.modules() if isinstance(m, MoELayerBase)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """The factor the engine applies to the LM loss before its backward (module docstring)."""
    for layer in moe_layers(model):
        layer.aux_loss_scale = float(scale)


def moe_metrics(model: nn.Module, num_layers: int, num_experts: int, loss_coeff: float, iterations: int,
                tensor_parallel_size: int = 1, group=None) -> Dict[str, float]:
    """The expert load since the last call, over all ranks, then the counters are reset (collective over ``group``,
    default the world: every rank must call it).

    ``moe_aux_loss``: moe_loss_coeff x the sum over MoE layers of their mean load-balancing loss (what the
    training adds to the LM loss); per MoE layer i: ``moe_tokens/layer_{i:02d}/expert_{e:02d}`` the slots routed to
    expert e per iteration (summed over data-parallel ranks), ``moe_dropped/layer_{i:02d}`` the fraction of slots
    dropped by the capacity limit, ``moe_load_max/layer_{i:02d}`` the busiest expert's slots over the mean (1 is
    perfectly balanced)."""
    width = num_experts + 3
    table = torch.zeros(num_layers, width, dtype=torch.float64)
    present = set()
    for layer in moe_layers(model):
        load = layer.load
        table[layer.layer_number, :num_experts] = load.routed
        table[layer.layer_number, num_experts:] = torch.tensor(
            [float(load.kept), float(load.aux_sum), float(load.forwards)], dtype=torch.float64)  # read back here
        present.add(layer.layer_number)
        load.reset()
    table = all_reduce(table, group=group)  # on the group's device, back on the CPU
    table /= max(tensor_parallel_size, 1)  # tensor-parallel ranks count the same tokens
    metrics: Dict[str, float] = {}
    aux_total = 0.0
    any_layer = False
    for i in range(num_layers):
        routed, kept, aux_sum, forwards = table[i, :num_experts], table[i, num_experts], table[i, -2], table[i, -1]
        if forwards <= 0:
            continue
        any_layer = True
        slots = float(routed.sum())
        aux_total += float(aux_sum / forwards)
        for e in range(num_experts):
            metrics[f"moe_tokens/layer_{i:02d}/expert_{e:02d}"] = float(routed[e]) / max(iterations, 1)
        metrics[f"moe_dropped/layer_{i:02d}"] = 1.0 - float(kept) / slots if slots else 0.0
        metrics[f"moe_load_max/layer_{i:02d}"] = float(routed.max()) / (slots / num_experts) if slots else 0.0
    if any_layer:
        metrics["moe_aux_loss"] = loss_coeff * aux_total
    return metrics
