"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv 2402.01306) as the model's loss function
(train_impl 'kto').

Each sequence is one completion with a desirable (+1) or undesirable (-1) reward (`train_reward_data_paths`,
written by preprocess_data_with_chat_template.py --reward-key); the labels tuple is (labels, loss_mask, rewards,
reference_logps). With r = policy - reference summed label log-probability of a sequence and z the reference
point,

    desirable:   kto_desirable_weight   * (1 - sigmoid(kto_beta * (r - z)))
    undesirable: kto_undesirable_weight * (1 - sigmoid(kto_beta * (z - r)))

averaged over the micro-batch. z estimates KL(policy || reference) as the paper does, max(0, mean r) over
completions the row is not compared with, without gradient: the micro-batch is split in halves and each half
takes the other half's estimate (as GPT-NeoX does), so micro-batches need an even number (>= 2) of sequences.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron.model.head import HeadOutput
from megatron.model.preference_metrics import MetricSums
from megatron.post_training.dpo import sequence_logps


def kto_loss(policy_logps: torch.Tensor, reference_logps: torch.Tensor, rewards: torch.Tensor, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0
             ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(mean KTO loss, metrics) from [rows] summed log-probabilities and [rows] rewards (their sign is used)."""
    rows = policy_logps.numel()
    if rows < 2 or rows % 2:
        raise ValueError(f"KTO estimates its KL reference point from the other half of the micro-batch: it needs an "
                         f"even number (>= 2) of sequences, got {rows}; set train_micro_batch_size_per_gpu even")
    ratio = policy_logps.float() - reference_logps.float().to(policy_logps.device)
    sign = torch.sign(rewards.float()).to(ratio.device)
    first, second = ratio.detach().chunk(2)
    kl_first, kl_second = first.mean().clamp(min=0), second.mean().clamp(min=0)
    z = torch.cat([kl_second.expand(first.numel()), kl_first.expand(second.numel())])
    weight = torch.where(sign > 0, torch.full_like(sign, desirable_weight),
                         torch.where(sign < 0, torch.full_like(sign, undesirable_weight), torch.zeros_like(sign)))
    loss = (weight * (1 - torch.sigmoid(beta * sign * (ratio - z)))).mean()
    rewards_of = (beta * ratio).detach()
    desirable, undesirable = sign > 0, sign < 0
    zero = torch.zeros((), device=ratio.device)
    metrics = {"chosen_rewards": rewards_of[desirable].mean() if desirable.any() else zero,
               "rejected_rewards": rewards_of[undesirable].mean() if undesirable.any() else zero,
               "reward_accuracy": ((sign * rewards_of) > 0).float()[sign != 0].mean() if (sign != 0).any() else zero,
               "kl": (kl_first + kl_second) / 2}
    return loss, metrics


class KTOLoss(MetricSums):
    """The model's ``loss_fn(logits, (labels, loss_mask, rewards, reference_logps))`` under train_impl 'kto'."""

    def __init__(self, beta: float, desirable_weight: float, undesirable_weight: float, fp32: bool,
                 group=None) -> None:
        super().__init__()
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.fp32, self.group = fp32, group

    def __call__(self, logits: HeadOutput, labels_and_mask: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(labels_and_mask) != 4:
            raise ValueError("train_impl 'kto' needs (labels, loss_mask, rewards, reference_logps) in the batch")
        labels, loss_mask, rewards, reference_logps = labels_and_mask
        policy = sequence_logps(logits, labels, loss_mask, self.group, self.fp32)
        loss, metrics = kto_loss(policy, reference_logps, rewards, self.beta, self.desirable_weight,
                                 self.undesirable_weight)
        self.add(metrics)
        return loss
