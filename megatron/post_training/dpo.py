"""Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290) as the model's loss function.

A batch of b preference pairs is one batch of 2b sequences: rows 0..b-1 the chosen answers, rows b..2b-1 the
rejected ones (megatron.data.pairwise_dataset.as_text_and_labels). The labels tuple carries, beside the labels
and the loss mask, the frozen reference model's log-probabilities of each row (megatron.post_training.reference),
so the same loss runs under the sequential model and DeepSpeed's pipeline engine.

    loss = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
    chosen reward = beta * (pi_c - ref_c), rejected reward = beta * (pi_r - ref_r)

pi_* / ref_* are sums of the label tokens' log-probabilities (loss mask 1) per sequence; dpo_reference_free
sets ref_* to 0 (and no reference model is built). dpo_fp32 computes the log-softmax in fp32 instead of the logits' dtype.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.model.head import HeadOutput, token_cross_entropy
from megatron.model.preference_metrics import MetricSums, preference_metrics


def sequence_logps(logits: HeadOutput, labels: torch.Tensor, loss_mask: torch.Tensor, group=None,
                   fp32: bool = True) -> torch.Tensor:
    """[rows] sum over each row's masked tokens of log p(label), from (vocabulary-parallel) logits or the head's
    DeferredLogits (computed in chunks of tokens, megatron.mpu.chunked_cross_entropy)."""
    token_logps = -token_cross_entropy(logits, labels, group, keep_dtype=not fp32)
    return (token_logps.float() * loss_mask.float()).sum(dim=-1)


def dpo_loss(policy_logps: torch.Tensor, reference_logps: Optional[torch.Tensor], beta: float,
             reference_free: bool = False) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(mean DPO loss, metrics) from [2b] log-probabilities ordered chosen rows then rejected rows."""
    if policy_logps.numel() % 2:
        raise ValueError(f"DPO needs chosen and rejected rows in pairs, got {policy_logps.numel()} rows")
    pi_chosen, pi_rejected = policy_logps.float().chunk(2)
    if reference_free or reference_logps is None:
        if not reference_free:
            raise ValueError("reference_logps is needed unless reference_free")
        ref = torch.zeros_like(policy_logps.float())
    else:
        ref = reference_logps.float().to(policy_logps.device)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen = beta * (pi_chosen - ref_chosen)
    rejected = beta * (pi_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected).mean(), preference_metrics(chosen, rejected)


class DPOLoss(MetricSums):
    """The model's ``loss_fn(logits, (labels, loss_mask, reference_logps))`` under train_impl 'dpo'.

    Keeps its metrics until ``take_metrics`` (megatron.model.preference_metrics)."""

    def __init__(self, beta: float, reference_free: bool, fp32: bool, group=None) -> None:
        super().__init__()
        self.beta, self.reference_free, self.fp32, self.group = beta, reference_free, fp32, group

    def __call__(self, logits: HeadOutput, labels_and_mask: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(labels_and_mask) != 3 and not self.reference_free:
            raise ValueError("train_impl 'dpo' needs the reference log-probabilities in the batch "
                             "(labels, loss_mask, reference_logps)")
        labels, loss_mask = labels_and_mask[:2]
        reference_logps = labels_and_mask[2] if len(labels_and_mask) == 3 else None
        policy = sequence_logps(logits, labels, loss_mask, self.group, self.fp32)
        loss, metrics = dpo_loss(policy, reference_logps, self.beta, self.reference_free)
        self.add(metrics)
        return loss
