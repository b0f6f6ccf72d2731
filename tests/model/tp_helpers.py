"""Compare a tensor-parallel model with its TP=1 twin: which slice of each full tensor a rank holds."""

from typing import Dict

import torch
from torch import nn

from megatron.model.moe.layer import GroupedExperts
from megatron.model.positional import RelativePositionBias
from megatron.mpu import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard_of
from megatron.mpu.lora import LoRAAdapter


def shard_specs(model: nn.Module) -> Dict[str, tuple]:
    """{parameter name: (dim, chunks)} for split parameters; missing names are replicated."""
    specs = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, VocabParallelEmbedding):
            specs[prefix + "weight"] = (0, 1)
        elif isinstance(module, ColumnParallelLinear):
            specs[prefix + "weight"] = (0, module.chunks)
            specs[prefix + "bias"] = (0, module.chunks)
        elif isinstance(module, RowParallelLinear):
            specs[prefix + "weight"] = (1, module.chunks)
        elif isinstance(module, LoRAAdapter):  # the factor split as its base layer is split
            specs[prefix + ("lora_B" if module.column else "lora_A")] = (0 if module.column else 1, module.chunks)
        elif isinstance(module, RelativePositionBias):
            specs[prefix + "weight"] = (1, 1)
        elif isinstance(module, GroupedExperts):  # the MoE experts: rows, whole experts per rank
            for name, _ in module.named_parameters(recurse=False):
                specs[prefix + name] = (0, 1)
    return specs


def expected_local(full_model: nn.Module, tp_model: nn.Module, rank: int, world: int, grads: bool):
    """{name: (this rank's slice of the TP=1 tensor, the TP model's tensor)} for every parameter."""
    specs = shard_specs(tp_model)
    full = dict(full_model.named_parameters())
    pairs = {}
    for name, param in tp_model.named_parameters():
        if grads and not param.requires_grad:  # frozen (LoRA's base): no gradient on either side
            continue
        ref = full[name].grad if grads else full[name].detach()
        mine = param.grad if grads else param.detach()
        if name in specs:
            dim, chunks = specs[name]
            ref = shard_of(ref, dim, rank, world, chunks)
        elif ref.shape != mine.shape:  # a plain tensor split along one dim (Mamba's conv1d, RWKV's time_decay)
            dim = next(i for i, (a, b) in enumerate(zip(ref.shape, mine.shape)) if a != b)
            ref = shard_of(ref, dim, rank, world)
        pairs[name] = (ref, mine)
    return pairs


def gather_vocab(logits: torch.Tensor, group) -> torch.Tensor:
    from megatron.mpu import gather_from_model_parallel_region

    return gather_from_model_parallel_region(logits.detach(), group)
