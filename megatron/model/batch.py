"""Turn a {'text': int64 [b, s + 1]} sample into GPT-NeoX's model batch, shared inside the TP group.

((tokens, position_ids, attention_mask), (labels, loss_mask)):
  tokens = text[:, :-1], labels = text[:, 1:], position_ids = 0..s-1 per row,
  attention_mask = [1, 1, s, s] bool, True where a query may NOT attend (strict upper triangle),
  loss_mask = 1.0 except, with eod_mask_loss, 0.0 where the input token is the end-of-document token.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron.mpu import broadcast_data


def causal_attention_mask(seq_length: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (future positions are masked)."""
    return torch.ones(seq_length, seq_length, dtype=torch.bool, device=device).triu(1).view(1, 1, seq_length,
                                                                                           seq_length)


def masks_and_position_ids(tokens: torch.Tensor, eod_token: Optional[int], eod_mask_loss: bool
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(attention_mask, loss_mask, position_ids) for left-to-right language modelling."""
    b, s = tokens.shape
    attention_mask = causal_attention_mask(s, tokens.device)
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        if eod_token is None:
            raise ValueError("eod_mask_loss needs the tokenizer's eod token id")
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long, device=tokens.device).unsqueeze(0).expand(b, s)
    return attention_mask, loss_mask, position_ids


def get_batch(neox_args, data: Optional[Dict[str, torch.Tensor]], parallel_state,
              eod_token: Optional[int] = None):
    """Model batch from a data sample; ``data`` is read only on model-parallel rank 0."""
    text = broadcast_data(["text"], data, torch.int64, parallel_state)["text"]
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = masks_and_position_ids(
        tokens, eod_token, bool(getattr(neox_args, "eod_mask_loss", False)))
    return (tokens, position_ids, attention_mask), (labels, loss_mask)
