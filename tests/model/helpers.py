"""Shared bits for model tests: a tiny ModelConfig and a random batch in GPT-NeoX format."""

import math

import torch

from megatron.model.batch import masks_and_position_ids
from megatron.model.config import ModelConfig

TINY_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, padded_vocab_size=128)
"""A 2-layer, hidden-32, 4-head, seq-16, vocab-128 model; the rest are ModelConfig's (GPT-NeoX's) defaults."""


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_MODEL, **overrides})


def random_batch(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 0):
    """((tokens, position_ids, attention_mask), (labels, loss_mask)) from seeded random text."""
    text = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, loss_mask, pos = masks_and_position_ids(tokens, None, False)
    return (tokens, pos, mask), (labels, loss_mask)


_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def stacked_expert_logs(values: dict) -> dict:
    """The logged values with each MoE layer's experts' entries (``...deepspeed_experts.{e}.w1``) combined into
    the stacked tensor's of the layer without expert parallelism (``...experts.mlp.w1``): norms add in squares,
    zero percentages by entries (every expert has as many)."""
    out, parts = {}, {}
    for key, value in values.items():
        if _EXPERTS in key:
            head, rest = key.split(_EXPERTS)
            tensor = rest.split(".", 1)[1]
            parts.setdefault(f"{head}experts.mlp.{tensor}", []).append(value)
        else:
            out[key] = value
    for key, items in parts.items():
        zeros = key.startswith("gradient_pct_zeros/")
        out[key] = sum(items) / len(items) if zeros else math.sqrt(sum(v * v for v in items))
    return out
