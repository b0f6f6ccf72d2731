"""Causal ring attention over a context-parallel group (context_parallel_size > 1).

Each context-parallel rank holds the queries, keys and values of its load-balanced chunks of the sequence
(megatron.mpu.context_parallel). Attention runs in C steps: at step t a rank attends its queries to the keys
and values of rank r - t (its own at t = 0), then passes them on around the ring. Each step gives a partial
output normalised over that step's keys and its log-sum-exp; the partials are merged by the online-softmax
rule, out = sum_t exp(lse_t - lse) out_t with lse = logsumexp_t lse_t, which equals softmax over all keys.

The causal mask comes from global positions (key position <= query position), so the batch's attention mask is
not used: it must be the plain causal one (validation refuses reset_attention_mask). Each step is computed in
fp32 from an explicit score matrix, [queries of this rank, keys of one rank]: SDPA has no public form that
returns the log-sum-exp the merge needs. The backward pass is autograd through these steps and through
``ring_shift``, whose gradient travels the ring in the opposite direction, so it is exact by construction.
The score matrices kept for the backward pass are (S / C) x S per rank instead of S x S.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F

from megatron.mpu.context_parallel import chunk_positions, ring_shift

MASKED_SCORE = -1e30
"""A finite stand-in for -inf: a query row with no visible key in one step gets a finite log-sum-exp that the
merge weighs by exp(-1e30 - lse) = 0, where -inf would give NaN gradients."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_rank: int, cp_size: int,
                   dropout_p: float = 0.0, rng_fork=None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this rank's ``q`` [b, heads, s, d] against the whole sequence's keys and values, of
    which this rank holds ``k``, ``v`` [b, kv heads, s, d] (grouped-query heads are shared in groups of
    heads / kv heads). ``s`` = S / C tokens, at the positions ``chunk_positions(S, cp_rank, cp_size)``.
    Returns [b, heads, s, d] in q's dtype. ``rng_fork``: a context manager to draw attention dropout in."""
    b, heads, s, d = q.shape
    group_size = heads // k.size(1)
    scale = d ** -0.5 if scale is None else scale
    total = s * cp_size
    q_pos = chunk_positions(total, cp_rank, cp_size, q.device)
    qf = q.float() * scale
    kv = torch.stack((k, v))
    outs: List[torch.Tensor] = []
    lses: List[torch.Tensor] = []
    for step in range(cp_size):
        if step:
            kv = ring_shift(kv, group)
        source = (cp_rank - step) % cp_size
        allowed = chunk_positions(total, source, cp_size, q.device).unsqueeze(0) <= q_pos.unsqueeze(-1)
        if not bool(allowed.any()):
            continue
        keys, values = kv[0], kv[1]
        if group_size > 1:
            keys, values = keys.repeat_interleave(group_size, dim=1), values.repeat_interleave(group_size, dim=1)
        scores = torch.matmul(qf, keys.float().transpose(-1, -2)).masked_fill(~allowed, MASKED_SCORE)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        if dropout_p > 0:
            with rng_fork() if rng_fork is not None else contextlib.nullcontext():
                probs = F.dropout(probs, p=dropout_p)
        outs.append(torch.matmul(probs, values.float()))
        lses.append(lse)
    lse_all = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(o * torch.exp(l - lse_all).unsqueeze(-1) for o, l in zip(outs, lses))
    return out.to(q.dtype)
