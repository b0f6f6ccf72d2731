"""MLP activation functions, plain and gated (GLU family).

Gated activations take the fused projection [up | gate] (two equal halves of the last dimension,
``up`` first) and return ``act(gate) * up``: geglu (gelu), reglu (relu), swiglu (silu), bilinear
(identity), glu (sigmoid). swish is x * sigmoid(x) (equal to silu).

onnx_safe (GPT-NeoX's and Megatron-LM's key): the GeLU of gelu and geglu is written out as
x * 0.5 * (1 + erf(x / sqrt(2))) (``erf_gelu``), the same function as F.gelu's exact form, built from elementwise ops
that every ONNX opset has (ONNX gained a Gelu operator only in opset 20); that swap is all the key does in
GPT-NeoX (megatron/model/activations.py), and as there it cannot be combined with bias_gelu_fusion (a fused kernel).
"""
from __future__ import annotations

import math
from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from megatron.model.config import GATED_ACTIVATIONS, PLAIN_ACTIVATIONS

Activation = Callable[[torch.Tensor], torch.Tensor]

_PLAIN = {
    "gelu": F.gelu,
    "relu": F.relu,
    "softsign": F.softsign,
    "swish": lambda x: x * torch.sigmoid(x),
    "mish": F.mish,
    "silu": F.silu,
}
_GATED = {
    "geglu": F.gelu,
    "reglu": F.relu,
    "swiglu": F.silu,
    "bilinear": lambda x: x,
    "glu": torch.sigmoid,
}


assert tuple(_PLAIN) == PLAIN_ACTIVATIONS and tuple(_GATED) == GATED_ACTIVATIONS, "one list of activations"


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """F.gelu (exact) from erf, multiply and add: exportable to any ONNX opset (onnx_safe)."""
    return x * 0.5 * (torch.erf(x * (1.0 / math.sqrt(2.0))) + 1.0)


def _onnx_safe(act: Activation) -> Activation:
    """``act`` with F.gelu replaced by erf_gelu."""
    return erf_gelu if act is F.gelu else act


def gated(act: Activation) -> Activation:
    """Wrap ``act`` into the GLU form on an [up | gate] input."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        up, gate = x.chunk(2, dim=-1)
        return act(gate) * up

    return apply


def elementwise_activation(name: str, onnx_safe: bool = False) -> Tuple[Activation, bool]:
    """(the elementwise function, whether ``name`` is a GLU) before gating: experts apply it to their own halves."""
    if name in _PLAIN:
        act, is_gated = _PLAIN[name], False
    elif name in _GATED:
        act, is_gated = _GATED[name], True
    else:
        raise ValueError(f"activation={name!r} is not supported; choose from "
                         f"{', '.join(list(_PLAIN) + list(_GATED))}")
    return (_onnx_safe(act) if onnx_safe else act), is_gated


def get_activation(name: str, onnx_safe: bool = False) -> Tuple[Activation, bool]:
    """(function, is_gated) for ``config.activation`` (``onnx_safe``: GeLU as erf_gelu); ValueError for unknown
    names."""
    act, is_gated = elementwise_activation(name, onnx_safe)
    return (gated(act) if is_gated else act), is_gated
