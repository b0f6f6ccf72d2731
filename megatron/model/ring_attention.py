"""Causal ring attention over a context-parallel group (context_parallel_size > 1).

Each context-parallel rank r of C holds the queries, keys and values of its two load-balanced chunks of the
sequence, r and 2C - 1 - r of 2C (megatron.mpu.context_parallel); their positions increase, so on local indices
the causal mask is the plain lower triangle. Attention runs in C steps: at step t a rank attends to the keys and
values of rank s = r - t (its own at t = 0), then passes them on around the ring. Which block pairs are visible
follows from the layout, so no step needs a mask:
  * t = 0: own keys, causal;
  * s < r: every query sees the source's first chunk (chunk s < r), none of its second (2C - 1 - s > 2C - 1 - r);
  * s > r: only the second query chunk (2C - 1 - r) sees the source's keys, all of them.
Each step is one fused attention kernel that also returns the log-sum-exp of its scores, and the partial outputs
are merged by the online-softmax rule (out = sum_t exp(lse_t - lse) out_t, lse = logsumexp_t lse_t), which equals
the softmax over all keys.

The backward pass (a custom autograd Function) passes the keys and values around the ring again, with gradient
accumulators for them that travel along and return to their owner after the last step; each step's gradients
come from the kernel's backward given the final output and log-sum-exp (as flash attention's). Only q, k, v, the
output and the log-sum-exp are kept for the backward pass, and no step builds its [S/C, S/C] score matrix: the
kernels are PyTorch's own (the ones F.scaled_dot_product_attention dispatches to, called directly because SDPA
does not return the log-sum-exp), chosen by ``choose_kernel``:
  * ``flash``: CUDA flash attention (fp16 / bf16, head_dim a multiple of 8 up to 256, sm80+);
  * ``efficient``: CUDA memory-efficient attention (also fp32);
  * ``cpu_flash``: the CPU flash-attention kernel;
  * ``explicit``: fp32 scores in tiles of at most EXPLICIT_QUERY_ROWS query rows, for whatever the kernels above
    do not take (another device, a head_dim the fused kernels refuse): memory per step O(rows x S/C), never the
    whole block.
``scores`` computes each step from its whole fp32 score block, as this module did before the fused kernels: a
reference for the tests and bench/context_parallel_memory.py, never chosen by itself.
Attention dropout is not supported here (validation refuses it).

The ring itself is an argument: ``ProcessGroupRing`` passes tensors between the ranks of a process group;
megatron.model.ring_simulation plays every rank of a ring on one device for checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Tuple

import torch
from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

from megatron.mpu.context_parallel import ring_exchange

KERNELS = ("flash", "efficient", "cpu_flash", "explicit", "scores")
# the explicit kernel's query tile: rows x keys x heads x batch fp32 scores at once, capped at EXPLICIT_TILE_ELEMENTS
EXPLICIT_QUERY_ROWS = 128
EXPLICIT_TILE_ELEMENTS = 2 ** 26

_aten = torch.ops.aten


class Ring(Protocol):
    """Where a rank's keys and values go next: ``rank`` of ``size``; each pass sends to rank + 1 and returns what
    rank - 1 sent. ``source`` names the rank whose keys and values (or their gradient accumulator) are sent."""

    rank: int
    size: int

    def pass_keys_values(self, kv: torch.Tensor, source: int) -> torch.Tensor: ...

    def pass_gradients(self, dkv: torch.Tensor, source: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class ProcessGroupRing:
    """The ring of a context-parallel process group (megatron.mpu.context_parallel.ring_exchange)."""

    group: object
    rank: int
    size: int

    def pass_keys_values(self, kv: torch.Tensor, source: int) -> torch.Tensor:
        return ring_exchange(kv, self.group)

    def pass_gradients(self, dkv: torch.Tensor, source: int) -> torch.Tensor:
        return ring_exchange(dkv, self.group)


def choose_kernel(q: torch.Tensor) -> str:
    """The fused kernel every step of a ring over queries like ``q`` [b, heads, s, d] uses (keys and values share
    its dtype and, expanded, its shape): PyTorch's own check of what its flash and memory-efficient kernels take
    (which also honours torch.backends.cuda's switches, e.g. under torch.nn.attention.sdpa_kernel), else the
    tiled explicit steps."""
    if q.device.type == "cpu":
        return "cpu_flash"
    if q.device.type == "cuda" and q.size(-1) % 8 == 0:  # the ops called directly take no padded head dims
        params = SDPAParams(q, q, q, None, 0.0, False, False)
        if can_use_flash_attention(params):
            return "flash"
        if can_use_efficient_attention(params):
            return "efficient"
    return "explicit"


def pair_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 kernel: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v in q's dtype, logsumexp of the scores [b, h, sq] fp32) for q [b, h, sq, d], k, v
    [b, h, sk, d]; ``causal`` masks the upper triangle (sq == sk)."""
    if kernel == "flash":
        out, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    if kernel == "efficient":
        out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.size(2)]  # its log-sum-exp rows are padded to a multiple of 32
    if kernel == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    k32, v32 = k.float(), v.float()
    out, lse = [], []
    for rows in _query_tiles(q, k, kernel):
        scores = _scores(q[:, :, rows].float(), k32, causal, scale, rows.start)
        lse.append(torch.logsumexp(scores, dim=-1))
        out.append(torch.matmul(torch.exp(scores - lse[-1].unsqueeze(-1)), v32).to(q.dtype))
    return torch.cat(out, dim=2), torch.cat(lse, dim=2)


def pair_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, causal: bool, scale: float, kernel: str):
    """(dq, dk, dv) of one step, given the *final* output, its gradient and log-sum-exp of these queries."""
    if kernel == "flash":
        unused = torch.empty(0, dtype=torch.int64, device=q.device)  # the dropout RNG state: no dropout here
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.size(2), k.size(2), 0.0, causal, unused, unused, scale=scale)
    if kernel == "efficient":
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        # the kernel reads ``out`` with the row stride of its own output, [b, s, h, d] contiguous
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        return _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, unused, unused, 0.0, [True, True, True, False], causal, scale=scale)[:3]
    if kernel == "cpu_flash":
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    k32, v32 = k.float(), v.float()
    dq, dk, dv = torch.empty(q.shape, dtype=torch.float32, device=q.device), torch.zeros_like(k32), \
        torch.zeros_like(v32)
    for rows in _query_tiles(q, k, kernel):
        dout32, q32 = dout[:, :, rows].float(), q[:, :, rows].float()
        probs = torch.exp(_scores(q32, k32, causal, scale, rows.start) - lse[:, :, rows].unsqueeze(-1))
        dv += torch.matmul(probs.transpose(-1, -2), dout32)
        dprobs = torch.matmul(dout32, v32.transpose(-1, -2))
        dscores = probs * (dprobs - (dout32 * out[:, :, rows].float()).sum(-1, keepdim=True))
        dq[:, :, rows] = torch.matmul(dscores, k32) * scale
        dk += torch.matmul(dscores.transpose(-1, -2), q32) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _query_tiles(q: torch.Tensor, k: torch.Tensor, kernel: str):
    """Slices of the query rows the explicit kernels score at once (``scores``: all of them)."""
    b, h, sq = q.shape[:3]
    rows = sq if kernel == "scores" else max(1, min(EXPLICIT_QUERY_ROWS, EXPLICIT_TILE_ELEMENTS // (b * h * k.size(2))))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _scores(q32: torch.Tensor, k32: torch.Tensor, causal: bool, scale: float, first_row: int) -> torch.Tensor:
    """Scores of fp32 query rows ``first_row``.. (of a causal block: key j hidden from row i when j > i)."""
    scores = torch.matmul(q32, k32.transpose(-1, -2)) * scale
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q32.device).triu(first_row + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _blocks(step: int, cp_rank: int, cp_size: int, s: int):
    """(query slice, key slice, causal, source rank) of ring step ``step`` (see the module docstring)."""
    half = s // 2
    source = (cp_rank - step) % cp_size
    if step == 0:
        return slice(None), slice(None), True, source
    if source < cp_rank:
        return slice(None), slice(0, half), False, source
    return slice(half, None), slice(None), False, source


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
    def forward(ctx, q, k, v, ring: Ring, scale: float, kernel: str):
        groups = q.size(1) // k.size(1)
        b, h, s, d = q.shape
        # merged in fp32, laid out [b, s, h, d] as the fused kernels' outputs (their backward reads that layout)
        out = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        for step in range(ring.size):
            qs, ks, causal, source = _blocks(step, ring.rank, ring.size, s)
            if step:
                kv = ring.pass_keys_values(kv, (source + 1) % ring.size)
            part, part_lse = pair_forward(q[:, :, qs], _expand(kv[0][:, :, ks], groups),
                                          _expand(kv[1][:, :, ks], groups), causal, scale, kernel)
            out_q, lse_q = out[:, :, qs], lse[:, :, qs]
            merged = torch.logaddexp(lse_q, part_lse)
            out_q.mul_(torch.exp(lse_q - merged).unsqueeze(-1))
            out_q.add_(part.float() * torch.exp(part_lse - merged).unsqueeze(-1))
            lse_q.copy_(merged)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.kernel = ring, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        groups = q.size(1) // k.size(1)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with kv, back to its owner
        for step in range(ring.size):
            qs, ks, causal, source = _blocks(step, ring.rank, ring.size, q.size(2))
            if step:
                kv = ring.pass_keys_values(kv, (source + 1) % ring.size)
                dkv = ring.pass_gradients(dkv, (source + 1) % ring.size)
            dq_t, dk_t, dv_t = pair_backward(dout[:, :, qs], q[:, :, qs], _expand(kv[0][:, :, ks], groups),
                                             _expand(kv[1][:, :, ks], groups), out[:, :, qs],
                                             lse[:, :, qs].contiguous(), causal, ctx.scale, ctx.kernel)
            dq[:, :, qs] += dq_t.float()
            dkv[0][:, :, ks] += _fold(dk_t.float(), groups)
            dkv[1][:, :, ks] += _fold(dv_t.float(), groups)
        dkv = ring.pass_gradients(dkv, (ring.rank + 1) % ring.size)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention_on(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                      kernel: Optional[str] = None) -> torch.Tensor:
    """``ring_attention`` over any ``Ring`` (a process group's, or megatron.model.ring_simulation's)."""
    if q.size(2) % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {q.size(2)} positions")
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    scale = q.size(-1) ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, scale, kernel or choose_kernel(q))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, cp_rank: int, cp_size: int,
                   scale: Optional[float] = None, explicit: bool = False, kernel: Optional[str] = None) -> torch.Tensor:
    """Causal attention of this rank's ``q`` [b, heads, s, d] against the whole sequence's keys and values, of
    which this rank holds ``k``, ``v`` [b, kv heads, s, d] (grouped-query heads share them in groups of
    heads / kv heads); ``s`` = S / C tokens at ``chunk_positions(S, cp_rank, cp_size)``. Returns [b, heads, s, d]
    in q's dtype. ``kernel`` names the per-step kernel (KERNELS; by default ``choose_kernel``'s); ``explicit``
    is kernel ``explicit`` (tests compare it with the fused kernels)."""
    if explicit and kernel not in (None, "explicit"):
        raise ValueError(f"ring_attention: explicit=True is kernel 'explicit', not {kernel!r}; pass one of the two")
    return ring_attention_on(ProcessGroupRing(group, cp_rank, cp_size), q, k, v, scale,
                             "explicit" if explicit else kernel)
