"""The check that a checkpoint's files load without unpickling code: every model-state, layer, expert and RNG file
with ``torch.load(weights_only=True)`` and nothing allowed beyond torch's own types (no numpy, no pickled
classes), and each non-pipeline ``mp_rank_XX_model_states.pt`` with a plain ``torch.load`` as GPT-NeoX's
tools/ckpts/convert_neox_to_hf.py reads it. Only DeepSpeed's optimizer files (``*optim_states.pt``) are left out:
they keep DeepSpeed's classes, which megatron.checkpoint.files reads with the safe loader."""

import os
from typing import List

import torch


def checkpoint_files(path: str) -> List[str]:
    """The ``.pt`` files of checkpoint directory ``path`` that must load with weights_only (sorted names)."""
    return sorted(name for name in os.listdir(path) if name.endswith(".pt") and not name.endswith("optim_states.pt"))


def assert_loads_weights_only(path: str) -> List[str]:
    """Load every file of ``checkpoint_files(path)`` with weights_only=True; returns their names. Fails naming the
    file and what torch refused in it; and when ``path`` holds no model-state file (a check of nothing)."""
    names = checkpoint_files(path)
    assert any(name.endswith("model_states.pt") for name in names), f"{path} holds no model-state file: {names}"
    for name in names:
        try:
            state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
            if name.startswith("mp_rank_") and state.get("module"):  # GPT-NeoX's converter: no weights_only argument
                state = torch.load(os.path.join(path, name), map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - the file's name is what the failure must say
            said = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line] or [repr(exc)]
            raise AssertionError(f"{os.path.join(path, name)} does not load with weights_only=True: {said[0]}") \
                from None
    return names
