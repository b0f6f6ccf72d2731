"""Model-parallel random number streams.

Dropout on tensors that are replicated across tensor-parallel ranks (the residual stream) must draw
the same mask on every rank; dropout on tensors that are split across ranks (attention probabilities
of a rank's own heads) must draw independent masks. The default torch generator is seeded identically
on the TP ranks of a data-parallel replica; :class:`RNGStatesTracker` keeps extra named streams
(seeded per TP rank) that code enters with ``with tracker.fork():``.

The interface (``add``, ``fork``, ``get_states``, ``set_states``, ``reset``) matches DeepSpeed's
``deepspeed.checkpointing.get_cuda_rng_tracker()``, so the model can use DeepSpeed's tracker when
DeepSpeed activation checkpointing has to replay the streams during recomputation.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional, Tuple

import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718


State = Tuple[torch.Tensor, Optional[torch.Tensor]]


def _get_state() -> State:
    """CPU generator state, plus the current CUDA device's when CUDA is present."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state() if torch.cuda.is_available() else None)


def _set_state(state: State) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


def _clone(state: State) -> State:
    return state[0].clone(), (None if state[1] is None else state[1].clone())


class RNGStatesTracker:
    """Named RNG states for the default generators (CPU, and CUDA when present)."""

    def __init__(self) -> None:
        self.states: Dict[str, State] = {}

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> Dict[str, State]:
        return {name: _clone(state) for name, state in self.states.items()}

    def set_states(self, states: Dict[str, State]) -> None:
        self.states = {name: _clone(state) for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` from ``seed`` (names must be new)."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_state()
        torch.manual_seed(seed)  # seeds CUDA too
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; the default stream is left where it was."""
        if name not in self.states:
            raise ValueError(f"RNG stream {name!r} was never added")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)


def model_parallel_seed(seed: int, parallel_state, tracker) -> None:
    """Seed the default stream with ``seed`` and the tracker's model-parallel stream per TP rank.

    Pipeline stages get different default seeds (their layers differ anyway) as in Megatron.
    """
    default_seed = seed + 100 * parallel_state.get_pipe_parallel_rank()
    torch.manual_seed(default_seed)
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, default_seed + MODEL_PARALLEL_SEED_OFFSET
                + parallel_state.get_model_parallel_rank())
