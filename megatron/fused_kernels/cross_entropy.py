"""Per-token cross entropy: loss[t] = logsumexp(logits[t]) - logits[t, target[t]], in fp32.

logits are [tokens, vocab] (any float dtype; rows may be strided, the vocab dim contiguous),
targets int64 [tokens]; tokens whose target equals ``ignore_index`` get loss 0 and no gradient.
Returns fp32 losses [tokens]; reduce (mask, mean) outside.

Fused version: Triton forward (online log-sum-exp over vocab blocks, one program per token, so
the fp32 softmax is never materialised) and backward (softmax - onehot from the saved
log-sum-exp, written in the logits' dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.fused_kernels.launch_config import cross_entropy_blocks
from megatron.fused_kernels.triton_support import check_device, load_kernels

NAME = "cross_entropy"


def _check(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"{NAME}: expected logits [tokens, vocab], got shape {tuple(logits.shape)}")
    if targets.dtype != torch.int64 or tuple(targets.shape) != (logits.shape[0],):
        raise ValueError(
            f"{NAME}: targets must be int64 [tokens={logits.shape[0]}], got {targets.dtype} {tuple(targets.shape)}"
        )


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Pure PyTorch: F.cross_entropy(logits.float(), targets, reduction="none")."""
    _check(logits, targets)
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="none")


class FusedCrossEntropy(torch.autograd.Function):
    """Triton forward/backward; saves logits, targets and the per-token log-sum-exp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        _check(logits, targets)
        check_device(logits, NAME)
        kernels = load_kernels("cross_entropy")
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        targets = targets.contiguous()
        tokens, vocab = logits.shape
        loss = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        blocks = cross_entropy_blocks(vocab)
        if tokens and vocab:
            kernels.cross_entropy_forward[(tokens,)](
                logits, targets, loss, lse, vocab, logits.stride(0), ignore_index,
                BLOCK=blocks.block_n, num_warps=blocks.num_warps,
            )
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        kernels = load_kernels("cross_entropy")
        dloss = dloss.contiguous()
        tokens, vocab = logits.shape
        blocks = cross_entropy_blocks(vocab)
        dlogits = torch.empty((tokens, vocab), dtype=logits.dtype, device=logits.device)
        if tokens and vocab:
            kernels.cross_entropy_backward[(tokens,)](
                logits, targets, lse, dloss, dlogits, vocab, logits.stride(0), ctx.ignore_index,
                BLOCK=blocks.block_n, num_warps=blocks.num_warps,
            )
        return dlogits, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Fused (Triton) per-token cross entropy; same contract as the reference."""
    return FusedCrossEntropy.apply(logits, targets, ignore_index)
