"""The whole training state of a checkpoint of this project, whatever its tensor / pipeline / data-parallel / ZeRO
layout: every parameter's full fp32 value and full optimizer state (Adam's exp_avg / exp_avg_sq, SGD's momentum,
...) under the flat names of megatron.model.gpt2_model.slot_prefixes (the LR scheduler and DeepSpeed's counters are in
``client_state``). megatron.checkpoint.resharding loads it into an engine of another layout.

Where DeepSpeed keeps the optimizer state, per model-states file (one per tensor x pipeline rank, written by
data-parallel rank 0; with ZeRO-3 one per data-parallel rank as well):
  * ZeRO 0: ``mp_rank_XX_model_states.pt``'s ``optimizer`` is the torch optimizer's state dict, whose parameters
    are numbered group by group; format.RESHARD_KEY's ``param_names`` names them. The weights are the
    module's (megatron.checkpoint.neox_checkpoint.read_checkpoint merges them).
  * ZeRO 1 / 2: ``zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt`` holds data-parallel rank d's slice of each
    group's flat fp32 master weights and optimizer state; ``param_slice_mappings`` says where each parameter's
    fragment lies in it. Fragments in data-parallel order are the parameter, flattened.
  * ZeRO 3: the same files, each parameter split into ``ceil(numel / dp)`` elements per rank, one after the
    other in the order of ``param_shapes`` (DeepSpeed's zero_to_fp32 reads the weights the same way).
Tensor-parallel shards are merged with megatron.checkpoint.tensor_parallel's rules (the optimizer
state of a parameter splits as the parameter does).
"""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Tuple

import torch

from megatron.checkpoint.files import load_lazily
from megatron.checkpoint.format import RESHARD_KEY
from megatron.checkpoint.neox_checkpoint import read_checkpoint
from megatron.checkpoint.tensor_parallel import merge_shards, split_rule
from megatron.errors import CheckpointError, ConversionError
from megatron.model.config import ModelConfig
from megatron.model.gpt2_model import GPT2ModelPipe, slot_prefixes

FP32 = "fp32"
"""The key of a parameter's full fp32 (master) value in TrainingState.params."""
_OPTIM_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


@dataclasses.dataclass
class TrainingState:
    """A checkpoint's training state, independent of its layout."""

    params: Dict[str, Dict[str, Any]]
    """{flat name: {FP32: full value, state key: full tensor, or a scalar such as Adam's step}}."""
    zero_stage: int


def flat_name(module_name: str, num_layers: int) -> str:
    """A parameter's name in the flat state dict, from its name in GPT2ModelSequential (``sequential.S.rest``) or
    GPT2ModelPipe (``S.rest``, ``tied_modules.embed.rest``)."""
    if not module_name.startswith("sequential."):
        module_name = GPT2ModelPipe.sequential_name(module_name)
    slot, _, rest = module_name[len("sequential."):].partition(".")
    prefixes = slot_prefixes(num_layers)
    if not slot.isdigit() or int(slot) not in prefixes:
        raise CheckpointError(f"{module_name!r} is no parameter of a {num_layers}-layer model")
    return prefixes[int(slot)] + rest


def _files(path: str, pattern: re.Pattern) -> List[Tuple[re.Match, str]]:
    found = [(pattern.search(os.path.basename(f)), f) for f in glob.glob(os.path.join(path, "*.pt"))]
    return sorted(((m, f) for m, f in found if m), key=lambda item: item[1])


def _model_states(path: str) -> Dict[int, Dict[str, Any]]:
    """{mp rank: the client and engine state of its first model-states file} (weights left out)."""
    out: Dict[int, Dict[str, Any]] = {}
    for match, name in _files(path, _MODEL_FILE):
        mp = int(match.group(2))
        if mp not in out:
            out[mp] = {k: v for k, v in load_lazily(name).items() if k != "module"}
    if not out:
        raise CheckpointError(f"{path} holds no model-states files")
    return out


def _layout_record(path: str, states: Mapping[int, Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    records = {mp: state.get(RESHARD_KEY) for mp, state in states.items()}
    if any(r is None for r in records.values()):
        raise CheckpointError(f"checkpoint {path} was saved before checkpoints recorded their optimizer's layout, so "
                              f"its optimizer state cannot be moved to another parallel layout. Resume it with the "
                              f"layout it was saved with (model_parallel_size, pipe_parallel_size, the number of "
                              f"data-parallel ranks and the ZeRO stage of its neox_args.json), or set no_load_optim: "
                              f"true to keep its weights and iteration and start the optimizer state afresh")
    return records


def _per_rank_zero0(path: str, states, records, keep: Callable[[str], bool]) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """{tensor rank: {module name: optimizer state}} from the torch optimizers' state dicts (ZeRO 0)."""
    per_rank: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for mp, state in states.items():
        optimizer, names = state.get("optimizer"), records[mp].get("param_names")
        if not (isinstance(optimizer, dict) and {"state", "param_groups"} <= set(optimizer) and names):
            raise CheckpointError(f"checkpoint {path}: the optimizer state of model-parallel rank {mp} is not a "
                                  f"PyTorch optimizer's (type {type(optimizer).__name__}; DeepSpeed keeps bf16 / fp16 "
                                  f"without ZeRO in its own format), which cannot be resharded yet. Resume with the "
                                  f"layout it was saved with, or set no_load_optim: true")
        groups = [group["params"] for group in optimizer["param_groups"]]
        if [len(g) for g in groups] != [len(n) for n in names]:
            raise CheckpointError(f"checkpoint {path}: model-parallel rank {mp}'s optimizer has groups of "
                                  f"{[len(g) for g in groups]} parameters but names for {[len(n) for n in names]}")
        local = per_rank.setdefault(records[mp]["tensor_rank"], {})
        for ids, group_names in zip(groups, names):
            for index, name in zip(ids, group_names):
                if keep(name):
                    local.setdefault(name, dict(optimizer["state"].get(index, {})))
    return per_rank


def _zero_files(path: str) -> Dict[int, List[Dict[str, Any]]]:
    """{mp rank: the ZeRO optimizer state dicts of its data-parallel ranks, in rank order}."""
    by_mp: Dict[int, Dict[int, str]] = {}
    for match, name in _files(path, _OPTIM_FILE):
        by_mp.setdefault(int(match.group(2)), {})[int(match.group(1))] = name
    out = {}
    for mp, ranks in by_mp.items():
        if sorted(ranks) != list(range(len(ranks))):
            raise CheckpointError(f"checkpoint {path}: ZeRO files of model-parallel rank {mp} are missing for some "
                                  f"data-parallel ranks (found {sorted(ranks)})")
        out[mp] = [load_lazily(ranks[d])["optimizer_state_dict"] for d in range(len(ranks))]
    return out


def _bf16_optimizer_states(path: str, states: Mapping[int, Dict[str, Any]]) -> Dict[int, List[Dict[str, Any]]]:
    """{mp rank: [its state]} when the model-states files hold DeepSpeed's bf16 optimizer's state (a pipeline in
    bf16 without ZeRO), which is ZeRO 1's format for one data-parallel rank; else {}."""
    found = {mp: state.get("optimizer") for mp, state in states.items()}
    if not all(isinstance(o, dict) and "param_slice_mappings" in o for o in found.values()):
        return {}
    for mp, optimizer in found.items():
        counts = optimizer.get("partition_count") or [1]
        if any(int(c) != 1 for c in (counts if isinstance(counts, (list, tuple)) else [counts])):
            raise CheckpointError(f"checkpoint {path}: model-parallel rank {mp}'s bf16 optimizer state is split over "
                                  f"{counts} data-parallel ranks but saved by one; it cannot be resharded. Resume "
                                  f"with the layout it was saved with, or set no_load_optim: true")
    return {mp: [optimizer] for mp, optimizer in found.items()}


def _flat_states(group: int, shard: Mapping[str, Any], stage: int) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """(this data-parallel rank's flat tensors of one group: FP32 and the optimizer's, the group's scalars)."""
    if stage == 3:
        fp32, base = shard["fp32_flat_groups"][group], shard["optimizer_state_dict"]["state"].get(group, {})
    else:
        fp32, base = shard["single_partition_of_fp32_groups"][group], shard["base_optimizer_state"]["state"].get(
            group, {})
    flat = {FP32: fp32}
    scalars = {}
    for key, value in base.items():
        if torch.is_tensor(value) and value.shape == fp32.shape:
            flat[key] = value
        else:
            scalars[key] = value
    return flat, scalars


def _per_rank_zero(path: str, states, records, zero_files, keep: Callable[[str], bool]
                   ) -> Dict[int, Dict[str, Dict[str, Any]]]:
    """{tensor rank: {module name: {FP32 and optimizer state, full over the data-parallel ranks}}} (ZeRO 1-3)."""
    per_rank: Dict[int, Dict[str, Dict[str, Any]]] = {}
    for mp, shards in zero_files.items():
        stage = _stage(shards[0])
        local = per_rank.setdefault(records[mp]["tensor_rank"], {})
        if stage != 3:
            shapes = {name: shape for group in states[mp].get("param_shapes") or [] for name, shape in group.items()}
            _gather_fragments(shards, {**shapes, **(records[mp].get("param_shapes") or {})}, local, path, keep)
            continue
        for group, group_shapes in enumerate(states[mp]["param_shapes"]):
            per_dp = [_flat_states(group, shard, stage) for shard in shards]
            scalars = per_dp[0][1]
            start = 0
            for name, shape in group_shapes.items():
                numel = math.prod(shape)
                part = math.ceil(numel / len(shards))
                if keep(name):
                    local[name] = {key: torch.cat([flat[key][start:start + part] for flat, _ in per_dp])[:numel]
                                   .reshape(shape).clone() for key in per_dp[0][0]}
                    local[name].update(scalars)
                start += part
    return per_rank


def _stage(shard: Mapping[str, Any]) -> int:
    """The ZeRO stage of a ZeRO optimizer file (DeepSpeed's bf16 optimizer writes stage 1's format without it)."""
    return int(shard.get("zero_stage", 1))


def _gather_fragments(shards: List[Mapping[str, Any]], shapes: Mapping[str, Any], local: Dict[str, Dict[str, Any]],
                      path: str, keep: Callable[[str], bool]) -> None:
    """ZeRO 1 / 2 (and the bf16 optimizer): each parameter from its fragments in the data-parallel ranks'
    partitions (``param_slice_mappings``), in rank order, shaped as this tensor rank's parameter."""
    for group in range(len(shards[0]["param_slice_mappings"])):
        per_dp = [_flat_states(group, shard, 1) for shard in shards]
        names = dict.fromkeys(n for shard in shards for n in shard["param_slice_mappings"][group] if keep(n))
        for name in names:
            if name not in shapes:
                raise CheckpointError(f"checkpoint {path}: no shape recorded for {name}")
            pieces: Dict[str, List[torch.Tensor]] = {key: [] for key in per_dp[0][0]}
            for shard, (flat, _) in zip(shards, per_dp):
                address = shard["param_slice_mappings"][group].get(name)
                if address is not None:
                    for key, value in flat.items():
                        pieces[key].append(value.narrow(0, address.start, address.numel))
            state = {key: torch.cat(values).reshape(shapes[name]).clone() for key, values in pieces.items()}
            local[name] = {**state, **per_dp[0][1]}


def _merge_tensor_ranks(per_rank: Dict[int, Dict[str, Dict[str, Any]]], config: ModelConfig, path: str
                        ) -> Dict[str, Dict[str, Any]]:
    """{flat name: full state}: each tensor's shards merged as its parameter's (replicated ones taken from rank 0)."""
    tp = config.model_parallel_size
    if sorted(per_rank) != list(range(tp)):
        raise CheckpointError(f"checkpoint {path}: optimizer states of tensor ranks {sorted(per_rank)}, expected "
                              f"{list(range(tp))}")
    by_flat: List[Dict[str, Dict[str, Any]]] = [
        {flat_name(name, config.num_layers): state for name, state in per_rank[rank].items()} for rank in range(tp)]
    merged = {}
    for name, first in by_flat[0].items():
        if any(name not in other for other in by_flat[1:]):
            raise CheckpointError(f"checkpoint {path}: {name} has optimizer state on tensor rank 0 only")
        full = {}
        for key, value in first.items():
            if torch.is_tensor(value) and value.dim() > 0 and split_rule(name, config) is not None:
                full[key] = merge_shards(name, [other[name][key] for other in by_flat], config)
            else:
                full[key] = value
        merged[name] = full
    return merged


def read_training_state(path: str, config: ModelConfig, saved_layout: Tuple[int, int],
                        wanted: Optional[Collection[str]] = None, verified_kind: Optional[str] = None) -> TrainingState:
    """The training state of checkpoint ``path`` (a global_stepN directory of this project), saved with
    ``saved_layout`` = (model_parallel_size, pipe_parallel_size) by a model of ``config``'s architecture; only the
    parameters of the flat names ``wanted`` when given (a pipeline stage's: the files are memory-mapped, so the
    others are not read); ``verified_kind``: as read_checkpoint's."""
    tp, pp = saved_layout
    saved_config = config.replace(model_parallel_size=tp, pipe_parallel_size=pp)
    states = _model_states(path)
    records = _layout_record(path, states)
    wanted = None if wanted is None else set(wanted)

    def keep(module_name: str) -> bool:
        return wanted is None or flat_name(module_name, config.num_layers) in wanted

    zero_files = _zero_files(path) or _bf16_optimizer_states(path, states)
    try:
        if zero_files:
            stage = _stage(next(iter(zero_files.values()))[0])
            params = _merge_tensor_ranks(_per_rank_zero(path, states, records, zero_files, keep), saved_config, path)
        else:
            stage = 0
            params = _merge_tensor_ranks(_per_rank_zero0(path, states, records, keep), saved_config, path)
            weights = read_checkpoint(path, verified_kind=verified_kind).state
            for name, state in params.items():
                if name not in weights:
                    raise CheckpointError(f"checkpoint {path}: the optimizer has state for {name}, which its weights "
                                          f"lack")
                state[FP32] = weights[name].float()
    except ConversionError as exc:
        raise CheckpointError(str(exc)) from None
    return TrainingState(params=params, zero_stage=stage)


def client_state(path: str) -> Dict[str, Any]:
    """The client and engine state of checkpoint ``path``'s first model-states file (iteration, data position, LR
    scheduler, DeepSpeed's step and sample counters, ...)."""
    states = _model_states(path)
    return states[min(states)]

