"""Shared bits for model tests: a random batch in GPT-NeoX format."""

import torch

from megatron.model.batch import masks_and_position_ids


def random_batch(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 0):
    """((tokens, position_ids, attention_mask), (labels, loss_mask)) from seeded random text."""
    text = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    tokens, labels = text[:, :-1], text[:, 1:]
    mask, loss_mask, pos = masks_and_position_ids(tokens, None, False)
    return (tokens, pos, mask), (labels, loss_mask)
