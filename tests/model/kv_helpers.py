"""Decode a batch token by token (after a prompt) through an explicit KVCache."""

import torch

from megatron.model import KVCache


def incremental_logits(model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits of ``tokens`` computed as one prompt forward then one token at a time."""
    cache = KVCache(max_length=tokens.size(1))
    b = tokens.size(0)
    outs = []
    for start, end in [(0, prompt)] + [(i, i + 1) for i in range(prompt, tokens.size(1))]:
        pos = torch.arange(start, end, device=tokens.device).unsqueeze(0).expand(b, -1)
        outs.append(model((tokens[:, start:end], pos, None), kv_cache=cache))
    assert cache.length == tokens.size(1)
    return torch.cat(outs, dim=1)
