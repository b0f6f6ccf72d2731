"""Each process's random-number generators (python, numpy, torch, CUDA): what a checkpoint saves of them and how a
resume sets them back, from this project's files or from the RNG entries of GPT-NeoX's client state.

Saved as plain data, so that every file holding them loads with ``torch.load(weights_only=True)`` (and so with a
plain ``torch.load`` on torch >= 2.6, as GPT-NeoX's tools read checkpoints): python's state is already a tuple of
ints; numpy's ``get_state()`` tuple holds a uint32 ndarray, saved as a list of ints, which ``np.random.set_state``
takes as it is (GPT-NeoX's loader included); torch's and CUDA's are byte tensors. Checkpoints saved before hold
numpy's ndarray; the safe loader still reads them (megatron.checkpoint.files.checkpoint_globals).

Where a checkpoint keeps them, and why there: every rank writes its own state once, to
``rng_state_rank{R}.pt``, and a resume reads it from there, once (megatron.checkpoint.engine.restore_rng).
GPT-NeoX keeps RNG states in the client state of its mp_rank files (``random_rng_state``, ``np_rng_state``,
``torch_rng_state``, ``cuda_rng_state``), but those hold the state of whichever rank DeepSpeed has write that file
(data-parallel rank 0, one per tensor rank; others under ZeRO-3, MoE or a pipeline), so they cannot stand for every
rank, and GPT-NeoX's loader cannot use them from our checkpoints anyway: it also needs its CUDA tracker's
``rng_tracker_states`` (tools/ckpts/README.md), so it reads ours with no_load_rng. This project writes them no
more; it reads them from GPT-NeoX's checkpoints. A rank with no file of its own in one of ours (a reshard onto more
ranks than saved) takes rank 0's."""
import os
import random
from typing import Any, Dict, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.checkpoint.files import load_checkpoint_file

GPT_NEOX_KEYS = {"python": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
                 "cuda": "cuda_rng_state"}
"""Our name of each generator -> the key GPT-NeoX's client state keeps it under."""


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_file(path: str, rank: int) -> str:
    """The file of checkpoint ``path`` holding rank ``rank``'s RNG states."""
    return os.path.join(path, f"rng_state_rank{rank}.pt")


def _numpy_state() -> tuple:
    """``np.random.get_state()`` with its key array as a list of ints: plain data, which set_state accepts."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return name, keys.tolist(), int(position), int(has_gauss), float(cached_gaussian)


TRACKER_KEY = "tracker"
"""The entry holding the model's RNGStatesTracker streams (megatron.mpu.random: the model-parallel stream that
attention dropout and row-parallel LoRA dropout draw from), {name: (CPU state, CUDA state or None)}."""


def rng_states(tracker=None) -> Dict[str, Any]:
    """This process's RNG states (python, numpy, torch [, cuda], and ``tracker``'s named streams when given), as the
    checkpoint saves them: plain data."""
    states = {"python": random.getstate(), "numpy": _numpy_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    if tracker is not None:
        states[TRACKER_KEY] = tracker.get_states()
    return states


def set_rng_states(states: Mapping[str, Any], tracker=None) -> None:
    """Restore the states ``rng_states`` returned (or, from checkpoints saved before, numpy's as an ndarray), and
    ``tracker``'s streams where the checkpoint holds them (one saved before they were kept leaves the tracker at its
    seeds: such a resume draws other dropout masks than the uninterrupted run did)."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if tracker is not None and TRACKER_KEY in states:
        saved = dict(states[TRACKER_KEY])
        if not torch.cuda.is_available():  # a CUDA run's streams resumed on CPU: their CPU half only
            saved = {name: (cpu, None) for name, (cpu, _cuda) in saved.items()}
        tracker.set_states(saved)


def saved_rng_states(path: str, client_state: Mapping[str, Any], rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s RNG states in checkpoint ``path``: its ``rng_state_rank{R}.pt``, else GPT-NeoX's entries
    of the client state (``client_state``: the one loaded with the checkpoint), else rank 0's file; None when it
    saved none (no_save_rng)."""
    own, first = rng_file(path, rank), rng_file(path, 0)
    if os.path.isfile(own):
        return load_checkpoint_file(own)
    if GPT_NEOX_KEYS["python"] in client_state:
        return {name: client_state[key] for name, key in GPT_NEOX_KEYS.items() if key in client_state}
    return load_checkpoint_file(first) if os.path.isfile(first) else None
