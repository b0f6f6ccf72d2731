"""REINFORCE on online rollouts (train_impl 'reinforce', dataset_impl 'online'), as GPT-NeoX's megatron/training.py
defines it, as the model's loss function.

Each row of a batch is one completion of one prompt (megatron.data.online_dataset); the labels tuple is (labels,
loss_mask, advantages, raw_rewards[, reference]), the loss mask 1 on the completion's tokens. With log p_t the
policy's log-probability of label t, A the row's advantage (reward minus baseline) and m_t the loss mask:

    kl_div_beta > 0:  loss = mean_rows( sum_t m_t (-A log p_t + kl_div_beta KL_t) ) / sum_{rows, t} m_t
    kl_div_beta = 0:  the same without KL_t (and no reference model is built)

(the sum over each row divided by the whole micro-batch's token count, then the mean over rows: GPT-NeoX's
normalisation, kept so that its learning rates mean the same here). KL_t compares the policy with the frozen
reference (the policy's weights when the run started, megatron.post_training.reference), by kl_impl:

    kl:   log p_t - log q_t                    abs:  |log p_t - log q_t|
    mse:  (log p_t - log q_t)^2 / 2            full: sum_v p_t(v) (log p_t(v) - log q_t(v)), the exact KL(p || q)
                                                     over the whole vocabulary at position t

q being the reference's probabilities. fp32_reinforce computes the log-softmax in fp32 instead of the logits'
dtype. The metrics logged: the mean raw reward and its standard deviation over the micro-batch, and the mean log p_t,
log q_t and KL_t over completion tokens.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron.model.head import DeferredLogits, HeadOutput, token_cross_entropy
from megatron.model.preference_metrics import MetricSums
from megatron.mpu import gather_from_model_parallel_region
from megatron.post_training.reference import ReferenceModel

KL_IMPLS = ("abs", "mse", "kl", "full")


def token_logps(output: HeadOutput, labels: torch.Tensor, group=None, fp32: bool = True) -> torch.Tensor:
    """[rows, seq] log-probability of each label, from (vocabulary-parallel) logits or DeferredLogits."""
    return -token_cross_entropy(output, labels, group, keep_dtype=not fp32)


def vocabulary_logps(output: HeadOutput, group=None, fp32: bool = True) -> torch.Tensor:
    """[rows, seq, vocab] log-softmax over the whole (gathered) vocabulary, for kl_impl 'full'."""
    logits = output.logits() if isinstance(output, DeferredLogits) else output
    if group is not None:
        logits = gather_from_model_parallel_region(logits, group)
    return (logits.float() if fp32 else logits).log_softmax(dim=-1)


def kl_penalty(kl_impl: str, policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[rows, seq] KL_t of the module docstring: ``policy`` / ``reference`` are per-token log-probabilities of the
    labels ([rows, seq]), or with kl_impl 'full' whole log-softmaxes ([rows, seq, vocab])."""
    if kl_impl == "full":
        return (policy.exp() * (policy - reference)).sum(dim=-1)
    difference = policy - reference
    if kl_impl == "abs":
        return difference.abs()
    if kl_impl == "mse":
        return 0.5 * difference.square()
    if kl_impl == "kl":
        return difference
    raise ValueError(f"kl_impl={kl_impl!r}: use one of {', '.join(KL_IMPLS)}")


def reinforce_loss(policy_logps: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                   kl: Optional[torch.Tensor] = None, beta: float = 0.0) -> torch.Tensor:
    """The loss of the module docstring from [rows, seq] label log-probabilities, [rows] advantages, the
    [rows, seq] loss mask and the [rows, seq] KL_t (None: no KL term)."""
    mask = loss_mask.float()
    per_token = -policy_logps.float() * advantages.float().to(mask.device).view(-1, 1)
    if kl is not None:
        per_token = per_token + beta * kl.float()
    return ((per_token * mask).sum(dim=-1) / mask.sum()).mean()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values.detach().float() * mask).sum() / mask.sum().clamp(min=1.0)


class ReinforceLoss(MetricSums):
    """The model's ``loss_fn(logits, (labels, loss_mask, advantages, raw_rewards[, reference]))``."""

    def __init__(self, kl_impl: str, beta: float, fp32: bool, group=None) -> None:
        super().__init__()
        if kl_impl not in KL_IMPLS:
            raise ValueError(f"kl_impl={kl_impl!r}: use one of {', '.join(KL_IMPLS)}")
        self.kl_impl, self.beta, self.fp32, self.group = kl_impl, beta, fp32, group

    def __call__(self, logits: HeadOutput, labels_and_mask: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(labels_and_mask) not in (4, 5):
            raise ValueError("train_impl 'reinforce' needs (labels, loss_mask, advantages, raw_rewards[, reference]) "
                             "in the batch: set dataset_impl: online")
        labels, loss_mask, advantages, raw_rewards = labels_and_mask[:4]
        reference = labels_and_mask[4] if len(labels_and_mask) == 5 else None
        mask = loss_mask.float()
        metrics: Dict[str, torch.Tensor] = {"reward": raw_rewards.detach().float().mean(),
                                            "reward_std": raw_rewards.detach().float().std()
                                            if raw_rewards.numel() > 1 else torch.zeros(())}
        full = self.kl_impl == "full" and reference is not None
        if full:
            vocabulary = vocabulary_logps(logits, self.group, self.fp32)
            policy = vocabulary.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        else:
            policy = token_logps(logits, labels, self.group, self.fp32)
        metrics["logp"] = _masked_mean(policy, mask)
        kl = None
        if reference is not None:
            kl = kl_penalty(self.kl_impl, vocabulary if full else policy, reference)
            reference_tokens = reference.gather(-1, labels.unsqueeze(-1)).squeeze(-1) if full else reference
            metrics["ref_logp"], metrics["kl"] = _masked_mean(reference_tokens, mask), _masked_mean(kl, mask)
        self.add(metrics)
        return reinforce_loss(policy, advantages, loss_mask, kl, self.beta)


class ReinforceReference(ReferenceModel):
    """DPO's frozen reference (same construction, filling, saving and resuming), giving what REINFORCE's KL term
    reads: per-token log-probabilities of the labels, or with kl_impl 'full' the whole log-softmax."""

    def __init__(self, config, parallel_state, kl_impl: str, fp32: bool = True) -> None:
        super().__init__(config, parallel_state, fp32)
        self.kl_impl = kl_impl

    @torch.no_grad()
    def logps(self, inputs, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("the reference model is held by the last pipeline stage only")
        output = self.model(inputs, defer_logits=self.defer_logits and self.kl_impl != "full")
        group = self.parallel_state.get_model_parallel_group() \
            if self.parallel_state.get_model_parallel_world_size() > 1 else None
        if self.kl_impl == "full":
            return vocabulary_logps(output, group, self.fp32)
        return token_logps(output, labels, group, self.fp32)
