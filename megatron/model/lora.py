"""LoRA on the model (the `lora` config section, megatron.model.lora_settings): adapters attached to the targeted
tensor-parallel linear layers of the chosen transformer layers (megatron.mpu.lora), every other parameter frozen.

Frozen parameters (``requires_grad`` False) are left out of the optimizer's groups (megatron.optim.param_groups), so
its state holds the adapters only. Adapter parameters are named ``<layer>.<target>.lora.lora_A`` / ``lora_B``.

With activation checkpointing the embedding's output is made to require a gradient (as peft's
``enable_input_require_grads``): DeepSpeed's checkpoint gives its output a gradient only when an input has one, and
the frozen embedding's output has none, so the adapters inside the checkpointed layers would get no gradient (the
backward failed: "element 0 of tensors does not require grad")."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Tuple

import torch
from torch import nn

from megatron.model.config import ModelConfig
from megatron.model.embedding import Embedding
from megatron.model.lora_settings import TARGET_MODULES
from megatron.mpu import ColumnParallelLinear
from megatron.mpu.lora import LoRAAdapter

LORA_PARAMETER_MARK = ".lora.lora_"
"""In the name of every adapter parameter (and of no other)."""
LORA_SEED_OFFSET = 7919
"""Added to the model's seed for the adapters' A (one generator per adapter: layer and target)."""


def is_lora_parameter(name: str) -> bool:
    return LORA_PARAMETER_MARK in name


def lora_targets(model: nn.Module, config: ModelConfig) -> Iterator[Tuple[int, str, nn.Module, nn.Module]]:
    """(layer number, target name, its linear layer, the transformer layer holding it) for every layer the lora
    section adapts."""
    settings = config.lora_dict
    layers = settings["layers_to_transform"]
    seen = set()
    for module in model.modules():
        number = getattr(module, "layer_number", None)
        if number is None or not hasattr(module, "attention") or (layers is not None and number not in layers):
            continue
        for target in settings["target_modules"]:
            linear = module.get_submodule(TARGET_MODULES[target])
            if id(linear) not in seen:  # a layer shared by several (num_unique_layers) gets one adapter
                seen.add(id(linear))
                yield number, target, linear, module


def apply_lora(model: nn.Module, config: ModelConfig, parallel_state) -> nn.Module:
    """Attach the adapters of ``config.lora`` (None: the model is returned as it is) and freeze the rest."""
    settings = config.lora_dict
    if settings is None:
        return model
    for param in model.parameters():
        param.requires_grad = False
    group = parallel_state.get_model_parallel_group()
    tp_rank, tp_world = parallel_state.get_model_parallel_rank(), parallel_state.get_model_parallel_world_size()
    order = list(TARGET_MODULES)
    for number, target, linear, layer in lora_targets(model, config):
        column = isinstance(linear, ColumnParallelLinear)
        linear.lora = LoRAAdapter(
            linear.input_size, linear.output_size, settings["r"], settings["alpha"], settings["dropout"], column,
            group, tp_rank, tp_world, seed=config.seed + LORA_SEED_OFFSET + number * len(order) + order.index(target),
            chunks=linear.chunks, rng_tracker=layer.rng_tracker)
    if config.checkpoint_activations:
        for module in model.modules():
            if isinstance(module, Embedding):
                module.register_forward_hook(_output_requires_grad)
    return model


def _output_requires_grad(module: nn.Module, inputs: Any, output: Tuple[torch.Tensor, Any]) -> None:
    """Forward hook on the embedding: its (hidden, mask) output's hidden requires a gradient while training."""
    if module.training and torch.is_grad_enabled() and not output[0].requires_grad:
        output[0].requires_grad_(True)


def lora_state(model: nn.Module) -> Dict[str, nn.Parameter]:
    """The adapters' parameters by name (this rank's shards)."""
    return {name: param for name, param in model.named_parameters() if is_lora_parameter(name)}


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing its frozen base alone (every adapter detached from its linear layer, and put back on
    exit): DPO / KTO's reference under LoRA (megatron.post_training.reference.AdapterFreeReference), without a
    second copy of the weights."""
    adapted = [(module, module.lora) for module in model.modules() if getattr(module, "lora", None) is not None]
    try:
        for module, _ in adapted:
            module.lora = None
        yield model
    finally:
        for module, adapter in adapted:
            module.lora = adapter
