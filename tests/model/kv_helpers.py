"""Decode a batch token by token (after a prompt) through an explicit KVCache."""

import torch

from megatron.model.kv_cache import KVCache


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


def assert_decoding_matches_full_forward(model, prompt: int = 5) -> None:
    """A prompt forward then one token at a time through the KV cache gives the logits of one full forward."""
    from tests.model.helpers import random_batch

    inputs, _ = random_batch()
    with torch.no_grad():
        full = model(inputs)
        step = incremental_logits(model, inputs[0], prompt=prompt)
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
