"""Cross entropy over logits whose vocabulary dimension is split across model-parallel ranks.

Never gathers the full [.., vocab] logits: each rank contributes its max, its sum of exponentials and,
for targets in its vocabulary range, the target logit.

With the whole vocabulary on one rank the loss is one fused log-softmax whose output is kept for the
backward, which turns it into the gradient softmax - onehot in place: a [tokens, vocab] tensor is written
once forward and once backward, where F.cross_entropy writes three (log-softmax, the NLL gradient's
zeros, the log-softmax gradient). With a 50k vocabulary this halves the loss's time and memory. Like
the parallel version, its backward consumes the saved tensor, so it runs once (no retain_graph).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.mpu.collectives import group_rank, group_size
from megatron.mpu.deepspeed_comm import collectives


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, keep_dtype: bool) -> torch.Tensor:
        if not keep_dtype:
            logits = logits.float()
        world = group_size(group)
        logits_max = logits.amax(dim=-1)
        if world > 1:
            collectives().all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        per_rank = shifted.size(-1)
        start = group_rank(group) * per_rank
        outside = (target < start) | (target >= start + per_rank)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()  # `shifted` is our own temporary: reuse its memory ([tokens, vocab] is large)
        sum_exp = exp.sum(dim=-1)
        if world > 1:
            comm = collectives()
            comm.all_reduce(predicted, group=group)
            comm.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), computed in the saved softmax's memory (it is not
        # needed again) instead of materialising a second [tokens, vocab] one-hot tensor
        grad = softmax.view(-1, softmax.size(-1))
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target.reshape(-1)] -= (~outside).reshape(-1).to(grad.dtype)
        grad.mul_(grad_loss.reshape(-1, 1))
        return grad.view_as(softmax), None, None, None


class _CrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over the full vocabulary (see module docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        log_probs = torch.log_softmax(logits, dim=-1)
        ctx.save_for_backward(log_probs, target)
        return -log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        log_probs, target = ctx.saved_tensors
        grad = log_probs.exp_()  # softmax, in the saved tensor's memory
        ones = torch.ones(target.shape + (1,), dtype=grad.dtype, device=grad.device)
        grad.scatter_add_(-1, target.unsqueeze(-1), -ones)
        grad.mul_(grad_loss.unsqueeze(-1).to(grad.dtype))
        return grad, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group,
                                 keep_dtype: bool = False) -> torch.Tensor:
    """Per-token loss (shape of ``target``) from this rank's vocabulary shard of ``logits``.

    Computed in fp32 unless ``keep_dtype`` (GPT-NeoX's fp16_lm_cross_entropy: stay in the logits'
    half precision to save memory).
    """
    if group_size(group) == 1:  # the whole vocabulary is here
        return _CrossEntropy.apply(logits if keep_dtype else logits.float(), target)
    return _VocabParallelCrossEntropy.apply(logits, target, group, keep_dtype)
