"""MLP activation functions, plain and gated (GLU family).

Gated activations take the fused projection [up | gate] (two equal halves of the last dimension,
``up`` first) and return ``act(gate) * up``: geglu (gelu), reglu (relu), swiglu (silu), bilinear
(identity), glu (sigmoid). swish is x * sigmoid(x) (equal to silu).
"""
from __future__ import annotations

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


def gated(act: Activation) -> Activation:
    """Wrap ``act`` into the GLU form on an [up | gate] input."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        up, gate = x.chunk(2, dim=-1)
        return act(gate) * up

    return apply


def get_activation(name: str) -> Tuple[Activation, bool]:
    """(function, is_gated) for ``config.activation``; ValueError for unknown names."""
    if name in _PLAIN:
        return _PLAIN[name], False
    if name in _GATED:
        return gated(_GATED[name]), True
    raise ValueError(f"activation={name!r} is not supported; choose from "
                     f"{', '.join(list(_PLAIN) + list(_GATED))}")
