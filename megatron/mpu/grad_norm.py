"""The L2 norm of a model's whole gradient, and clipping by it, when its parameters are spread over ranks.

Why not DeepSpeed's: without ZeRO, DeepSpeed's clip_grad_norm_ averages each data-parallel rank's own norm. That is
the norm when every data-parallel rank holds the same parameters, but with expert parallelism each rank of an
expert-parallel group holds other experts, and the average of their norms is no norm of the whole gradient: the
clipping (and the logged norm) would change with moe_expert_parallel_size. Here, once the gradients are reduced:

* a tensor-parallel shard (``model_parallel`` / ``tensor_model_parallel``) is counted on every tensor-parallel rank,
  a replicated parameter on tensor-parallel rank 0 only (summed over the model-parallel group);
* an expert parameter (DeepSpeed's mark: ``allreduce`` false) is summed over the expert-parallel group, whose
  ranks hold different experts; the expert-data-parallel ranks hold the same ones and count them once each;
* under DeepSpeed's pipeline engine (``pipeline_group``: its model-parallel group, every stage and tensor rank of
  one data-parallel index) a parameter counts where megatron.training.loop marked it ``model_parallel`` (the tied
  copies once), and the sum runs over that group.
"""
from __future__ import annotations

from typing import Iterable, List

import torch

from megatron.mpu.host_collectives import all_reduce


def is_expert_parameter(param: torch.nn.Parameter) -> bool:
    """DeepSpeed's is_moe_param: marked ``allreduce = False`` (deepspeed.moe.experts.Experts sets it)."""
    return hasattr(param, "allreduce") and not param.allreduce


def _sum_of_squares(grads: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared L2 norm (fp32, one element) of ``grads`` together, computed on ``device`` without a host sync."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    # one multi-tensor kernel for all per-tensor norms (as torch.nn.utils.clip_grad_norm_ does), fp32 for bf16 too
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
    return torch.stack([n.to(device, non_blocking=True) for n in norms]).square().sum().reshape(1)


def global_grad_norm(parameters: Iterable[torch.nn.Parameter], parallel_state, pipeline_group=None) -> torch.Tensor:
    """The L2 norm (fp32, one element, on the gradients' device) of the gradient of every parameter of the model
    (module docstring); collective over the model-parallel (or ``pipeline_group``) and expert-parallel groups, each
    run on its group's device (megatron.mpu.host_collectives). Nothing waits for the device: read the norm when it
    is needed (the training logger does, every log_interval steps)."""
    shared, experts = [], []
    device = None
    tp_rank0 = parallel_state.get_model_parallel_rank() == 0
    for param in parameters:
        if param.grad is None:
            continue
        if device is None:
            device = param.grad.device
        split = getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False)
        if (getattr(param, "model_parallel", False) if pipeline_group is not None else split or tp_rank0):
            (experts if is_expert_parameter(param) else shared).append(param.grad)
    if device is None:
        device = torch.device("cpu")
    total = _sum_of_squares(shared, device)
    expert_squares = _sum_of_squares(experts, device)
    if parallel_state.get_expert_parallel_world_size() > 1:
        expert_squares = all_reduce(expert_squares, group=parallel_state.get_expert_parallel_group())
    total = total + expert_squares
    if pipeline_group is not None:
        total = all_reduce(total, group=pipeline_group)
    elif parallel_state.get_model_parallel_world_size() > 1:
        total = all_reduce(total, group=parallel_state.get_model_parallel_group())
    return total.sqrt()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, parallel_state,
                   pipeline_group=None) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), DeepSpeed's rule, with ``global_grad_norm``;
    returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(parameters, parallel_state, pipeline_group)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for param in parameters:
        param.grad.detach().mul_(scale.to(param.grad.device, param.grad.dtype))
    return norm
