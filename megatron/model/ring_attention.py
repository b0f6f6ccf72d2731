"""Causal ring attention over a context-parallel group (context_parallel_size > 1).

Each context-parallel rank r of C holds the queries, keys and values of its two load-balanced chunks of the
sequence, r and 2C - 1 - r of 2C (megatron.mpu.context_parallel); their positions increase, so on local indices
the causal mask is the plain lower triangle. Attention runs in C steps: at step t a rank attends to the keys and
values of rank s = r - t (its own at t = 0), then passes them on around the ring. Which block pairs are visible
follows from the layout, so no step needs a mask:
  * t = 0: own keys, causal;
  * s < r: every query sees the source's first chunk (chunk s < r), none of its second (2C - 1 - s > 2C - 1 - r);
  * s > r: only the second query chunk (2C - 1 - r) sees the source's keys, all of them.
Each step is one SDPA call that also returns the log-sum-exp of its scores, and the partial outputs are merged by
the online-softmax rule (out = sum_t exp(lse_t - lse) out_t, lse = logsumexp_t lse_t), which equals the softmax
over all keys.

The backward pass (a custom autograd Function) passes the keys and values around the ring again, with gradient
accumulators for them that travel along and return to their owner after the last step; each step's gradients
come from SDPA's backward given the final output and log-sum-exp (as flash attention's). Only q, k, v, the
output and the log-sum-exp are kept for the backward pass: activation memory per rank is O(S / C), never a
score matrix. The SDPA kernel with log-sum-exp is PyTorch's CPU flash-attention operator; on other devices
each step is computed from an explicit score matrix in fp32 (the same equations, tested against each other).
Attention dropout is not supported here (validation refuses it).
"""
from __future__ import annotations

from typing import Tuple

import torch

from megatron.mpu.context_parallel import ring_exchange


def pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 explicit: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, logsumexp of the scores [b, h, sq] fp32) for q [b, h, sq, d], k, v [b, h, sk, d];
    ``causal`` masks the upper triangle (sq == sk)."""
    if q.device.type == "cpu" and not explicit:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def pair_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, explicit: bool = False):
    """(dq, dk, dv) of one step, given the *final* output, its gradient and log-sum-exp of these queries."""
    if q.device.type == "cpu" and not explicit:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    probs = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    dout32 = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout32)
    dprobs = torch.matmul(dout32, v.float().transpose(-1, -2))
    dscores = probs * (dprobs - (dout32 * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, k.float()) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _blocks(step: int, cp_rank: int, cp_size: int, s: int):
    """(query slice, key slice, causal) of ring step ``step`` (see the module docstring)."""
    half = s // 2
    source = (cp_rank - step) % cp_size
    if step == 0:
        return slice(None), slice(None), True
    if source < cp_rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``groups`` query heads."""
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand``: sum over each group's query heads."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cp_rank: int, cp_size: int, scale: float, explicit: bool):
        groups = q.size(1) // k.size(1)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        for step in range(cp_size):
            if step:
                kv = ring_exchange(kv, group)
            qs, ks, causal = _blocks(step, cp_rank, cp_size, q.size(2))
            part, part_lse = pair_forward(q[:, :, qs], _expand(kv[0][:, :, ks], groups),
                                          _expand(kv[1][:, :, ks], groups), causal, scale, explicit)
            merged = torch.logaddexp(lse[:, :, qs], part_lse)
            out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - merged).unsqueeze(-1) + \
                part.float() * torch.exp(part_lse - merged).unsqueeze(-1)
            lse[:, :, qs] = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cp_rank, ctx.cp_size, ctx.scale, ctx.explicit = group, cp_rank, cp_size, scale, explicit
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        groups = q.size(1) // k.size(1)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with kv, back to its owner
        for step in range(ctx.cp_size):
            if step:
                kv, dkv = ring_exchange(kv, ctx.group), ring_exchange(dkv, ctx.group)
            qs, ks, causal = _blocks(step, ctx.cp_rank, ctx.cp_size, q.size(2))
            dq_t, dk_t, dv_t = pair_backward(dout[:, :, qs], q[:, :, qs], _expand(kv[0][:, :, ks], groups),
                                             _expand(kv[1][:, :, ks], groups), out[:, :, qs],
                                             lse[:, :, qs].contiguous(), causal, ctx.scale, ctx.explicit)
            dq[:, :, qs] += dq_t.float()
            dkv[0][:, :, ks] += _fold(dk_t.float(), groups)
            dkv[1][:, :, ks] += _fold(dv_t.float(), groups)
        dkv = ring_exchange(dkv, ctx.group)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_rank: int, cp_size: int,
                   scale: float = None, explicit: bool = False) -> torch.Tensor:
    """Causal attention of this rank's ``q`` [b, heads, s, d] against the whole sequence's keys and values, of
    which this rank holds ``k``, ``v`` [b, kv heads, s, d] (grouped-query heads share them in groups of
    heads / kv heads); ``s`` = S / C tokens at ``chunk_positions(S, cp_rank, cp_size)``. Returns [b, heads, s, d]
    in q's dtype. ``explicit`` computes each step from explicit scores also on CPU (tests compare the two)."""
    if q.size(2) % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {q.size(2)} positions")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, group, cp_rank, cp_size, scale, explicit)
