"""Reading and writing this framework's checkpoints (``save/global_stepN``) as one full state dict.

A checkpoint written by DeepSpeed's engine (see megatron/checkpointing.py) holds, for tensor-parallel
size T and pipeline size P:
  * P == 0 (GPT2ModelSequential): ``mp_rank_{t:02d}_model_states.pt`` for t < T, whose ``module`` is
    rank t's state dict with GPT2ModelSequential's names (``sequential.{slot}.*``, GPT-NeoX's);
  * P >= 1 (GPT2ModelPipe): ``layer_{i:02d}-model_{t:02d}-model_states.pt`` with the state dict of layer
    slot i (GPT-NeoX's slots, megatron.model.gpt2_model: 0 embedding, i + 2 transformer layer i, L + 3 final
    norm, L + 4 untied output head; a tied head is the embedding and is not saved again) on tensor rank t,
    plus ``mp_rank_{m:02d}_model_states.pt`` for every m < P*T with ``module`` None (DeepSpeed's engine
    metadata);
  * ZeRO-3 (P == 0): ``zero_pp_rank_*_mp_rank_*`` files, consolidated with DeepSpeed's zero_to_fp32;
plus ``neox_args.json``, ``configs/*.yml``, ``COMPLETE`` and, one level up, ``latest``.
Reading merges everything into one flat state dict (``embedding.*``, ``layers.N.*``, ``final_norm.*``,
``head.*``: ``megatron.model.gpt2_model.slot_prefixes``); writing splits such a state dict again.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional

import torch

from megatron.checkpoint_conversion.errors import ConversionError
from megatron.checkpoint_conversion.tensor_parallel import merge_shards, split_full

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest"
ARGS_FILE = "neox_args.json"
_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
_MP_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
_COMPUTED_BUFFERS = ("rotary.inv_freq",)


@dataclasses.dataclass
class NeoxCheckpoint:
    """A merged checkpoint: full tensors under GPT2ModelSequential names, and the run's arguments."""

    state: Dict[str, torch.Tensor]
    args: Dict[str, Any]
    path: str


def gated_mlp(args: Mapping[str, Any]) -> bool:
    """Whether the MLP's first projection is a fused [up | gate] pair (GLU activations)."""
    from megatron.model.activations import get_activation

    try:
        return get_activation(args.get("activation") or "gelu")[1]
    except ValueError as exc:
        raise ConversionError(str(exc)) from None


def resolve_checkpoint_dir(path: str) -> str:
    """``path`` itself when it is a global_stepN directory; the tag ``latest`` names when it is a save dir."""
    if not os.path.isdir(path):
        raise ConversionError(f"--input_dir {path!r} does not exist; pass a checkpoint directory such as "
                              f"save/global_step1000")
    latest = os.path.join(path, LATEST_FILE)
    if not _model_files(path) and os.path.isfile(latest):
        with open(latest, encoding="utf-8") as handle:
            path = os.path.join(path, handle.read().strip())
    if not _model_files(path):
        raise ConversionError(f"{path!r} holds no DeepSpeed model files (mp_rank_*_model_states.pt or "
                              f"layer_*-model_*-model_states.pt); pass a checkpoint directory such as "
                              f"save/global_step1000")
    return path


def _model_files(path: str) -> List[str]:
    return sorted(glob.glob(os.path.join(path, "*model_states.pt")))


def read_args_file(path: str) -> Dict[str, Any]:
    """The NeoXArgs a checkpoint was saved with (its neox_args.json)."""
    args_file = os.path.join(path, ARGS_FILE)
    if not os.path.isfile(args_file):
        raise ConversionError(f"{args_file} is missing; pass the run's YAML files with --config_file")
    with open(args_file, encoding="utf-8") as handle:
        return json.load(handle)


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise ConversionError(f"cannot read {path}: {exc}") from None


def _without_buffers(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.endswith(_COMPUTED_BUFFERS)}


def _pipeline_prefix(index: int, num_layers: int) -> str:
    from megatron.model.gpt2_model import slot_prefixes

    prefixes = slot_prefixes(num_layers)
    if index not in prefixes:
        raise ConversionError(f"pipeline layer file index {index} does not fit num_layers={num_layers}")
    return prefixes[index]


def flat_state_dict(module: Mapping[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """GPT2ModelSequential's ``sequential.{slot}.*`` keys as the flat names."""
    flat = {}
    for key, value in module.items():
        slot, _, rest = key[len("sequential."):].partition(".")
        if not key.startswith("sequential.") or not slot.isdigit():
            raise ConversionError(f"unexpected parameter {key!r} in a model-states file (expected sequential.N.*)")
        flat[_pipeline_prefix(int(slot), num_layers) + rest] = value
    return flat


def sequential_state_dict(state: Mapping[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """Inverse of flat_state_dict."""
    from megatron.model.gpt2_model import slot_prefixes

    by_prefix = {prefix: slot for slot, prefix in slot_prefixes(num_layers).items()}
    out = {}
    for name, value in state.items():
        prefix = next(p for p in by_prefix if name.startswith(p))
        out[f"sequential.{by_prefix[prefix]}.{name[len(prefix):]}"] = value
    return out


def _merge(per_rank: List[Dict[str, torch.Tensor]], gated: bool, source: str) -> Dict[str, torch.Tensor]:
    names = list(per_rank[0])
    for rank, state in enumerate(per_rank[1:], start=1):
        if set(state) != set(names):
            raise ConversionError(f"{source}: tensor-parallel rank {rank} holds other parameters than rank 0")
    return {name: merge_shards(name, [s[name] for s in per_rank], gated) for name in names}


def read_checkpoint(path: str, args: Optional[Mapping[str, Any]] = None) -> NeoxCheckpoint:
    """Merge the shards of checkpoint ``path`` (a global_stepN directory, or a save directory with
    ``latest``); ``args`` (a NeoXArgs dict) defaults to the checkpoint's neox_args.json."""
    path = resolve_checkpoint_dir(path)
    args = dict(args) if args is not None else read_args_file(path)
    gated = gated_mlp(args)
    files = _model_files(path)
    layer_files = [f for f in files if _LAYER_FILE.search(os.path.basename(f))]
    if layer_files:
        state = _read_pipeline(layer_files, int(args["num_layers"]), gated)
    elif any(os.path.basename(f).startswith("zero_pp_rank_") for f in files):
        state = flat_state_dict(_read_zero3(path), int(args["num_layers"]))
    else:
        mp_files = sorted((f for f in files if _MP_FILE.search(os.path.basename(f))),
                          key=lambda f: int(_MP_FILE.search(f).group(1)))
        per_rank = []
        for f in mp_files:
            module = _load(f).get("module")
            if module is None:
                raise ConversionError(f"{f} holds no model weights ('module' is empty) and there are no "
                                      f"layer_*-model_*-model_states.pt files")
            per_rank.append(flat_state_dict(_without_buffers(module), int(args["num_layers"])))
        state = _merge(per_rank, gated, path)
    return NeoxCheckpoint(state=state, args=args, path=path)


def _read_pipeline(layer_files: List[str], num_layers: int, gated: bool) -> Dict[str, torch.Tensor]:
    by_layer: Dict[int, Dict[int, str]] = {}
    for f in layer_files:
        match = _LAYER_FILE.search(os.path.basename(f))
        by_layer.setdefault(int(match.group(1)), {})[int(match.group(2))] = f
    state: Dict[str, torch.Tensor] = {}
    for index in sorted(by_layer):
        ranks = by_layer[index]
        if sorted(ranks) != list(range(len(ranks))):
            raise ConversionError(f"pipeline layer {index}: tensor-parallel files {sorted(ranks)} are incomplete")
        per_rank = [_without_buffers(_load(ranks[r])) for r in range(len(ranks))]
        prefix = _pipeline_prefix(index, num_layers)
        merged = _merge([{prefix + k: v for k, v in s.items()} for s in per_rank], gated, ranks[0])
        state.update(merged)
    return state


def _read_zero3(path: str) -> Dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    mp = {re.search(r"mp_rank_(\d+)", os.path.basename(f)).group(1) for f in _model_files(path)}
    if len(mp) != 1:
        raise ConversionError(f"{path}: ZeRO-3 checkpoints with model_parallel_size > 1 are not supported by "
                              f"this converter; train with ZeRO stage 0-2 or model_parallel_size 1")
    root, tag = os.path.split(os.path.normpath(path))
    return _without_buffers(get_fp32_state_dict_from_zero_checkpoint(root, tag=tag))


def _engine_metadata(mp_world: int, tp: int, pp: int, iteration: int) -> Dict[str, Any]:
    """The non-weight entries DeepSpeed's engine writes into (and reads back from) mp_rank_* files."""
    import deepspeed

    return {"buffer_names": [], "optimizer": None, "param_shapes": None, "frozen_param_shapes": None,
            "shared_params": None, "frozen_param_fragments": None, "lr_scheduler": None, "data_sampler": None,
            "random_ltd": None, "skipped_steps": 0, "global_steps": iteration, "global_samples": 0,
            "dp_world_size": 1, "mp_world_size": mp_world,
            "checkpoint_parallel_dimensions": {"pp_degree": max(pp, 1), "tp_degree": tp},
            "ds_config": {}, "ds_version": deepspeed.__version__, "iteration": iteration}


def _save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_checkpoint(save_dir: str, state: Mapping[str, torch.Tensor], args: Mapping[str, Any],
                     config_files: Mapping[str, str], iteration: int = 0) -> str:
    """Write ``state`` (full tensors, GPT2ModelSequential names) as ``save_dir/global_step{iteration}`` in
    the layout DeepSpeed loads for ``args``' model_parallel_size / pipe_parallel_size, with neox_args.json,
    configs/, COMPLETE and ``latest``. Returns the checkpoint directory."""
    tp = int(args.get("model_parallel_size") or 1)
    pp = int(args.get("pipe_parallel_size") or 0)
    gated = gated_mlp(args)
    tag = f"global_step{iteration}"
    path = os.path.join(save_dir, tag)
    os.makedirs(os.path.join(path, "configs"), exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        for rank, piece in enumerate(split_full(name, tensor, tp, gated)):
            shards[rank][name] = piece.detach().clone().contiguous()  # clone: never save a view's storage
    if pp == 0:
        for rank in range(tp):
            _save({"module": sequential_state_dict(shards[rank], int(args["num_layers"])),
                   **_engine_metadata(tp, tp, pp, iteration)},
                  os.path.join(path, f"mp_rank_{rank:02d}_model_states.pt"))
    else:
        num_layers = int(args["num_layers"])
        from megatron.model.gpt2_model import slot_prefixes

        for index, prefix in slot_prefixes(num_layers).items():
            for rank in range(tp):
                layer = {k[len(prefix):]: v for k, v in shards[rank].items() if k.startswith(prefix)}
                if layer:
                    _save(layer, os.path.join(path, f"layer_{index:02d}-model_{rank:02d}-model_states.pt"))
        for mp_rank in range(pp * tp):
            _save({"module": None, **_engine_metadata(pp * tp, tp, pp, iteration)},
                  os.path.join(path, f"mp_rank_{mp_rank:02d}_model_states.pt"))
    with open(os.path.join(path, ARGS_FILE), "w", encoding="utf-8") as handle:
        json.dump(dict(args), handle, indent=1, sort_keys=True, default=str)
    for name, text in config_files.items():
        with open(os.path.join(path, "configs", os.path.basename(name)), "w", encoding="utf-8") as handle:
            handle.write(text)
    with open(os.path.join(path, COMPLETE_MARKER), "w", encoding="utf-8") as handle:
        handle.write(f"{iteration}\n")
    with open(os.path.join(save_dir, LATEST_FILE), "w", encoding="utf-8") as handle:
        handle.write(tag)
    return path
