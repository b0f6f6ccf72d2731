"""Each process's random-number generators (python, numpy, torch, CUDA): what a checkpoint saves of them and how a
resume sets them back, and the RNG entries of GPT-NeoX's client state."""
import random
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist


def process_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_states() -> Dict[str, Any]:
    """This process's RNG states (python, numpy, torch [, cuda]), as the checkpoint saves them."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states



def set_rng_states(states: Dict[str, Any]) -> None:
    """Restore the states ``rng_states`` returned."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def gpt_neox_rng_state() -> Dict[str, Any]:
    """The RNG entries of GPT-NeoX's client state (``cuda_rng_state`` only where CUDA is)."""
    states = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
              "torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda_rng_state"] = torch.cuda.get_rng_state()
    return states
