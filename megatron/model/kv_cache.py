"""An explicit key/value cache for incremental decoding.

The cache is created by the caller and passed into the model's forward; layers write their keys and
values at the cache's current length and read everything before it. Nothing is stored in the layers.
After a forward over ``s`` new tokens the model advances the cache by ``s``. Keys are stored after
rotary rotation, so later queries at absolute positions ``length + i`` see correct relative offsets.
Shapes are per rank: [batch, local kv heads, max_length, head_dim].
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


class KVCache:
    def __init__(self, max_length: int) -> None:
        self.max_length = int(max_length)
        self.length = 0
        self._kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` [b, kv_heads, s, d] at positions length..length+s of ``layer`` and
        return the keys/values of positions 0..length+s."""
        b, h, s, d = key.shape
        end = self.length + s
        if end > self.max_length:
            raise ValueError(f"KV cache overflow: {end} positions > max_length {self.max_length}")
        if layer not in self._kv:
            shape = (b, h, self.max_length, d)
            self._kv[layer] = (key.new_empty(shape), value.new_empty(shape))  # read only up to length
        keys, values = self._kv[layer]
        keys[:, :, self.length:end] = key.detach()
        values[:, :, self.length:end] = value.detach()
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as filled (called once per model forward)."""
        self.length += int(num_tokens)

    def reset(self) -> None:
        self.length = 0
        self._kv.clear()
