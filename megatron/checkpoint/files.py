"""Reading checkpoint files without running code from them.

`torch.load(weights_only=False)` unpickles anything: a checkpoint holding `os.system(...)` runs it on resume
or conversion. Every checkpoint file of this project, GPT-NeoX's and DeepSpeed's is read here with
`weights_only=True`, which rebuilds tensors, numbers, strings and containers and, besides those, only the
classes listed in `checkpoint_globals()`: numpy's arrays (the numpy RNG state of GPT-NeoX's checkpoints and of
this project's saved before its RNG states became plain data, megatron.checkpoint.rng_state), DeepSpeed's loss
scaler, ZeRO stage enum and fragment addresses (its optimizer files). A file that needs anything else is refused with a
CheckpointError naming the file and the object, and nothing of it runs.

DeepSpeed reads its own files through the engine's checkpoint engine: `use_safe_loading(engine)` swaps in
one that reads them here."""

import os
import pickle
from typing import Any, Dict, List

import numpy as np
import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from megatron.checkpoint.format import (ARGS_FILE, GPT_NEOX, LAYOUT, LAYOUT_KEY, MP_FILE, OURS, OURS_OLD, model_files,
                                        read_saved_args)
from megatron.errors import CheckpointError


def checkpoint_globals() -> List[Any]:
    """The classes and functions (besides torch's own) a checkpoint may name."""
    allowed: List[Any] = [np.ndarray, np.dtype]
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    allowed.append(core.multiarray._reconstruct)
    allowed += [type(np.dtype(name)) for name in ("uint32", "int64", "float64", "float32", "int32")]
    allowed.append(core.multiarray.scalar)
    return allowed + [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_checkpoint_file(path: str, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True and checkpoint_globals(); mmap where the file allows it (zip format)."""
    try:
        with torch.serialization.safe_globals(checkpoint_globals()):
            if mmap:
                try:
                    return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
                except RuntimeError as exc:  # not a zip-format file: no memory map
                    if "mmap" not in str(exc) and "zip" not in str(exc):
                        raise
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message: a paragraph about weights_only, then the object it met ("... GLOBAL posix.system ...")
        named = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line]
        detail = named[0] if named else str(exc).splitlines()[0]
        raise CheckpointError(
            f"{path} holds a Python object that checkpoints do not contain ({detail}); it was not loaded, "
            f"since unpickling it could run code. Only tensors, numbers, strings, containers, numpy arrays and "
            f"DeepSpeed's optimizer bookkeeping are read from checkpoint files") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def use_safe_loading(engine) -> None:
    """Make DeepSpeed's engine read its checkpoint files (model, optimizer, pipeline layers, experts) through
    load_checkpoint_file; its default reader unpickles anything."""
    reader = getattr(engine, "checkpoint_engine", None)
    if type(reader) is TorchCheckpointEngine:  # other engines (e.g. asynchronous saving) are left as they are
        reader.load = lambda path, map_location=None: load_checkpoint_file(path, map_location=map_location)


def load_lazily(path: str) -> Any:
    """A checkpoint file, memory-mapped where the file allows it (the weights are read only when used);
    nothing but tensors and plain data is unpickled (megatron.checkpoint.files)."""
    return load_checkpoint_file(path, mmap=True)


def read_client_state(path: str) -> Dict[str, Any]:
    """The client state (every entry but `module`) of checkpoint ``path``'s first mp_rank file."""
    files = sorted(f for f in model_files(path) if MP_FILE.search(os.path.basename(f)))
    if not files:
        raise CheckpointError(f"{path} holds no mp_rank_XX_model_states.pt file")
    return {key: value for key, value in load_lazily(files[0]).items() if key != "module"}


def checkpoint_kind(path: str) -> str:
    """OURS, OURS_OLD or GPT_NEOX (see the module docstring). A directory of this project's without its
    neox_args.json (an interrupted save) counts as OURS, to be refused for its missing COMPLETE."""
    args_file = os.path.join(path, ARGS_FILE)
    if os.path.isfile(args_file):
        return OURS if read_saved_args(args_file).get(LAYOUT_KEY) == LAYOUT else OURS_OLD
    if not any(MP_FILE.search(os.path.basename(f)) for f in model_files(path)):
        return OURS
    return OURS if read_client_state(path).get(LAYOUT_KEY) else GPT_NEOX
