"""Moving rows between token order and the expert-sorted slot order of a dropless layer, as permutations.

A layer's T x k (token, choice) slots are sorted by expert (``layer.permutation``); ``token_of_slot`` [T * k] names
each sorted slot's token, ``positions`` [T, k] each token's k sorted slots in ascending order (that is, by expert).
Both maps are permutations of the slots, so each direction is a gather whose gradient is a gather the other way:

* ``dispatch``: token rows -> slot rows (``tokens[token_of_slot]``); backward: each token's k slot gradients
  gathered and added;
* ``combine``: slot rows -> token rows (each token's k slots added); backward: ``grad[token_of_slot]``.

Plain autograd would see ``tokens[token_of_slot]`` and an ``index_add_`` into zeros: the first's backward is an
accumulating ``index_put_`` and the second's forward a ``scatter_add``, both into a zero-filled [T, hidden] tensor
and serial on a CPU (the scatter_add took 35 ms per layer at T = 2048, hidden 512 in a step profiled on 2 busy cores
of issue 34's machine; on one core the layer's forward and backward take the same time either way, about 1% less
here). The gathers give the same numbers bit for bit: both add a token's slots in ascending slot order (0 + s_0 +
s_1 + ... there, s_0 + s_1 + ... here)."""
from __future__ import annotations

import torch


def slot_positions(order: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, k] int64: the sorted positions of each token's k slots, ascending. ``order`` [T * k] sorts the slots
    (position p holds slot order[p], slot t * k + j being token t's choice j)."""
    positions = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return positions.view(-1, top_k).sort(dim=1).values


def add_slots(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[T, hidden]: row t is the sum of rows[positions[t, 0]], rows[positions[t, 1]], ... in that order."""
    out = rows.index_select(0, positions[:, 0])
    for j in range(1, positions.shape[1]):
        out.add_(rows.index_select(0, positions[:, j]))
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        return tokens.index_select(0, token_of_slot)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        return add_slots(grad, positions), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, slots: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token_of_slot)
        return add_slots(slots, positions)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token_of_slot,) = ctx.saved_tensors
        return grad.index_select(0, token_of_slot), None, None


def dispatch(tokens: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens [T, hidden] -> [T * k, hidden], sorted slot p holding its token's row (module docstring)."""
    return _Dispatch.apply(tokens, token_of_slot, positions)


def combine_slots(slots: torch.Tensor, token_of_slot: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """slots [T * k, hidden] (every sorted slot) -> [T, hidden], each token's slots added (module docstring)."""
    return _Combine.apply(slots, token_of_slot, positions)
