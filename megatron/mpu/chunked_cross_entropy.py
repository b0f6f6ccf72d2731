"""The output head's matmul and the cross entropy together, over chunks of tokens: the [tokens, vocab] logits are
never whole in memory (at 16k tokens x 50k vocabulary they are 3.3 GB in fp32, more than a small model's
activations).

Each chunk of ``chunk_tokens`` tokens computes its logits (hidden @ weight^T), reduces them to two numbers per
token (the log-sum-exp and the target's logit) and is freed before the next chunk starts. Two functions:

* ``weighted_linear_cross_entropy``: sum_t w_t * loss_t, the language-model loss (w = the loss mask). Its gradient
  is the incoming scalar times sum_t w_t * d loss_t, known up to that scalar in the forward pass: each chunk's
  gradients with respect to the head's input and weight are computed right after its loss, while its logits are
  at hand, and the backward only scales them. So the head costs the three matmuls it costs without chunks (as
  Liger-Kernel's fused linear cross entropy and DeepSpeed's TiledFusedLogitsLoss do it); between the forward and
  the backward it holds the input's gradient ([tokens, hidden], the input's dtype) and the weight's (fp32
  [vocabulary shard, hidden]) instead of the logits.
* ``linear_cross_entropy``: per-token losses, for objectives whose per-token gradient is only known in the
  backward (DPO and KTO take sequence-level functions of the log-probabilities). It keeps the input and the
  per-token log-sum-exp; its backward computes each chunk's logits again (one more matmul of the head's size).

Tensor parallelism: ``weight`` is this rank's shard of the vocabulary (rank r holds rows r * shard ..), ``hidden``
the whole input on every rank (after copy_to_model_parallel_region or gather_from_sequence_parallel_region, as a
ColumnParallelLinear's input). Within a chunk the ranks all-reduce the per-token max, then the sum of exponentials
and the target logit together (as vocab_parallel_cross_entropy does, in two all-reduces instead of three). The
input's gradient returned is this rank's part; the caller's region function sums it over the ranks.

Precision (that of vocab_parallel_cross_entropy): logits in the input's dtype, the cross entropy over the
vocabulary in fp32, or in the logits' dtype with ``keep_dtype`` (fp16_lm_cross_entropy); the loss is returned in
fp32. The gradient with respect to the logits is formed in that dtype and cast to the weight's dtype for the
matmuls; the weight's gradient is summed over chunks in fp32. In fp32, losses and gradients equal the unchunked
ones to float rounding (tests/mpu/test_chunked_cross_entropy.py).

Targets must lie in [0, vocabulary size) (not checked: that would cost a host sync).

On a GPU the chunk's elementwise work is PyTorch's (about seven passes over the chunk's fp32 logits, as many as the
unchunked loss makes over the whole). The Triton kernels of megatron.fused_kernels.cross_entropy could do it in
two passes over the logits in their own dtype (the forward kernel's log-sum-exp is this rank's; its backward takes
a given log-sum-exp, and a target of -1 for a token whose target is on another rank); not wired in: no config key
chooses it. (The chunked loss itself ran on an H200: its gpu test, and the 125M training of bench/gpu_check.py.)
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.mpu.collectives import group_rank, group_size
from megatron.mpu.deepspeed_comm import collectives

CHUNK_LOGITS_BYTES = 256 * 2 ** 20
"""A chunk's fp32 logits take at most this much (about 1,300 tokens of a 50k vocabulary on one rank). Its
temporaries (the logits in the model's dtype, their fp32 copy, the gradient) stay within about twice that; the
matmuls keep at least a few hundred rows, enough to run at full speed on a GPU."""
CPU_CHUNK_LOGITS_BYTES = 16 * 2 ** 20
"""On a CPU a chunk's fp32 logits take at most this much (or CHUNK_LOGITS_BYTES if smaller), unless that is fewer
tokens than the hidden size. glibc's malloc maps every allocation of 32 MiB or more afresh and unmaps it when freed,
so a chunk's logits that large page-fault all their pages on every step: on issue 34's 2-core AMD EPYC VM, casting
the quickstart's [1024, 8192] bf16 logits to fp32 took 25-39 ms in one piece and 2.2 ms in four (2026-11-28). The
floor of hidden-size tokens keeps a chunk's logits at least as large as the weight's gradient ([vocabulary shard,
hidden], fp32) that every chunk reads and writes."""
CHUNK_ALIGNMENT = 128


def default_chunk_tokens(vocab_per_rank: int, hidden: int = 0, cpu: bool = False) -> int:
    """Tokens per chunk: as many as keep a chunk's fp32 logits within CHUNK_LOGITS_BYTES (on a ``cpu``, within
    CPU_CHUNK_LOGITS_BYTES but at least ``hidden`` tokens), rounded down to a multiple of CHUNK_ALIGNMENT (matmul
    tiles) where that leaves any."""
    per_token = 4 * max(1, vocab_per_rank)
    tokens = max(1, CHUNK_LOGITS_BYTES // per_token)
    if cpu and CPU_CHUNK_LOGITS_BYTES < CHUNK_LOGITS_BYTES:
        tokens = min(tokens, max(CPU_CHUNK_LOGITS_BYTES // per_token, hidden, 1))
    return tokens // CHUNK_ALIGNMENT * CHUNK_ALIGNMENT if tokens >= CHUNK_ALIGNMENT else tokens


LOG2_E = 1.4426950408889634


def exp_in_place(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in ``x``'s memory; in fp32 as 2 ** (x log2 e). PyTorch's CPU exp kernel is the slow one of the two:
    on [512, 8192] fp32 (a chunk of the quickstart's logits), one core of issue 34's AMD EPYC (AVX512, torch
    2.13, 2026-11-28) took 5.1 ms for exp and 1.3 ms for exp2, and the loss calls it on every chunk. The result
    differs from exp's by the rounding of x log2 e: a relative 2^-24 |x| at most, besides exp2's own ulps (below
    1.3e-6 for the |x| < 20 whose exponentials count against the row's maximum), and by nothing where x is 0. In
    half precision (fp16_lm_cross_entropy) that rounding would be 2^-8 |x|: there it is exp."""
    if x.dtype != torch.float32:
        return x.exp_()
    return x.mul_(LOG2_E).exp2_()


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    collectives().all_reduce(x, op=op, group=group)
    return x


class _Chunk:
    """One chunk's logits reduced to per-token statistics; ``exp`` (exp(logit - max), this rank's vocabulary
    shard, in the cross entropy's dtype) is kept for the gradient and freed with the chunk."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, local_target: torch.Tensor,
                 inside: torch.Tensor, group, keep_dtype: bool) -> None:
        logits = F.linear(hidden, weight)
        x = logits if keep_dtype else logits.float()  # our own tensor either way: changed in place below
        row_max = x.amax(dim=-1)
        if group_size(group) > 1:
            _all_reduce(row_max, group, dist.ReduceOp.MAX)
        target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        self.exp = exp_in_place(x.sub_(row_max.unsqueeze(-1)))
        sum_exp = self.exp.sum(dim=-1)
        if group_size(group) > 1:  # one all-reduce for both: [2, chunk]
            sum_exp, target_logit = _all_reduce(torch.stack([sum_exp, target_logit]), group)
        self.sum_exp = sum_exp
        self.lse = row_max.float() + sum_exp.float().log()
        self.loss = self.lse - target_logit.float()


def _logits_gradient(exp: torch.Tensor, to_softmax: torch.Tensor, scale: torch.Tensor, local_target: torch.Tensor,
                     inside: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(softmax - onehot(target)) * scale per row, where softmax = exp * to_softmax (this rank's vocabulary shard
    of the softmax over the whole vocabulary), in ``exp``'s memory (one pass over it), cast to ``dtype`` for the
    matmuls."""
    grad = exp.mul_((to_softmax * scale).to(exp.dtype).unsqueeze(-1))
    grad.scatter_add_(-1, local_target.unsqueeze(-1), -(inside * scale).to(exp.dtype).unsqueeze(-1))
    return grad.to(dtype)


def _add_weight_gradient(grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logits^T @ hidden, the matmul in the logits' dtype."""
    if grad_weight.dtype == grad_logits.dtype:
        grad_weight.addmm_(grad_logits.t(), hidden)
    else:
        grad_weight.add_(grad_logits.t() @ hidden)


def _vocab_shard(weight: torch.Tensor, target: torch.Tensor, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the targets as row indices of this rank's weight shard, 0 where outside it; whether inside)."""
    per_rank = weight.size(0)
    start = group_rank(group) * per_rank
    inside = (target >= start) & (target < start + per_rank)
    return (target - start).masked_fill(~inside, 0), inside


def _spans(tokens: int, chunk_tokens: int) -> List[Tuple[int, int]]:
    return [(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]


def _chunked_losses(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group, keep_dtype: bool,
                    chunk_tokens: int, token_weights: Optional[torch.Tensor] = None,
                    grad_hidden: Optional[torch.Tensor] = None, grad_weight: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(per-token fp32 losses [tokens], their log-sum-exp [tokens]); with ``token_weights`` also fills
    ``grad_hidden`` / ``grad_weight`` (those given) with the gradient of sum_t w_t * loss_t."""
    local_target, inside = _vocab_shard(weight, target, group)
    losses = torch.empty(target.shape, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(losses)
    for start, end in _spans(target.numel(), chunk_tokens):
        rows = hidden[start:end]
        chunk = _Chunk(rows, weight, local_target[start:end], inside[start:end], group, keep_dtype)
        losses[start:end], lse[start:end] = chunk.loss, chunk.lse
        if grad_hidden is not None or grad_weight is not None:
            grad_logits = _logits_gradient(chunk.exp, 1.0 / chunk.sum_exp.float(), token_weights[start:end],
                                           local_target[start:end], inside[start:end], weight.dtype)
            del chunk
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, grad_logits, rows)
            del grad_logits
        else:
            del chunk  # one chunk's temporaries at a time: freed before the next chunk's logits
    return losses, lse


def _gradient_buffers(hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool
                      ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The input's gradient (filled chunk by chunk) and the weight's (fp32, summed over chunks), where wanted."""
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    return grad_hidden, grad_weight


def _flatten(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_tokens: Optional[int]
             ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"linear cross entropy: hidden {tuple(hidden.shape)} does not match target "
                         f"{tuple(target.shape)} (hidden must be target's shape + [hidden size])")
    if weight.dim() != 2 or weight.size(1) != hidden.size(-1):
        raise ValueError(f"linear cross entropy: weight {tuple(weight.shape)} is not [vocabulary shard, "
                         f"{hidden.size(-1)}]")
    chunk = default_chunk_tokens(weight.size(0), weight.size(1), weight.device.type == "cpu") \
        if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise ValueError(f"linear cross entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    return hidden.reshape(-1, hidden.size(-1)), target.reshape(-1), chunk


class _WeightedLinearCrossEntropy(torch.autograd.Function):
    """sum_t w_t * loss_t, gradients computed in the forward pass (see module docstring). Its backward scales the
    saved gradients in place, so it runs once (no retain_graph), as vocab_parallel_cross_entropy's."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, token_weights: torch.Tensor,
                group, keep_dtype: bool, chunk_tokens: int) -> torch.Tensor:
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden, grad_weight = _gradient_buffers(hidden, weight, need_hidden, need_weight)
        losses, _ = _chunked_losses(hidden, weight, target, group, keep_dtype, chunk_tokens, token_weights,
                                    grad_hidden, grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return torch.sum(losses * token_weights)

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_total.float()
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(scale) if hidden_dtype == torch.float32 \
                else (grad_hidden.float() * scale).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(scale).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token losses; the backward recomputes each chunk's logits (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group, keep_dtype: bool,
                chunk_tokens: int) -> torch.Tensor:
        losses, lse = _chunked_losses(hidden, weight, target, group, keep_dtype, chunk_tokens)
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.group, ctx.keep_dtype, ctx.chunk_tokens = group, keep_dtype, chunk_tokens
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        hidden, weight, target, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        local_target, inside = _vocab_shard(weight, target, ctx.group)
        grad_hidden, grad_weight = _gradient_buffers(hidden, weight, need_hidden, need_weight)
        for start, end in _spans(target.numel(), ctx.chunk_tokens):
            rows = hidden[start:end]
            logits = F.linear(rows, weight)
            x = logits if ctx.keep_dtype else logits.float()
            softmax = exp_in_place(x.sub_(lse[start:end].to(x.dtype).unsqueeze(-1)))
            grad_logits = _logits_gradient(softmax, torch.ones_like(lse[start:end]), grad_losses[start:end].float(),
                                           local_target[start:end], inside[start:end], weight.dtype)
            del logits, x, softmax
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                _add_weight_gradient(grad_weight, grad_logits, rows)
            del grad_logits  # before the next chunk's logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _grad_wanted(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, group=None,
                         keep_dtype: bool = False, chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Per-token cross entropy (fp32, ``target``'s shape) of the logits ``hidden @ weight^T`` (``weight``: this
    rank's vocabulary shard), computed ``chunk_tokens`` tokens at a time (default: default_chunk_tokens); the
    backward recomputes each chunk's logits. Equals vocab_parallel_cross_entropy(F.linear(hidden, weight), ...)."""
    flat_hidden, flat_target, chunk = _flatten(hidden, weight, target, chunk_tokens)
    if not _grad_wanted(hidden, weight):
        with torch.no_grad():
            losses, _ = _chunked_losses(flat_hidden, weight, flat_target, group, keep_dtype, chunk)
    else:
        losses = _LinearCrossEntropy.apply(flat_hidden, weight, flat_target, group, keep_dtype, chunk)
    return losses.view(target.shape)


def weighted_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                  token_weights: torch.Tensor, group=None, keep_dtype: bool = False,
                                  chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """sum_t token_weights[t] * loss[t] (a fp32 scalar) over the per-token cross entropies of linear_cross_entropy,
    with the gradients computed chunk by chunk in the forward pass (no recomputation). ``token_weights`` (e.g. the
    loss mask; no gradient flows to it) has ``target``'s shape or its number of elements."""
    flat_hidden, flat_target, chunk = _flatten(hidden, weight, target, chunk_tokens)
    weights = token_weights.detach().reshape(-1).float()
    if weights.numel() != flat_target.numel():
        raise ValueError(f"linear cross entropy: token_weights has {weights.numel()} elements, target "
                         f"{flat_target.numel()}")
    if not _grad_wanted(hidden, weight):
        with torch.no_grad():
            losses, _ = _chunked_losses(flat_hidden, weight, flat_target, group, keep_dtype, chunk)
        return torch.sum(losses * weights)
    return _WeightedLinearCrossEntropy.apply(flat_hidden, weight, flat_target, weights, group, keep_dtype, chunk)
