"""The check that a checkpoint's files load without unpickling code: every model-state, layer, expert and RNG file
with ``torch.load(weights_only=True)`` and nothing allowed beyond torch's own types (no numpy, no pickled
classes), and each non-pipeline ``mp_rank_XX_model_states.pt`` with a plain ``torch.load`` as GPT-NeoX's
tools/ckpts/convert_neox_to_hf.py reads it. Left to DeepSpeed: its optimizer files (``*optim_states.pt``) and, in a
run without ZeRO, the optimizer state DeepSpeed keeps in the model file (its bf16 optimizer's fragment addresses,
fp16's loss scaler); those may name DeepSpeed's classes, which megatron.checkpoint.files reads with the safe
loader, and nothing else."""

import os
import pickle
from typing import List

import torch

from megatron.checkpoint.files import checkpoint_globals


def checkpoint_files(path: str) -> List[str]:
    """The ``.pt`` files of checkpoint directory ``path`` that must load with weights_only (sorted names)."""
    return sorted(name for name in os.listdir(path) if name.endswith(".pt") and not name.endswith("optim_states.pt"))


def _refused(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (its GLOBAL line)."""
    return ([line.strip() for line in str(exc).splitlines() if "GLOBAL" in line] or [repr(exc)])[0]


def _load(file: str) -> None:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        deepspeeds = [g for g in checkpoint_globals() if not getattr(g, "__module__", "").startswith("numpy")]
        with torch.serialization.safe_globals(deepspeeds):
            state = torch.load(file, map_location="cpu", weights_only=True)
        assert isinstance(state, dict) and state.get("optimizer") is not None, \
            f"{file} does not load with weights_only=True: {_refused(exc)}"  # only DeepSpeed's optimizer state may
        return
    if os.path.basename(file).startswith("mp_rank_") and state.get("module"):
        torch.load(file, map_location="cpu")  # GPT-NeoX's converter: no weights_only argument


def assert_loads_weights_only(path: str) -> List[str]:
    """Load every file of ``checkpoint_files(path)`` as the module docstring says; returns their names. Fails
    naming the file and what torch refused in it, and when ``path`` holds no model-state file (a check of
    nothing)."""
    names = checkpoint_files(path)
    assert any(name.endswith("model_states.pt") for name in names), f"{path} holds no model-state file: {names}"
    for name in names:
        try:
            _load(os.path.join(path, name))
        except pickle.UnpicklingError as exc:
            raise AssertionError(f"{os.path.join(path, name)} does not load with weights_only=True: "
                                 f"{_refused(exc)}") from None
    return names
