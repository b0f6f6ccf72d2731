"""Reading checkpoint files without running code from them.

`torch.load(weights_only=False)` unpickles anything: a checkpoint holding `os.system(...)` runs it on resume
or conversion. Every checkpoint file of this project, GPT-NeoX's and DeepSpeed's is read here with
`weights_only=True`, which rebuilds tensors, numbers, strings and containers and, besides those, only the
classes listed in `checkpoint_globals()`: numpy's arrays (the numpy RNG state of GPT-NeoX's checkpoints and of
this project's saved before its RNG states became plain data, megatron.checkpoint.rng_state), DeepSpeed's loss
scaler, ZeRO stage enum and fragment addresses (its optimizer files). A file that needs anything else is refused with a
CheckpointError naming the file and the object, and nothing of it runs.

DeepSpeed reads and writes its own files through the engine's checkpoint engine: `use_safe_loading(engine)`
makes it read them here, and write DeepSpeed's own objects (the loss scaler and the bf16 optimizer's fragment
addresses, which a run without ZeRO keeps in the model-states file) as plain-data records (`as_plain_data`),
which this reader turns back into those objects (`from_plain_data`): so that every file this project writes but
DeepSpeed's optimizer files (left as DeepSpeed writes them, for its own tools) loads with a plain
`torch.load(weights_only=True)`, GPT-NeoX's converter's way."""

import collections
import os
import pickle
from typing import Any, Callable, Dict, List

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


DEEPSPEED_OBJECT = "__deepspeed_object__"
"""The key of a plain-data record standing for one of DeepSpeed's objects (as_plain_data)."""
DEEPSPEED_CLASSES = {cls.__name__: cls for cls in (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)}
"""The only classes a record may name: a record names a class of this table, never one to import."""


def _rebuilt(obj: Any, convert: Callable[[Any], Any]) -> Any:
    """``obj`` with ``convert`` applied to it and, where it returns its argument unchanged, to every item of its
    dicts, lists and tuples (containers rebuilt, every other object as it is)."""
    converted = convert(obj)
    if converted is not obj:
        return converted
    if isinstance(obj, dict):
        items = [(key, _rebuilt(value, convert)) for key, value in obj.items()]
        return type(obj)(items) if type(obj) in (dict, collections.OrderedDict) else dict(items)
    if type(obj) in (list, tuple):
        return type(obj)(_rebuilt(item, convert) for item in obj)
    return obj


def _as_record(obj: Any) -> Any:
    """One of DeepSpeed's objects of DEEPSPEED_CLASSES as its record; anything else as it is."""
    if isinstance(obj, ZeroStageEnum):
        return {DEEPSPEED_OBJECT: "ZeroStageEnum", "value": int(obj)}
    if isinstance(obj, fragment_address):
        return {DEEPSPEED_OBJECT: "fragment_address", "value": [obj.numel, obj.start]}
    if isinstance(obj, (LossScaler, DynamicLossScaler)):  # numbers, flags and a torch dtype
        return {DEEPSPEED_OBJECT: type(obj).__name__, "value": as_plain_data(dict(vars(obj)))}
    return obj


def _from_record(obj: Any) -> Any:
    """A record of as_plain_data back into the object it stands for; anything else as it is."""
    if not (isinstance(obj, dict) and obj.get(DEEPSPEED_OBJECT) in DEEPSPEED_CLASSES):
        return obj
    cls, value = DEEPSPEED_CLASSES[obj[DEEPSPEED_OBJECT]], obj["value"]
    if cls is ZeroStageEnum:
        return ZeroStageEnum(value)
    if cls is fragment_address:
        return fragment_address(*value)
    scaler = cls.__new__(cls)
    scaler.__dict__.update(from_plain_data(value))
    return scaler


def as_plain_data(obj: Any) -> Any:
    """``obj`` (a state dict DeepSpeed saves) with each of DeepSpeed's objects of DEEPSPEED_CLASSES replaced by a
    record of plain data: ``{DEEPSPEED_OBJECT: class name, "value": ...}`` (containers rebuilt, tensors as they
    are)."""
    return _rebuilt(obj, _as_record)


def from_plain_data(obj: Any) -> Any:
    """The inverse of as_plain_data: each record back into the DeepSpeed object it stands for."""
    return _rebuilt(obj, _from_record)


def savable(state_dict: Any, path: str) -> Any:
    """What DeepSpeed's checkpoint engine writes to ``path``: ``state_dict`` as plain data (as_plain_data), except in
    DeepSpeed's optimizer files (``*optim_states.pt``), which DeepSpeed's own tools read as they are
    (deepspeed.utils.zero_to_fp32 compares their ZeRO stage with numbers)."""
    return state_dict if path.endswith("optim_states.pt") else as_plain_data(state_dict)


def load_checkpoint_file(path: str, mmap: bool = False, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True and checkpoint_globals(); mmap where the file allows it (zip format);
    DeepSpeed's objects saved as records (as_plain_data) come back as objects."""
    return from_plain_data(_load_weights_only(path, mmap, map_location))


def _load_weights_only(path: str, mmap: bool, map_location: Any) -> Any:
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
    load_checkpoint_file (its default reader unpickles anything), whatever its checkpoint engine, and the default
    engine write DeepSpeed's own objects as plain-data records (asynchronous saving does the same:
    megatron.checkpoint.async_save). An engine told to read universal checkpoints is refused: DeepSpeed reads
    those past its checkpoint engine, with torch.load(weights_only=False) (the config refuses the setting first:
    megatron.neox_arguments.deepspeed_config.UNSAFE_LOADING_KEYS)."""
    universal = getattr(engine, "load_universal_checkpoint", None)
    if callable(universal) and universal():
        raise CheckpointError("checkpoint.load_universal is set: DeepSpeed reads universal checkpoints with "
                              "torch.load(weights_only=False), which runs any code a planted file holds; remove it")
    reader = getattr(engine, "checkpoint_engine", None)
    if reader is None:
        return
    reader.load = lambda path, map_location=None: load_checkpoint_file(path, map_location=map_location)
    if type(reader) is TorchCheckpointEngine:  # other engines (e.g. asynchronous saving) write as they do
        save = reader.save
        reader.save = lambda state_dict, path: save(savable(state_dict, path), path)


def load_lazily(path: str) -> Any:
    """A checkpoint file, memory-mapped where the file allows it (the weights are read only when used);
    nothing but tensors and plain data is unpickled (megatron.checkpoint.files)."""
    return load_checkpoint_file(path, mmap=True)


def read_client_state(path: str) -> Dict[str, Any]:
    """The client state (every entry but `module`) of checkpoint ``path``'s first mp_rank file (ZeRO-3's first
    zero_pp_rank_0_mp_rank_XX file, where it keeps it)."""
    files = sorted(f for f in model_files(path) if MP_FILE.search(os.path.basename(f))) or \
        sorted(f for f in model_files(path) if os.path.basename(f).startswith("zero_pp_rank_0_mp_rank_"))
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
