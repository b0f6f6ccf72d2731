"""Reading and writing ``global_stepN`` checkpoints as one full state dict: GPT-NeoX's layout (written by this
project or by GPT-NeoX), and this project's older layouts (read only).

GPT-NeoX's layout, for tensor-parallel size T and pipeline size P (GPT-NeoX's slots,
megatron.model.gpt2_model: 0 embedding, i + 2 transformer layer i, L + 3 final norm, L + 4 untied head):
  * P == 0: ``mp_rank_{t:02d}_model_states.pt`` for t < T, whose ``module`` is tensor rank t's state dict with
    keys ``sequential.{slot}.{name}``;
  * P >= 1: ``layer_{slot:02d}-model_{t:02d}-model_states.pt`` with slot ``slot``'s state dict on tensor rank t
    (a tied head is the embedding and is not saved again), plus ``mp_rank_{m:02d}_model_states.pt`` for every
    m < P*T with ``module`` None (a stage with DeepSpeed MoE experts: its module without the experts, which are
    in ``layer_{i}_expert_{e}_mp_rank_{m:02d}_model_states.pt``, i the stage's MoE layer, m = stage x T + t, keys
    ``{slot}.{name}``: megatron.model.moe.pipeline);
  * the mp_rank files also hold DeepSpeed's engine metadata and GPT-NeoX's client state (``iteration``,
    ``args``); ZeRO-3 (P == 0) keeps the weights in ``zero_pp_rank_*`` files, read with DeepSpeed's
    zero_to_fp32;
  * names and tensor layouts inside a slot are the model's parameters' (GPT-NeoX's) plus the entries of
    megatron.model.checkpoint_layout (computed buffers, gpt_j_tied's unused norm);
  * ``configs/*.yml``; this project adds neox_args.json (``checkpoint_layout: gpt-neox``), COMPLETE and ``latest``.
This project's older layouts (neox_args.json without checkpoint_layout), read and translated:
  * "flat": P == 0 module keys ``embedding.*``, ``layers.{i}.*``, ``final_norm.*``, ``head.*``; P >= 1 files
    ``layer_00`` (embedding), ``layer_01`` .. ``layer_{L}`` (transformer layers), ``layer_{L+1}`` (final norm),
    ``layer_{L+2}`` (untied head);
  * "slots": GPT-NeoX's slots and file names, with the tensor names and layouts of before;
  and in both: RMSNorm ``weight`` / ``bias`` (now ``scale`` / ``offset``), ``attention.rotary.inv_freq`` (now
  ``rotary_emb``), one ``attention.rpe`` table per layer without the sqrt(head_dim) factor (now one shared
  ``attention.rpe.weight``), and grouped-query QKV rows per kv group [G queries, key, value] (now each rank's
  [queries | keys | values]).

``read_checkpoint`` merges the shards into one flat state dict of the model's parameters, full tensors
(grouped-query QKV as [Q | K | V]), under ``megatron.model.gpt2_model.slot_prefixes``' names (``embedding.*``,
``layers.N.*``, ``final_norm.*``, ``head.*``); ``write_checkpoint`` splits such a state dict into GPT-NeoX's
layout for any split.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from megatron.checkpoint.files import checkpoint_kind, load_checkpoint_file, load_lazily
from megatron.checkpoint.format import (ARGS_FILE, COMPLETE_MARKER, EXPERT_FILE, GPT_NEOX, LATEST_FILE, LAYER_FILE,
                                        LAYOUT, LAYOUT_KEY, MP_FILE, OURS_OLD, file_layout, gpt_neox_client_args,
                                        gpt_neox_gmlp_problem, gpt_neox_mamba_problem,
                                        gpt_neox_qk_norm_problem, model_files, read_saved_args,
                                        resume_tag, yaml_values)
from megatron.checkpoint.integrity import verification_problems, write_manifest
from megatron.checkpoint.run_lock import lock_problem
from megatron.checkpoint.tensor_parallel import merge_shards, split_full
from megatron.errors import CheckpointError, ConversionError
from megatron.model.checkpoint_layout import LAYER, LayoutError, from_neox, slot_kind, to_neox
from megatron.model.config import ModelConfig
from megatron.model.gpt2_model import slot_prefixes
from megatron.model.moe.layer import stack_expert_parallel_experts
from megatron.model.moe.pipeline import expert_slot_states

FLAT, SLOTS = "flat", "slots"
"""This project's older layouts (see the module docstring)."""


@dataclasses.dataclass
class NeoxCheckpoint:
    """A merged checkpoint: the model's full tensors under flat names, the run's arguments (a NeoXArgs dict, or
    a GPT-NeoX checkpoint's YAML values), the model they describe, and where the files came from."""

    state: Dict[str, torch.Tensor]
    args: Dict[str, Any]
    config: ModelConfig
    path: str
    kind: str
    """files.checkpoint_kind's OURS, OURS_OLD or GPT_NEOX."""
    layout: Tuple[int, int]
    """(model_parallel_size, pipe_parallel_size) of the files."""


def resolve_checkpoint_dir(path: str, verified: bool = False) -> str:
    """``path`` itself when it is a global_stepN directory; the tag ``latest`` names when it is a save dir.
    Its files are checked against their checksums unless ``verified`` (the caller checked them: a worker's
    checkpoint is hashed once, by rank 0, megatron.checkpoint.engine.find_checkpoint)."""
    if not os.path.isdir(path):
        raise ConversionError(f"--input_dir {path!r} does not exist; pass a checkpoint directory such as "
                              f"save/global_step1000")
    if not model_files(path):
        try:  # what `latest` names, or the newest complete checkpoint when it is damaged
            tag = resume_tag(path)[0]
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
        if tag:
            path = os.path.join(path, tag)
    if not model_files(path):
        raise ConversionError(f"{path!r} holds no DeepSpeed model files (mp_rank_*_model_states.pt or "
                              f"layer_*-model_*-model_states.pt); pass a checkpoint directory such as "
                              f"save/global_step1000")
    damage = [] if verified else verification_problems(path)
    if damage:
        raise ConversionError(f"checkpoint {path} is damaged: {'; '.join(damage)}; convert another checkpoint")
    return path


def read_args_file(path: str) -> Dict[str, Any]:
    """The NeoXArgs a checkpoint of this project was saved with (its neox_args.json)."""
    args_file = os.path.join(path, ARGS_FILE)
    if not os.path.isfile(args_file):
        raise ConversionError(f"{args_file} is missing; pass the run's YAML files with --config_file")

    try:
        return read_saved_args(args_file)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None


def _checkpoint_args(path: str, kind: str) -> Dict[str, Any]:
    """neox_args.json, or the YAML files GPT-NeoX keeps in configs/."""
    if kind != GPT_NEOX:
        return read_args_file(path)

    try:
        values = yaml_values(path)
    except CheckpointError as exc:
        raise ConversionError(f"{exc}; pass the run's YAML files with --config_file") from None
    if not values:
        raise ConversionError(f"{path} is a GPT-NeoX checkpoint without configs/*.yml; pass the run's YAML files "
                              f"with --config_file")
    return values


def model_config_of(args: Mapping[str, Any], source: str, **layout: Any) -> ModelConfig:
    """The ModelConfig of a NeoXArgs dict (or a GPT-NeoX config's values); ConversionError naming ``source``."""
    try:
        return ModelConfig.from_neox_args(dict(args)).replace(**layout)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{source} does not describe a model ({exc}); pass the run's YAML files with "
                              f"--config_file") from None


def _load(path: str) -> Any:

    try:
        return load_checkpoint_file(path)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None


def _old_layout(path: str, files: List[str], num_layers: int) -> str:
    """FLAT or SLOTS: which of this project's older layouts an old checkpoint is in."""
    names = {os.path.basename(f) for f in files}
    if any(LAYER_FILE.search(n) for n in names):
        return FLAT if any(n.startswith("layer_01-") for n in names) else SLOTS
    mp = sorted(f for f in files if MP_FILE.search(os.path.basename(f)))
    if not mp:
        return SLOTS
    module = load_lazily(mp[0]).get("module") or {}
    return SLOTS if any(k.startswith("sequential.") for k in module) else FLAT


def _flat_file_slot(index: int, num_layers: int) -> int:
    """The slot of the old flat layout's pipeline file ``layer_{index}``."""
    if index == 0:
        return 0
    if index <= num_layers:
        return index + 1
    return {num_layers + 1: num_layers + 3, num_layers + 2: num_layers + 4}.get(index, -1)


def _split_by_slot(module: Mapping[str, torch.Tensor], num_layers: int, flat: bool, source: str
                   ) -> Dict[int, Dict[str, torch.Tensor]]:
    """{slot: slot-relative state} of a sequential model's state dict (``sequential.{slot}.*``, or the old
    flat names)."""
    by_prefix = {prefix: slot for slot, prefix in slot_prefixes(num_layers).items()}
    slots: Dict[int, Dict[str, torch.Tensor]] = {}
    for key, value in module.items():
        if flat:
            prefix = next((p for p in by_prefix if key.startswith(p)), None)
            slot, rest = (by_prefix[prefix], key[len(prefix):]) if prefix else (None, key)
        else:
            head, _, rest = key[len("sequential."):].partition(".")
            slot = int(head) if key.startswith("sequential.") and head.isdigit() else None
        if slot is None or slot_kind(slot, num_layers) is None:
            raise ConversionError(f"{source}: unexpected parameter {key!r} (expected "
                                  f"{'embedding.*, layers.N.*, final_norm.*, head.*' if flat else 'sequential.N.*'} "
                                  f"of a {num_layers}-layer model)")
        slots.setdefault(slot, {})[rest] = value
    return slots


def _old_to_neox(kind: str, state: Mapping[str, torch.Tensor], config: ModelConfig, tp: int
                 ) -> Dict[str, torch.Tensor]:
    """One slot of this project's older layouts in the current (GPT-NeoX's) names and layouts."""
    out: Dict[str, torch.Tensor] = {}
    heads, kv, d = config.num_attention_heads, config.kv_heads, config.head_dim
    for name, value in state.items():
        if name.endswith("attention.rotary.inv_freq"):
            continue
        if config.norm == "rmsnorm" and (name.endswith("norm.weight") or name.endswith("norm.bias")):
            name = name[:-len("weight")] + "scale" if name.endswith("weight") else name[:-len("bias")] + "offset"
        elif name == "attention.rpe":
            name, value = "attention.rpe.weight", value / math.sqrt(d)
        elif kind == LAYER and kv != heads and name.startswith("attention.query_key_value."):
            local_kv, group = kv // tp, heads // kv
            view = value.reshape(local_kv, group + 2, d, *value.shape[1:])
            rest = tuple(value.shape[1:])
            value = torch.cat((view[:, :group].reshape(local_kv * group * d, *rest),
                               view[:, group].reshape(local_kv * d, *rest),
                               view[:, group + 1].reshape(local_kv * d, *rest)))
        out[name] = value
    return out


def _merge(per_rank: List[Dict[str, torch.Tensor]], config: ModelConfig, source: str) -> Dict[str, torch.Tensor]:
    names = list(per_rank[0])
    for rank, state in enumerate(per_rank[1:], start=1):
        if set(state) != set(names):
            raise ConversionError(f"{source}: tensor-parallel rank {rank} holds other parameters than rank 0")
    return {name: merge_shards(name, [s[name] for s in per_rank], config) for name in names}


def read_checkpoint(path: str, args: Optional[Mapping[str, Any]] = None,
                    verified_kind: Optional[str] = None) -> NeoxCheckpoint:
    """Merge the shards of checkpoint ``path`` (a global_stepN directory, or a save directory with ``latest``)
    in any of the layouts of the module docstring. ``args`` (a NeoXArgs dict) describes the model; by default
    the checkpoint's neox_args.json, or for a GPT-NeoX checkpoint its configs/*.yml. The padded vocabulary and
    the tensor / pipeline split are the files'. ``verified_kind``: the kind (files.checkpoint_kind) of a checkpoint whose checksums were checked already (by
    rank 0 for every rank, megatron.checkpoint.engine.find_checkpoint): it is neither hashed nor classified again."""
    path = resolve_checkpoint_dir(path, verified=verified_kind is not None)
    try:
        kind = verified_kind or checkpoint_kind(path)
    except CheckpointError as exc:
        raise ConversionError(str(exc)) from None
    source = f"--config_file for {path}" if args is not None else path
    args = dict(args) if args is not None else _checkpoint_args(path, kind)
    files = model_files(path)
    tp, pp = file_layout(path)
    config = model_config_of(args, source, model_parallel_size=max(tp, 1), pipe_parallel_size=pp,
                             padded_vocab_size=None)
    if kind == GPT_NEOX:
        problem = gpt_neox_mamba_problem(tp, config.attention_types) or \
            gpt_neox_gmlp_problem(tp, config.attention_types) or \
            gpt_neox_qk_norm_problem(config.use_qk_layernorm, config.norm)
        if problem:
            raise ConversionError(f"{path}: {problem}")
    num_layers = config.num_layers
    try:
        old = _old_layout(path, files, num_layers) if kind == OURS_OLD else None
        slots = read_slots(path, files, config, tp, pp, old)
        state = {}

        prefixes = slot_prefixes(num_layers)
        for slot in sorted(slots):
            state.update({prefixes[slot] + name: value for name, value in slots[slot].items()})
    except (LayoutError, CheckpointError) as exc:
        raise ConversionError(str(exc)) from None
    _check_shared_rpe(state, config, path)
    vocab = state.get("embedding.word_embeddings.weight")
    if vocab is None:
        raise ConversionError(f"{path} has no embedding.word_embeddings.weight (slot 0): not a language model "
                              f"checkpoint of this layout")
    config = config.replace(padded_vocab_size=int(vocab.shape[0]))
    return NeoxCheckpoint(state=state, args=args, config=config, path=path, kind=kind, layout=(tp, pp))


def read_slots(path: str, files: List[str], config: ModelConfig, tp: int, pp: int, old: Optional[str]
               ) -> Dict[int, Dict[str, torch.Tensor]]:
    """{slot: its full tensors} of checkpoint ``path``: from ZeRO-3's partitioned files or from the model files."""
    if is_zero3(files) and pp == 0:
        return _read_zero3(path, config, old)
    return _read_slots(path, files, config, tp, pp, old)


def is_zero3(files: List[str]) -> bool:
    """Whether a checkpoint's model files are ZeRO-3's (``zero_pp_rank_*``: the weights in its partitions)."""
    return any(os.path.basename(f).startswith("zero_pp_rank_") for f in files)


def _read_slots(path: str, files: List[str], config: ModelConfig, tp: int, pp: int, old: Optional[str]
                ) -> Dict[int, Dict[str, torch.Tensor]]:
    """{slot: merged slot-relative state} of the mp_rank (P == 0) or layer (P >= 1) files."""
    num_layers = config.num_layers
    per_slot: Dict[int, Dict[int, Tuple[str, Dict[str, torch.Tensor]]]] = {}
    if pp:
        for f in files:
            match = LAYER_FILE.search(os.path.basename(f))
            if not match:
                continue
            index, rank = int(match.group(1)), int(match.group(2))
            slot = _flat_file_slot(index, num_layers) if old == FLAT else index
            if slot_kind(slot, num_layers) is None:
                raise ConversionError(f"{f}: layer file index {index} does not fit num_layers={num_layers}")
            per_slot.setdefault(slot, {})[rank] = (f, _load(f))
        _add_pipeline_experts(files, tp, per_slot)
    else:
        experts: Dict[int, Dict[str, torch.Tensor]] = {}  # DeepSpeed's MoE experts, saved in files of their own
        for f in files:
            match = EXPERT_FILE.search(os.path.basename(f))
            if match:
                experts.setdefault(int(match.group(3)), {}).update(_load(f))
        for f in files:
            match = MP_FILE.search(os.path.basename(f))
            if not match:
                continue
            module = _load(f).get("module")
            if module is None:
                raise ConversionError(f"{f} holds no model weights ('module' is empty) and there are no "
                                      f"layer_*-model_*-model_states.pt files")
            module = stack_expert_parallel_experts({**module, **experts.get(int(match.group(1)), {})})
            for slot, state in _split_by_slot(module, num_layers, old == FLAT, f).items():
                per_slot.setdefault(slot, {})[int(match.group(1))] = (f, state)
    slots = {}
    for slot, ranks in per_slot.items():
        if sorted(ranks) != list(range(tp)):
            raise ConversionError(f"{path}: slot {slot} has tensor-parallel files {sorted(ranks)} of {tp}")
        kind = slot_kind(slot, num_layers, config.attention_types)
        states = []
        for rank in range(tp):
            source, state = ranks[rank]
            if old is not None:
                state = _old_to_neox(kind, state, config, tp)
            states.append(from_neox(kind, state, config, rank, tp, source=source))
        slots[slot] = _merge(states, config, ranks[0][0])
    return slots


def _add_pipeline_experts(files: List[str], tp: int, per_slot: Dict[int, Dict[int, Tuple[str, Dict]]]) -> None:
    """A pipeline's DeepSpeed MoE experts (their own files, megatron.model.moe.pipeline) into their slots' states,
    the dropless layer's stacked as GPT-NeoX's ``experts.mlp.w1`` & co."""
    expert_files: Dict[int, Dict[str, torch.Tensor]] = {}
    for f in files:
        match = EXPERT_FILE.search(os.path.basename(f))
        if match:
            expert_files.setdefault(int(match.group(3)), {}).update(_load(f))
    for (slot, rank), experts in expert_slot_states(expert_files, tp).items():
        if rank not in per_slot.get(slot, {}):
            raise ConversionError(f"expert files of layer file slot {slot} (tensor-parallel rank {rank}) without "
                                  f"its layer_{slot:02d}-model_{rank:02d}-model_states.pt")
        source, state = per_slot[slot][rank]
        per_slot[slot][rank] = (source, stack_expert_parallel_experts({**state, **experts}))


def _read_zero3(path: str, config: ModelConfig, old: Optional[str]) -> Dict[int, Dict[str, torch.Tensor]]:
    """ZeRO-3 (P == 0, T == 1): the consolidated fp32 parameters (named_parameters' names: a shared rpe table
    appears under its first layer only)."""
    mp = {re.search(r"mp_rank_(\d+)", os.path.basename(f)).group(1) for f in model_files(path)}
    if len(mp) != 1:
        raise ConversionError(f"{path}: ZeRO-3 checkpoints with model_parallel_size > 1 are not supported by "
                              f"this converter; train with ZeRO stage 0-2 or model_parallel_size 1")
    root, tag = os.path.split(os.path.normpath(path))
    module = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    slots = _split_by_slot(module, config.num_layers, old == FLAT, path)
    out = {}
    for slot, state in slots.items():
        kind = slot_kind(slot, config.num_layers, config.attention_types)
        if old is not None:
            state = _old_to_neox(kind, state, config, 1)
        out[slot] = from_neox(kind, state, config, 0, 1, source=path)
    shared = next((s["attention.rpe.weight"] for s in out.values() if "attention.rpe.weight" in s), None)
    if shared is not None and old is None:
        for slot, state in out.items():
            if slot_kind(slot, config.num_layers, config.attention_types) == LAYER:
                state.setdefault("attention.rpe.weight", shared)
    return out


def _check_shared_rpe(state: Mapping[str, torch.Tensor], config: ModelConfig, path: str) -> None:
    """The rpe table is one parameter shared by all layers: every layer must hold the same."""
    tables = [state[k] for k in sorted(state) if k.endswith("attention.rpe.weight")]
    if any(not torch.equal(t, tables[0]) for t in tables[1:]):
        raise ConversionError(f"{path}: the layers hold different rpe tables, but the model (as GPT-NeoX's) shares "
                              f"one between all layers (this project's older layout kept one per layer, and a "
                              f"GPT-NeoX run with pipe_parallel_size > 1 trains one per stage); it cannot be "
                              f"converted")


def flat_state_dict(module: Mapping[str, torch.Tensor], config: ModelConfig) -> Dict[str, torch.Tensor]:
    """A one-rank GPT2ModelSequential state dict (``sequential.{slot}.*``, GPT-NeoX's entries included) as the
    model's parameters under the flat names."""
    prefixes = slot_prefixes(config.num_layers)
    flat = {}
    for slot, state in _split_by_slot(module, config.num_layers, False, "the state dict").items():
        params = from_neox(slot_kind(slot, config.num_layers, config.attention_types), state, config)
        flat.update({prefixes[slot] + name: value for name, value in params.items()})
    return flat


def sequential_state_dict(state: Mapping[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """Flat names back to GPT2ModelSequential's ``sequential.{slot}.*`` (the model's load hooks accept it)."""
    by_prefix = {prefix: slot for slot, prefix in slot_prefixes(num_layers).items()}
    out = {}
    for name, value in state.items():
        prefix = next((p for p in by_prefix if name.startswith(p)), None)
        if prefix is None:
            raise ConversionError(f"{name!r} is not a flat parameter name (embedding.*, layers.N.*, final_norm.*, "
                                  f"head.*)")
        out[f"sequential.{by_prefix[prefix]}.{name[len(prefix):]}"] = value
    return out


def _engine_metadata(mp_world: int, tp: int, pp: int, iteration: int) -> Dict[str, Any]:
    """The non-weight entries DeepSpeed's engine writes into (and reads back from) mp_rank_* files."""
    return {"buffer_names": [], "optimizer": None, "param_shapes": None, "frozen_param_shapes": None,
            "shared_params": None, "frozen_param_fragments": None, "lr_scheduler": None, "data_sampler": None,
            "random_ltd": None, "skipped_steps": 0, "global_steps": iteration, "global_samples": 0,
            "dp_world_size": 1, "mp_world_size": mp_world,
            "checkpoint_parallel_dimensions": {"pp_degree": max(pp, 1), "tp_degree": tp},
            "ds_config": {}, "ds_version": deepspeed.__version__}


def new_checkpoint_problem(save_dir: str, iteration: int) -> Optional[str]:
    """Why a tool cannot write checkpoint ``iteration`` into ``save_dir``, or None: a training run holds the
    directory (megatron.checkpoint.run_lock), or the checkpoint directory exists already (a complete checkpoint
    would be silently replaced, an interrupted one mixed with the new files)."""
    held = lock_problem(save_dir)
    if held:
        return held
    path = os.path.join(save_dir, f"global_step{iteration}")
    if os.path.exists(path):
        what = "a complete checkpoint" if os.path.isfile(os.path.join(path, COMPLETE_MARKER)) else "a directory"
        return (f"{path} exists already ({what}); it is not replaced: write to a new output directory, or remove "
                f"it first")
    return None


def _save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_checkpoint(save_dir: str, state: Mapping[str, torch.Tensor], config: ModelConfig,
                     args: Mapping[str, Any], config_files: Mapping[str, str], iteration: int = 0,
                     client_state: Optional[Mapping[str, Any]] = None) -> str:
    """Write ``state`` (the model's full tensors under flat names) as ``save_dir/global_step{iteration}`` in
    GPT-NeoX's layout for ``config``'s model_parallel_size / pipe_parallel_size, with GPT-NeoX's client state
    (plus ``client_state``), neox_args.json (``args`` and the layout marker), configs/, COMPLETE and ``latest``.
    Returns the checkpoint directory. Refuses (ConversionError) to replace a checkpoint directory that exists, or
    to write where a training run holds the lock (new_checkpoint_problem)."""
    tp, pp, num_layers = config.model_parallel_size, config.pipe_parallel_size, config.num_layers
    tag = f"global_step{iteration}"
    path = os.path.join(save_dir, tag)
    problem = new_checkpoint_problem(save_dir, iteration)
    if problem:
        raise ConversionError(problem)
    os.makedirs(os.path.join(path, "configs"), exist_ok=True)
    # slot -> per-rank GPT-NeoX state dicts
    files: Dict[int, List[Dict[str, torch.Tensor]]] = {}
    for slot, prefix in slot_prefixes(num_layers).items():
        params = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not params:
            continue
        shards: List[Dict[str, torch.Tensor]] = [{} for _ in range(tp)]
        for name, tensor in params.items():
            for rank, piece in enumerate(split_full(prefix + name, tensor, tp, config)):
                shards[rank][name] = piece.detach().clone().contiguous()  # clone: never save a view's storage
        kind = slot_kind(slot, num_layers, config.attention_types)
        files[slot] = [to_neox(kind, shards[rank], config, rank, tp) for rank in range(tp)]
    client = {"iteration": iteration, "args": gpt_neox_client_args(args, config), LAYOUT_KEY: LAYOUT,
              **(client_state or {})}
    if pp == 0:
        for rank in range(tp):
            module = {f"sequential.{slot}.{name}": value for slot in sorted(files) for name, value in
                      files[slot][rank].items()}
            _save({"module": module, **_engine_metadata(tp, tp, pp, iteration), **client},
                  os.path.join(path, f"mp_rank_{rank:02d}_model_states.pt"))
    else:
        for slot, per_rank in files.items():
            for rank, layer in enumerate(per_rank):
                _save(layer, os.path.join(path, f"layer_{slot:02d}-model_{rank:02d}-model_states.pt"))
        for mp_rank in range(pp * tp):
            _save({"module": None, **_engine_metadata(pp * tp, tp, pp, iteration), **client},
                  os.path.join(path, f"mp_rank_{mp_rank:02d}_model_states.pt"))
    with open(os.path.join(path, ARGS_FILE), "w", encoding="utf-8") as handle:
        json.dump({**dict(args), "padded_vocab_size": config.padded_vocab_size, LAYOUT_KEY: LAYOUT}, handle,
                  indent=1, sort_keys=True, default=str)
    for name, text in config_files.items():
        with open(os.path.join(path, "configs", os.path.basename(name)), "w", encoding="utf-8") as handle:
            handle.write(text)
    write_manifest(path)  # checksummed like a training run's checkpoint, before COMPLETE
    with open(os.path.join(path, COMPLETE_MARKER), "w", encoding="utf-8") as handle:
        handle.write(f"{iteration}\n")
    with open(os.path.join(save_dir, LATEST_FILE), "w", encoding="utf-8") as handle:
        handle.write(tag)
    return path
