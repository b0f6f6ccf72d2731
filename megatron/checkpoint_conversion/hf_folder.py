"""Reading and writing a local Hugging Face model folder (config.json + safetensors), never the Hub."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Tuple

import torch
from safetensors.torch import load_file, save_file

from megatron.checkpoint.files import load_checkpoint_file
from megatron.checkpoint_conversion.common import transformers_module
from megatron.errors import CheckpointError, ConversionError
from megatron.utils.hf_folders import remote_code_problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS_FILE = "model.safetensors"


def load_hf_config(hf_dir: str) -> Any:
    """The transformers config of ``hf_dir`` (local files only, never the folder's own code)."""
    transformers = transformers_module()
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConversionError(f"--hf_dir {hf_dir!r} has no config.json; pass a local Hugging Face model folder "
                              f"(written by save_pretrained)")
    problem = remote_code_problem(hf_dir)
    if problem:
        raise ConversionError(problem)
    try:
        return transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ConversionError(f"cannot read {os.path.join(hf_dir, 'config.json')}: {exc}") from None


def load_hf_weights(hf_dir: str) -> Dict[str, torch.Tensor]:
    """Every tensor of ``hf_dir``: model.safetensors, a sharded safetensors index, or pytorch_model.bin."""
    single = os.path.join(hf_dir, WEIGHTS_FILE)
    if os.path.isfile(single):
        return load_file(single)
    for index_name, loader in (("model.safetensors.index.json", load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        index = os.path.join(hf_dir, index_name)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            state: Dict[str, torch.Tensor] = {}
            for name in files:
                state.update(loader(os.path.join(hf_dir, name)))
            return state
    legacy = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(legacy):
        return _load_bin(legacy)
    raise ConversionError(f"--hf_dir {hf_dir!r} has no weights (model.safetensors, model.safetensors.index.json "
                          f"or pytorch_model.bin)")


def _load_bin(path: str) -> Dict[str, torch.Tensor]:
    """A pickled state dict, through the checkpoint reader that unpickles nothing but tensors and plain data."""
    try:
        return load_checkpoint_file(path)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None


def load_hf_folder(hf_dir: str) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(config, state dict) of a local Hugging Face folder."""
    return load_hf_config(hf_dir), load_hf_weights(hf_dir)


def save_hf_folder(out_dir: str, config: Any, state: Mapping[str, torch.Tensor], precision: str = "fp32") -> None:
    """config.json and model.safetensors with every floating tensor cast to ``precision``."""
    if precision not in DTYPES:
        raise ConversionError(f"--precision {precision!r}: choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[precision]
    os.makedirs(out_dir, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(out_dir)
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().clone().contiguous()
               for name, t in state.items()}
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
