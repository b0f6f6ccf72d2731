"""The decoding state of every layer, passed explicitly into the model's forward: attention keys/values,
Mamba's convolution window and SSM state, RWKV's token-shift vectors and WKV state.

The state is created by the caller (``KVCache(max_length)``) and handed to the model's forward; nothing is
kept in the layers. After a forward over ``s`` new tokens the model advances it by ``s``.

* Attention layers write their keys and values at the cache's current length and read everything before
  it (``update``). Keys are stored after rotary rotation, so later queries at absolute positions
  ``length + i`` see correct relative offsets. Shapes are per rank: [batch, local kv heads, max_length,
  head_dim]. Memory grows with ``max_length``.
* Recurrent layers (Mamba, RWKV) keep a fixed-size state per layer (``recurrent_state`` /
  ``set_recurrent_state``, a tuple of tensors each layer defines), so decoding a token costs the same at
  any context length.
* ``padding`` ([batch, s] bool, True at the pad slots of the tokens of the next forward; None when there
  are none) tells recurrent layers which slots to leave out of their state. Attention layers hide pad
  slots through the attention mask instead; a recurrent layer has no mask to apply, so the caller that
  left-pads a batch (megatron.inference.text_generation) sets it before each forward.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

RecurrentState = Tuple[torch.Tensor, ...]


class KVCache:
    """Per-layer decoding state (see module docstring); also called the model's decode state."""

    def __init__(self, max_length: int) -> None:
        self.max_length = int(max_length)
        self.length = 0
        self.padding: Optional[torch.Tensor] = None
        self._kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._recurrent: Dict[int, RecurrentState] = {}

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

    def recurrent_state(self, layer: int) -> Optional[RecurrentState]:
        """The state ``layer`` stored after the previous forward, or None before its first one."""
        return self._recurrent.get(layer)

    def set_recurrent_state(self, layer: int, state: RecurrentState) -> None:
        """Replace ``layer``'s state (detached: decoding never back-propagates into earlier forwards)."""
        self._recurrent[layer] = tuple(t.detach() for t in state)

    def set_padding(self, padding: Optional[torch.Tensor]) -> None:
        """Mark the pad slots ([batch, s] bool, True = pad) of the next forward's tokens; None: no padding."""
        self.padding = None if padding is None or not bool(padding.any()) else padding.to(torch.bool)

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more positions as filled (called once per model forward)."""
        self.length += int(num_tokens)

    def reset(self) -> None:
        self.length = 0
        self.padding = None
        self._kv.clear()
        self._recurrent.clear()


DecodeState = KVCache
"""The same object under the name that says what it holds for recurrent layers."""


class LayerKeyedCache:
    """A KVCache seen through another layer key: a parameter-shared layer (num_unique_layers) runs at several
    positions but keys its state by its own layer_number, so each position hands it this view, which stores
    under the position's key whatever key the layer passes. Everything else is the cache's."""

    def __init__(self, cache: KVCache, key: int) -> None:
        self._cache, self._key = cache, key

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(self._key, key, value)

    def recurrent_state(self, layer: int) -> Optional[RecurrentState]:
        return self._cache.recurrent_state(self._key)

    def set_recurrent_state(self, layer: int, state: RecurrentState) -> None:
        self._cache.set_recurrent_state(self._key, state)

    def __getattr__(self, name: str):
        return getattr(self._cache, name)
