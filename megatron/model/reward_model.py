"""Reward models (train_impl 'rm'): the model ends in a scalar value head (megatron.model.head.ValueHead) and is
trained with the Bradley-Terry loss on preference pairs, -log sigmoid(r_chosen - r_rejected), plus GPT-NeoX's z-loss
``z_loss x mean(r_chosen^2 + r_rejected^2)`` when z_loss is set: it keeps the rewards near 0, where the Bradley-Terry
loss alone only sees their differences (GPT-NeoX's megatron/training.py, train_impl 'rm').

A sequence's reward is the value head's output at its last position with loss mask 1: with data from
`preprocess_data_with_chat_template.py --for-rm` that is the end-of-sequence token after the conversation
(only the final label is kept), without label datasets the last token before the padding. The batch holds the
chosen rows then the rejected rows (megatron.data.pairwise_dataset.as_text_and_labels).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from megatron.model.preference_metrics import MetricSums, preference_metrics


def sequence_rewards(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[rows] the value head's output ([rows, seq, 1] or [rows, seq]) at each row's last position with loss mask 1."""
    values = values.squeeze(-1) if values.dim() == 3 else values
    marked = loss_mask > 0
    if not bool(marked.any(dim=-1).all()):
        raise ValueError("a reward-model sequence has no position with loss mask 1 to score (its labels are all "
                         "-100); make the data with preprocess_data_with_chat_template.py --for-rm")
    positions = torch.arange(marked.size(-1), device=marked.device).expand_as(marked)
    last = torch.where(marked, positions, torch.full_like(positions, -1)).max(dim=-1).values
    return values.float().gather(-1, last.unsqueeze(-1)).squeeze(-1)


class RewardLoss(MetricSums):
    """The reward model's ``loss_fn(values, (labels, loss_mask))``; keeps rewards, accuracy and margin until
    ``take_metrics``. ``z_loss``: the coefficient of the z-loss (0: none)."""

    def __init__(self, z_loss: float = 0.0) -> None:
        super().__init__()
        self.z_loss = z_loss

    def __call__(self, values: torch.Tensor, labels_and_mask: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        rewards = sequence_rewards(values, labels_and_mask[1])
        if rewards.numel() % 2:
            raise ValueError(f"a reward model trains on chosen / rejected pairs, got {rewards.numel()} rows")
        chosen, rejected = rewards.chunk(2)
        self.add(preference_metrics(chosen, rejected))
        loss = -F.logsigmoid(chosen - rejected).mean()
        if self.z_loss:
            loss = loss + (self.z_loss * (chosen ** 2 + rejected ** 2)).mean()
        return loss
