"""Resuming training from a checkpoint saved with another parallel layout: other tensor / pipeline sizes, another
number of data-parallel ranks, another ZeRO stage, another context_parallel_size.

Context parallelism splits no weights: its ranks hold the same parameters, and ZeRO partitions their optimizer
state over data x context ranks, so another context-parallel size is, for the checkpoint, another number of ranks
sharing the ZeRO state (the reader below takes every data-parallel file there is).

DeepSpeed's engine loads only checkpoints of its own layout. When a run's layout differs from its checkpoint's
(megatron.checkpoint.engine.load_checkpoint decides), every rank reads the checkpoint's whole training state
(megatron.checkpoint.training_state: full fp32 weights and optimizer state per parameter), cuts out
its own tensor-parallel shard with the rules of megatron.checkpoint.tensor_parallel, and writes it
where its engine keeps it:
  * ZeRO 0 (fp32): the module's parameters and the torch optimizer's per-parameter state;
  * ZeRO 1 / 2, and DeepSpeed's bf16 optimizer (a pipeline in bf16): the module's parameters, and this
    data-parallel rank's fragment of each parameter in the flat fp32 master weights and optimizer state
    (DeepSpeed's ``_hp_mapping``, as its universal checkpoints use);
  * ZeRO 3: this rank's partition of each parameter in the flat fp32 groups and optimizer state, then the
    module's partitions from them (as DeepSpeed's own ZeRO-3 load does).
The LR scheduler, DeepSpeed's step / sample counters and the client state (iteration, data position) are the
checkpoint's. The RNG is set afterwards, as on any resume (megatron.checkpoint.engine.restore_rng): each rank
takes the saved state of the rank with its number (the client state's, as GPT-NeoX does, where the checkpoint had
fewer ranks): with another layout the ranks draw other streams anyway, so dropout noise is not the
uninterrupted run's. Every rank reads the optimizer state of its own parameters only (memory-mapped files), but
without ZeRO the weights of the whole model (megatron.checkpoint.neox_checkpoint.read_checkpoint).

Mixture of experts: the dropless layer (moe_type megablocks) at moe_expert_parallel_size 1, GPT-NeoX's dMoE, keeps
its experts stacked in the model files (``mlp.experts.mlp.w1`` & co.), split by whole experts over the
tensor-parallel ranks, as ordinary parameters of the engine (in an optimizer group of their own with
create_moe_param_group). DeepSpeed's layer (moe_type deepspeed) at moe_expert_parallel_size 1 keeps its experts
(and residual MLP) whole on every tensor-parallel rank (with enable_expert_tensor_parallelism the experts split as
the dense MLP), the experts in DeepSpeed's per-expert files (read_checkpoint reads them) and their optimizer state
with the rest's: ZeRO partitions DeepSpeed's expert groups over the expert-data-parallel ranks, which at EP 1 are
the data-parallel ranks. So both reshard as the rest. Refused by ``moe_problem``: expert parallelism, and DeepSpeed's
layer in a pipeline. The load-balancing loss is computed per micro-batch, so a layout that changes the micro-batch
size (not the global batch) changes the losses of an MoE model by itself.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from megatron.checkpoint.format import REFERENCE_FILE, optimizer_layout
from megatron.checkpoint.neox_checkpoint import read_checkpoint
from megatron.checkpoint.tensor_parallel import split_full
from megatron.checkpoint.training_state import FP32, TrainingState, client_state, flat_name, read_training_state
from megatron.errors import CheckpointError, ConversionError
from megatron.model.config import ModelConfig


def layout_of(values: Mapping[str, Any]) -> Dict[str, int]:
    """The parallel layout a NeoXArgs dict (or a checkpoint's neox_args.json) describes."""
    return {"model_parallel_size": int(values.get("model_parallel_size") or 1),
            "pipe_parallel_size": int(values.get("pipe_parallel_size") or 0),
            "data_parallel_size": int(values.get("data_parallel_size") or 1),
            "context_parallel_size": int(values.get("context_parallel_size") or 1),
            "zero_stage": int(values.get("zero_stage") or 0)}


def needs_resharding(saved: Mapping[str, int], current: Mapping[str, int], optimizer_state: bool = True) -> bool:
    """Whether DeepSpeed's engine cannot load a checkpoint of layout ``saved`` itself: another tensor / pipeline
    split or ZeRO stage, or another number of data-parallel or context-parallel ranks under ZeRO (its partitions
    span data x context; without ZeRO every rank holds the whole optimizer state, and the engine loads it on any
    number of ranks). Without the optimizer state
    (no_load_optim) only another split, or ZeRO-3's partitioned weights, need it: the engine reads the weights from
    the model files."""
    split = any(saved[key] != current[key] for key in ("model_parallel_size", "pipe_parallel_size"))
    if split:
        return True
    other_zero = saved["zero_stage"] != current["zero_stage"]
    other_dp = any(saved.get(key, 1) != current.get(key, 1) for key in ("data_parallel_size", "context_parallel_size"))
    if not optimizer_state:
        return max(saved["zero_stage"], current["zero_stage"]) >= 3 and (other_zero or other_dp)
    return other_zero or (saved["zero_stage"] > 0 and other_dp)


def reference_problem(path: str, saved: Mapping[str, int], current: Mapping[str, int], train_impl: str) -> str:
    """Why DPO / KTO cannot resume checkpoint ``path`` in layout ``current``, or "": its frozen reference model is
    saved whole per tensor-parallel rank (megatron.post_training.reference), so only another tensor-parallel size
    leaves it unloadable (the pipeline, data-parallel and ZeRO layouts do not touch it)."""
    if train_impl not in ("dpo", "kto") or saved["model_parallel_size"] == current["model_parallel_size"]:
        return ""
    if not os.path.isfile(os.path.join(path, REFERENCE_FILE.format(0))):
        return ""
    return (f"checkpoint {path} holds {train_impl.upper()}'s reference model split for model_parallel_size="
            f"{saved['model_parallel_size']}, and resharding it to {current['model_parallel_size']} is not supported "
            f"yet: resume with model_parallel_size={saved['model_parallel_size']} (another pipeline, data-parallel or "
            f"ZeRO layout reshards)")


def moe_problem(path: str, saved_args: Mapping[str, Any], config: ModelConfig) -> str:
    """Why the mixture of experts of checkpoint ``path`` cannot be resharded into a run of ``config``, or "".
    Resharded (module docstring): the dropless layer at moe_expert_parallel_size 1 in any layout, DeepSpeed's layer
    at moe_expert_parallel_size 1 without a pipeline (its experts whole on every tensor-parallel rank, or split with
    enable_expert_tensor_parallelism, its ZeRO partitions over the data-parallel ranks). Not yet: expert parallelism
    (each expert-parallel rank's experts carry local names in DeepSpeed's files and ZeRO partitions them over the
    expert-data-parallel group) and DeepSpeed's layer in a pipeline (its experts in per-stage files,
    megatron.model.moe.pipeline)."""
    unbuilt = []
    for who, values in (("the checkpoint's", saved_args), ("this run's", vars(config))):
        if int(values.get("moe_num_experts") or 1) <= 1:
            continue
        kind, ep = values.get("moe_type") or "megablocks", int(values.get("moe_expert_parallel_size") or 1)
        what = [f"moe_expert_parallel_size {ep}"] if ep > 1 else []
        if kind == "deepspeed" and int(values.get("pipe_parallel_size") or 0) >= 1:
            what.append(f"pipe_parallel_size {values.get('pipe_parallel_size')}")
        if what:
            unbuilt.append(f"{who} (moe_type {kind}, {', '.join(what)})")
    if not unbuilt:
        return ""
    return (f"checkpoint {path} was saved with another parallel layout ({describe(layout_of(saved_args))}), and "
            f"resharding the mixture of experts of {' and '.join(unbuilt)} is not supported yet. Resharded are: "
            f"the dropless layer (moe_type megablocks) at moe_expert_parallel_size 1 in any layout, and DeepSpeed's "
            f"layer (moe_type deepspeed) at moe_expert_parallel_size 1 without a pipeline (pipe_parallel_size 0). "
            f"Resume with the layout the checkpoint was saved with")


def describe(layout: Mapping[str, int]) -> str:
    cp = layout.get("context_parallel_size", 1)
    return (f"TP={layout['model_parallel_size']} PP={layout['pipe_parallel_size']} "
            f"DP={layout['data_parallel_size']}{f' CP={cp}' if cp > 1 else ''} ZeRO-{layout['zero_stage']}")


def _local(name: str, full: torch.Tensor, config: ModelConfig, tp_rank: int) -> torch.Tensor:
    """This tensor rank's shard of a full tensor (a replicated one whole)."""
    return split_full(name, full, config.model_parallel_size, config)[tp_rank]


def _engine_kind(engine) -> str:
    """"zero0", "zero12" or "zero3": where the engine keeps weights and optimizer state; CheckpointError for an
    optimizer this module cannot fill."""
    optimizer = engine.optimizer
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        raise CheckpointError("resuming a checkpoint saved in another parallel layout with ZeRO offloading to NVMe "
                              "is not supported yet: resume with offload_optimizer / offload_param device cpu or "
                              "none, or with the checkpoint's layout")
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return "zero3"
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        return "zero12"
    if isinstance(optimizer, torch.optim.Optimizer) and type(optimizer).__module__.startswith(("torch.", "megatron.")) \
            and all(p.dtype == torch.float32 for p in engine.module.parameters()):
        return "zero0"
    raise CheckpointError(f"resuming a checkpoint saved in another parallel layout into DeepSpeed's "
                          f"{type(optimizer).__name__} (16-bit weights without ZeRO) is not supported yet: set "
                          f"zero_optimization.stage to 1 (or train in fp32), or resume with the checkpoint's layout")


def _start_flat_states(groups, flats, base, locals_: Dict[str, Dict[str, Any]], names: Dict[int, str]) -> None:
    """Give each flat fp32 partition an optimizer state with the saved keys: zeros to be filled, and the saved
    scalars (Adam's step) of the group's first parameter."""
    for group, flat in zip(groups, flats):
        saved = locals_[names[id(group[0])]]
        base.state[flat] = {key: torch.zeros_like(flat) if torch.is_tensor(value) and value.dim() > 0 else
                            (value.detach().clone() if torch.is_tensor(value) else value)
                            for key, value in saved.items() if key != FP32}


def _flat_targets(flat: torch.Tensor, base, load_optim: bool) -> Dict[str, torch.Tensor]:
    """{FP32: the flat master weights, state key: the flat optimizer state} of one partition."""
    states = {k: v for k, v in base.state[flat].items() if torch.is_tensor(v) and v.shape == flat.shape}
    return {FP32: flat, **(states if load_optim else {})}


def _fill_zero0(engine, locals_: Dict[str, Dict[str, Any]], names: Dict[int, str], load_optim: bool) -> None:
    optimizer = engine.optimizer
    for param in engine.module.parameters():
        state = locals_.get(names.get(id(param), ""))
        if state is None:  # not in the checkpoint (strict=False)
            continue
        with torch.no_grad():
            param.copy_(state[FP32].to(param.dtype))
        if load_optim:
            optimizer.state[param] = {key: value.detach().clone().to(param.device) if torch.is_tensor(value) else value
                                      for key, value in state.items() if key != FP32}


def _fill_zero12(engine, locals_: Dict[str, Dict[str, Any]], names: Dict[int, str], load_optim: bool) -> None:
    """ZeRO 1 / 2 and DeepSpeed's bf16 optimizer (the pipeline engine's in bf16): the same fragments."""
    optimizer = engine.optimizer
    base = optimizer.optimizer
    groups = getattr(optimizer, "bit16_groups", None) or optimizer.bf16_groups
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
    if load_optim:
        _start_flat_states(groups, flats, base, locals_, names)
    for group, flat in zip(groups, flats):
        for param in group:
            state = locals_.get(names.get(id(param), ""))
            if state is None:  # not in the checkpoint (strict=False)
                continue
            with torch.no_grad():
                param.copy_(state[FP32].to(param.dtype))
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:  # no fragment of it in this data-parallel rank's partition
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, target in _flat_targets(flat, base, load_optim).items():
                target.data.narrow(0, hp.start, hp.numel).copy_(state[key].reshape(-1).narrow(0, lp.start, lp.numel))
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False  # fragments of the new state are linked at the next step


def _fill_zero3(engine, locals_: Dict[str, Dict[str, Any]], names: Dict[int, str], load_optim: bool) -> None:
    optimizer = engine.optimizer
    base = optimizer.optimizer
    rank = dist.get_rank(group=optimizer.dp_process_group)
    world = dist.get_world_size(group=optimizer.dp_process_group)
    flats = optimizer.fp32_partitioned_groups_flat
    if load_optim:
        _start_flat_states(optimizer.fp16_groups, flats, base, locals_, names)
    for group in optimizer.fp16_groups:
        for param in group:
            state = locals_.get(names.get(id(param), ""))
            if state is None:  # not in the checkpoint (strict=False)
                continue
            index, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
            for key, target in _flat_targets(flats[index], base, load_optim).items():
                value = state[key].reshape(-1).float()
                padded = torch.nn.functional.pad(value, (0, numel * world - value.numel()))
                target.data.narrow(0, offset, numel).copy_(padded.narrow(0, rank * numel, numel))
    # the module's partitions from the fp32 ones, as DeepSpeed's own ZeRO-3 load does
    for fp16, fp32, params in zip(optimizer.fp16_partitioned_groups_flat, flats, optimizer.fp16_partitioned_groups):
        if fp16 is not None and fp16.numel():
            fp16.data.copy_(fp32.data)
            for partitioned, value in zip(params, optimizer.unflatten(fp16, params)):
                partitioned.data = value.data


def load_resharded(path: str, saved_args: Mapping[str, Any], model_config: ModelConfig, engine, load_optim: bool,
                   strict: bool = True, restore_counters: bool = True, verified_kind: Optional[str] = None
                   ) -> Tuple[int, Dict[str, Any]]:
    """Load checkpoint ``path`` (saved with ``saved_args``' layout) into ``engine`` of another layout; returns
    (iteration, client state) as megatron.checkpoint.engine.load_checkpoint does. Without ``load_optim`` only the
    weights (and the client state) are loaded; without ``strict`` parameters the checkpoint lacks keep their values
    (a reward model's new value head); ``restore_counters``: DeepSpeed's step / sample counters are the
    checkpoint's (not for a fine-tune); ``verified_kind``: as megatron.checkpoint.neox_checkpoint.read_checkpoint's
    (the checkpoint find_checkpoint found and verified: no rank hashes or classifies it again)."""
    problem = moe_problem(path, saved_args, model_config)
    if problem:
        raise CheckpointError(problem)
    saved_layout = (int(saved_args.get("model_parallel_size") or 1), int(saved_args.get("pipe_parallel_size") or 0))
    names = {id(p): flat_name(n, model_config.num_layers) for n, p in engine.module.named_parameters()}
    if load_optim:
        state = read_training_state(path, model_config, saved_layout, wanted=set(names.values()),
                                    verified_kind=verified_kind)
    else:
        try:
            weights = read_checkpoint(path, args=saved_args, verified_kind=verified_kind).state
        except ConversionError as exc:
            raise CheckpointError(str(exc)) from None
        state = TrainingState(params={n: {FP32: w.float()} for n, w in weights.items()}, zero_stage=0)
    tp_rank = optimizer_layout(engine)["tensor_rank"]
    missing = sorted(set(names.values()) - set(state.params))
    if missing and strict:
        raise CheckpointError(f"checkpoint {path} has no {'optimizer state' if load_optim else 'weights'} for "
                              f"{missing[:5]}{' ...' if len(missing) > 5 else ''}")
    locals_ = {name: {key: (_local(name, value, model_config, tp_rank)
                            if torch.is_tensor(value) and value.dim() > 0 else value)
                      for key, value in state.params[name].items()} for name in set(names.values()) - set(missing)}
    names = {key: name for key, name in names.items() if name in locals_}
    kind = _engine_kind(engine)
    {"zero0": _fill_zero0, "zero12": _fill_zero12, "zero3": _fill_zero3}[kind](engine, locals_, names, load_optim)
    client = client_state(path)
    if load_optim and engine.lr_scheduler is not None and client.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(client["lr_scheduler"])
    if restore_counters:  # as DeepSpeed's own load does unless it loads the module only
        engine.global_steps = int(client.get("global_steps") or 0)
        engine.global_samples = int(client.get("global_samples") or 0)
        engine.skipped_steps = int(client.get("skipped_steps") or 0)
    return int(client.get("iteration", 0)), client
