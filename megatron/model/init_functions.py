"""Weight initialisation that does not depend on the parallel layout.

Every parameter gets its own generator, seeded from ``(seed, layer index, parameter name)``; the
tensor-parallel layers fill the *full* tensor from it and keep their shard. So a given seed yields the
same full weights for any model_parallel_size / pipe_parallel_size, and a run's loss curve does not
depend on the cluster's shape. Tensors are built one at a time, so peak extra memory is one full tensor.

Methods (``init_method`` / ``output_layer_init_method``), with sigma = init_method_std, L = num_layers,
d = hidden_size:
  normal                          N(0, sigma)
  scaled_normal                   N(0, sigma / sqrt(2 L))
  single_residual_scaled_normal   N(0, sigma / sqrt(L))
  orthogonal                      (semi-)orthogonal, gain 2
  scaled_orthogonal               (semi-)orthogonal, gain 2 / sqrt(L)
  xavier_uniform / xavier_normal  Glorot, gain 1
  wang_init                       N(0, 2 / (L sqrt(d)))
  small_init                      N(0, sqrt(2 / (5 d)))
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable

import torch

from megatron.model.config import INIT_METHODS, ModelConfig

GeneratorInit = Callable[[torch.Tensor, torch.Generator], None]
InitFn = Callable[[torch.Tensor], None]


def tensor_seed(seed: int, layer_index: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{layer_index}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def get_init_method(name: str, sigma: float, num_layers: int, hidden_size: int) -> GeneratorInit:
    """The init function called ``name`` (see module docstring); raises ValueError for unknown names."""
    def normal(std: float) -> GeneratorInit:
        return lambda t, g: torch.nn.init.normal_(t, 0.0, std, generator=g)

    if name == "normal":
        return normal(sigma)
    if name == "scaled_normal":
        return normal(sigma / math.sqrt(2.0 * num_layers))
    if name == "single_residual_scaled_normal":
        return normal(sigma / math.sqrt(num_layers))
    if name == "orthogonal":
        return lambda t, g: torch.nn.init.orthogonal_(t, gain=2.0, generator=g)
    if name == "scaled_orthogonal":
        return lambda t, g: torch.nn.init.orthogonal_(t, gain=2.0 / math.sqrt(num_layers), generator=g)
    if name == "xavier_uniform":
        return lambda t, g: torch.nn.init.xavier_uniform_(t, generator=g)
    if name == "xavier_normal":
        return lambda t, g: torch.nn.init.xavier_normal_(t, generator=g)
    if name == "wang_init":
        return normal(2.0 / num_layers / math.sqrt(hidden_size))
    if name == "small_init":
        return normal(math.sqrt(2.0 / (5.0 * hidden_size)))
    raise ValueError(f"init method {name!r} is not supported; choose from {', '.join(INIT_METHODS)}")


class Initializer:
    """Hands out per-tensor init functions for one model, all derived from ``config.seed``."""

    def __init__(self, config: ModelConfig) -> None:
        self.seed = int(config.seed)
        sigma, layers, hidden = float(config.init_method_std), int(config.num_layers), int(config.hidden_size)
        self.default = get_init_method(config.init_method, sigma, layers, hidden)
        self.output = get_init_method(config.output_layer_init_method, sigma, layers, hidden)

    def _bind(self, method: GeneratorInit, layer_index: int, name: str) -> InitFn:
        seed = tensor_seed(self.seed, layer_index, name)

        def init(tensor: torch.Tensor) -> None:
            method(tensor, torch.Generator().manual_seed(seed))

        return init

    def weight(self, layer_index: int, name: str) -> InitFn:
        """Init for an ordinary weight (``init_method``)."""
        return self._bind(self.default, layer_index, name)

    def output_weight(self, layer_index: int, name: str) -> InitFn:
        """Init for a residual-output weight (``output_layer_init_method``)."""
        return self._bind(self.output, layer_index, name)

    def custom(self, layer_index: int, name: str, method: GeneratorInit) -> InitFn:
        """Init by a layer's own rule (Mamba's dt and conv, RWKV's time-mix tables), seeded like the others."""
        return self._bind(method, layer_index, name)
