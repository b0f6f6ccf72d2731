"""The check that a checkpoint's files load without unpickling code: every model-state, layer, expert and RNG file
with ``torch.load(weights_only=True)`` and nothing allowed beyond torch's own types (no numpy, no pickled
classes: DeepSpeed's own objects, which a run without ZeRO keeps in the model-states file, are written as
plain-data records, megatron.checkpoint.files.as_plain_data), and each non-pipeline
``mp_rank_XX_model_states.pt`` with a plain ``torch.load`` as GPT-NeoX's tools/ckpts/convert_neox_to_hf.py reads
it. Left to DeepSpeed: its optimizer files (``*optim_states.pt``)."""

import os
import pickle
from typing import List

import torch



def checkpoint_files(path: str) -> List[str]:
    """The ``.pt`` files of checkpoint directory ``path`` that must load with weights_only (sorted names)."""
    return sorted(name for name in os.listdir(path) if name.endswith(".pt") and not name.endswith("optim_states.pt"))


def _refused(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (its GLOBAL line)."""
    return ([line.strip() for line in str(exc).splitlines() if "GLOBAL" in line] or [repr(exc)])[0]


def _load(file: str) -> None:
    state = torch.load(file, map_location="cpu", weights_only=True)
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
