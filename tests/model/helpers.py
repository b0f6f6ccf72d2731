"""Shared bits for model tests: a tiny ModelConfig and a random batch in GPT-NeoX format."""

import torch

from megatron.model.batch import masks_and_position_ids
from megatron.model_config import ModelConfig

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
