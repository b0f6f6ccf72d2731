"""What Mamba and RWKV layers share: the pad slots of a decoding forward and the residual dropout."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.model.kv_cache import KVCache


def pad_mask(cache: Optional[KVCache], hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """[b, s] bool, True at the left-padding slots of ``hidden`` [b, s, ...] (``KVCache.padding``), or None."""
    if cache is None or cache.padding is None:
        return None
    pads = cache.padding.to(hidden.device)
    if pads.shape != hidden.shape[:2]:
        raise ValueError(f"KVCache.padding has shape {tuple(pads.shape)} but the forward's tokens are "
                         f"{tuple(hidden.shape[:2])}; set_padding must describe the next forward's tokens")
    return pads


def hidden_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """hidden_dropout on a block's output (the default RNG stream: activations are replicated over TP ranks)."""
    if not training or p == 0.0:
        return x
    return F.dropout(x, p=p, training=True)
