"""Ring attention's context-parallel ranks played one after another on one device, with no process group.

For checks that have one device and no ranks: the tests (every kernel's output and gradients against attention
over the whole sequence; the tensors a ring step allocates), bench/context_parallel_memory.py and the GPU check
(CP=2 on one GPU: memory and time per rank). A ``SimulatedRing`` stands for rank ``rank``: it hands out the keys
and values the real ring would deliver at each step, and instead of sending a gradient accumulator on it adds it
to that source's total and hands back zeros (the buffer a real rank would receive into), so that once every rank
has run its backward pass the totals are each rank's dk and dv. Each rank's work is the real one (same kernels,
same blocks, same merges); only the exchanges are references instead of copies.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron.model.ring_attention import ring_attention_on
from megatron.mpu.context_parallel import chunk_positions, split_sequence


class SimulatedRing:
    """Rank ``rank`` of a ring of len(``keys_values``) ranks: ``keys_values[s]`` is rank s's stacked (k, v);
    ``gradients[s]``, fp32 and shaped like it, receives the gradient accumulators sent for rank s."""

    def __init__(self, rank: int, keys_values: List[torch.Tensor], gradients: List[torch.Tensor]):
        self.rank, self.size = rank, len(keys_values)
        self.keys_values, self.gradients = keys_values, gradients

    def pass_keys_values(self, kv: torch.Tensor, source: int) -> torch.Tensor:
        return self.keys_values[(source - 1) % self.size]  # what rank - 1 holds: the previous source's

    def pass_gradients(self, dkv: torch.Tensor, source: int) -> torch.Tensor:
        self.gradients[source] += dkv
        return torch.zeros_like(dkv)


class SimulatedContextParallel:
    """Whole sequences ``q`` [b, heads, S, d], ``k``, ``v`` [b, kv heads, S, d] split as ``cp_size``
    context-parallel ranks hold them; ``run_rank`` is one rank's ring attention (forward, and backward given
    its share of the output gradient)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int):
        self.seq, self.cp_size = q.size(2), cp_size
        self.local = [[split_sequence(t.detach(), r, cp_size, dim=2) for t in (q, k, v)] for r in range(cp_size)]
        self.keys_values = [torch.stack((lk, lv)) for _, lk, lv in self.local]
        self.gradients = [torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) for kv in self.keys_values]

    def positions(self, rank: int) -> torch.Tensor:
        return chunk_positions(self.seq, rank, self.cp_size, self.keys_values[0].device)

    def share(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s part of a whole-sequence [b, heads, S, d] tensor."""
        return split_sequence(tensor, rank, self.cp_size, dim=2)

    def run_rank(self, rank: int, grad_out: Optional[torch.Tensor] = None,
                 kernel: Optional[str] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(this rank's output, its dq given ``grad_out``, its share of the output gradient); its part of every
        rank's dk and dv goes to ``gradients``."""
        mine = [t.detach().requires_grad_(grad_out is not None) for t in self.local[rank]]
        out = ring_attention_on(SimulatedRing(rank, self.keys_values, self.gradients), *mine, kernel=kernel)
        if grad_out is None:
            return out.detach(), None
        out.backward(grad_out)
        return out.detach(), mine[0].grad

    def key_value_grads(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """dk, dv of the whole sequence in ``like``'s dtype (complete once every rank has run its backward)."""
        shape = (*self.gradients[0].shape[1:3], self.seq, self.gradients[0].size(-1))
        dk, dv = (torch.zeros(shape, dtype=like.dtype, device=like.device) for _ in range(2))
        for rank, total in enumerate(self.gradients):
            dk[:, :, self.positions(rank)], dv[:, :, self.positions(rank)] = total[0].to(like.dtype), \
                total[1].to(like.dtype)
        return dk, dv


def simulate_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int,
                            grad_out: Optional[torch.Tensor] = None,
                            kernel: Optional[str] = None) -> Tuple[torch.Tensor, ...]:
    """Causal attention of the whole sequences ``q`` [b, heads, S, d], ``k``, ``v`` [b, kv heads, S, d] computed
    as ``cp_size`` context-parallel ranks would, one after another: (output and, given ``grad_out``, dq, dk, dv),
    each [b, heads or kv heads, S, d] in q's dtype."""
    cp = SimulatedContextParallel(q, k, v, cp_size)
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    for rank in range(cp_size):
        part_grad = None if grad_out is None else cp.share(grad_out, rank)
        out[:, :, cp.positions(rank)], dq_rank = cp.run_rank(rank, part_grad, kernel)
        if dq_rank is not None:
            dq[:, :, cp.positions(rank)] = dq_rank
    return (out,) if grad_out is None else (out, dq, *cp.key_value_grads(k))
