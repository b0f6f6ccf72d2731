"""muP's per-parameter side: base shapes of a model, the initialisation, the optimizer's groups.

Each trainable parameter gets an InfShape (megatron.mup.shapes) as its ``mup_infshape`` attribute. From it:
  * initialisation (``mup_initialize``, on a freshly built model, before a checkpoint would be loaded): every
    weight (2-D and up) x mup_init_scale; matrix-like weights (two width dimensions: the attention and MLP
    projections) x fan-in multiplier^-1/2 (mup's init.normal_); the untied output head x width multiplier^1/2
    (mup's MuReadout._rescale_parameters, since the head also divides its input by the multiplier);
  * learning rates and weight decay (``mup_param_groups``, megatron.optim.optimizers): for the Adams, matrix-like
    weights learn at lr / fan-in multiplier with weight decay x the multiplier (mup's MuAdam); for SGD,
    vector-like parameters at lr x width multiplier (weight decay / it) and matrix-like at lr / (fan-in / fan-out
    multiplier) (weight decay x it) (mup's MuSGD). The factors sit in each group's ``lr_mult`` / ``wd_mult``,
    which the LR schedule (megatron.optim.learning_rates) applies every step.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch import nn

from megatron.mup.shapes import BaseShapes, InfShape, infshapes, make_base_shapes

INFSHAPE_ATTR = "mup_infshape"
READOUT_WEIGHT = "final_linear.weight"
ADAM_KINDS = ("adam", "cpu_adam", "cpu_torch_adam")


def named_parameters(model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """The model's parameters under their sequential-model names (GPT2ModelPipe's are mapped), each once."""
    rename = getattr(type(model), "sequential_name", None)
    for name, param in model.named_parameters():
        yield (rename(name) if rename is not None else name), param


def whole_shape(param: torch.Tensor, tensor_parallel: int) -> Tuple[int, ...]:
    """The shape of the whole tensor a tensor-parallel shard belongs to."""
    shape = list(param.shape)
    if getattr(param, "model_parallel", False):
        dim = getattr(param, "partition_dim", None)
        if dim is None:
            raise ValueError(f"a tensor-parallel parameter of shape {tuple(param.shape)} does not say which "
                             f"dimension is split (partition_dim): muP cannot tell its whole shape")
        shape[dim] *= tensor_parallel
    return tuple(shape)


def parameter_shapes(model: nn.Module, tensor_parallel: int = 1) -> Dict[str, Tuple[int, ...]]:
    """name -> whole shape of every parameter of ``model``."""
    return {name: whole_shape(param, tensor_parallel) for name, param in named_parameters(model)}


def base_shapes_of(base: nn.Module, delta: nn.Module, tensor_parallel: int = 1) -> BaseShapes:
    """The base shapes of a base-width model and a wider copy of it (save_base_shapes)."""
    return make_base_shapes(parameter_shapes(base, tensor_parallel), parameter_shapes(delta, tensor_parallel))


def set_base_shapes(model: nn.Module, base: BaseShapes, path: str, tensor_parallel: int = 1) -> Dict[str, InfShape]:
    """Attach each parameter's InfShape (``mup_infshape``); BaseShapesError when ``base`` is another model's."""
    whole = getattr(model, "num_stages", 1) == 1  # a pipeline stage holds part of the model
    shapes = infshapes(parameter_shapes(model, tensor_parallel), base, path, whole=whole)
    for name, param in named_parameters(model):
        setattr(param, INFSHAPE_ATTR, shapes[name])
    return shapes


def mup_initialize(model: nn.Module, init_scale: float = 1.0) -> None:
    """Turn the model's standard initialisation into muP's (module docstring); needs ``set_base_shapes``."""
    with torch.no_grad():
        for name, param in named_parameters(model):
            shape: InfShape = getattr(param, INFSHAPE_ATTR)
            if param.dim() < 2:
                continue  # norms and biases keep their constant initialisation
            factor = init_scale
            if shape.ninf == 2:
                factor *= shape.width_mult ** -0.5
            elif name.endswith(READOUT_WEIGHT):
                factor *= shape.width_mult ** 0.5
            if factor != 1.0:
                param.mul_(factor)


def mup_param_groups(groups: List[Dict[str, Any]], optimizer_kind: str) -> List[Dict[str, Any]]:
    """``groups`` split by muP's learning-rate factor (module docstring), factors in lr_mult / wd_mult.

    Groups whose parameters carry no base shapes are returned as they are (the model was built without muP)."""
    if not any(hasattr(p, INFSHAPE_ATTR) for g in groups for p in g["params"]):
        return groups
    if optimizer_kind not in ADAM_KINDS + ("sgd",):
        raise ValueError(f"use_mup has no learning-rate rule for optimizer type {optimizer_kind!r}; use Adam or SGD")
    split: List[Dict[str, Any]] = []
    for group in groups:
        buckets: Dict[Tuple[float, float], List[nn.Parameter]] = {}
        for param in group["params"]:
            lr_mult, wd_mult = _factors(getattr(param, INFSHAPE_ATTR), optimizer_kind)
            buckets.setdefault((lr_mult, wd_mult), []).append(param)
        for (lr_mult, wd_mult), params in sorted(buckets.items(), key=lambda kv: -kv[0][0]):
            new = {**{k: v for k, v in group.items() if k != "params"}, "params": params}
            if lr_mult != 1.0:
                new["lr_mult"] = group.get("lr_mult", 1.0) * lr_mult
            if wd_mult != 1.0 and group.get("weight_decay", 0.0) > 0:
                new["wd_mult"] = group.get("wd_mult", 1.0) * wd_mult
                new["weight_decay"] = group["weight_decay"] * wd_mult
            split.append(new)
    return split


def _factors(shape: InfShape, optimizer_kind: str) -> Tuple[float, float]:
    """(learning-rate factor, weight-decay factor) of one parameter: mup's MuAdam / MuSGD rules."""
    if shape.ninf > 2:
        raise ValueError("muP has no rule for parameters with more than two width dimensions")
    if optimizer_kind in ADAM_KINDS:
        m = shape.width_mult if shape.ninf == 2 else 1.0
        return 1.0 / m, m
    if shape.ninf == 1:
        m = shape.width_mult
        return m, 1.0 / m
    if shape.ninf == 2:
        ratio = shape.fanin_fanout_ratio
        return 1.0 / ratio, ratio
    return 1.0, 1.0
