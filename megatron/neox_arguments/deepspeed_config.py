"""Building the DeepSpeed config dict from NeoXArgs, and folding `deepspeed_extra_args` into it.

The config holds exactly DeepSpeed's keys, so `deepspeed.runtime.config.DeepSpeedConfig` parses it unchanged;
GPT-NeoX-only arguments stay on NeoXArgs. Settings that GPT-NeoX lets a user write in two places (clip_grad /
gradient_clipping, the top-level fp16 loss-scaling arguments / the fp16 dict, zero_* / zero_optimization, the
activation-checkpointing flags / the activation_checkpointing dict) are made one value by derivation.py; this
module writes that value.

`deepspeed_extra_args` may add keys but never contradict one the config sets:
  * a key that is a NeoX argument of the DeepSpeed group (fp16, bf16 or DeepSpeed's older `bfloat16`,
    zero_optimization, optimizer, scheduler, gradient_clipping, ...) is folded into that argument before
    derivation and validation (dicts merged key by key), so it is checked like the argument itself: e.g.
    {fp16: {enabled: true}} with precision: fp32 is refused;
  * a NeoX argument that is not a DeepSpeed key (num_layers, seed, ...) is refused;
  * any other key is added to the DeepSpeed config, merged into a dict the config already has, and refused
    where it would change a value the config sets (the message names the key path and both values)."""

import re
from typing import Any, Dict, Iterable, List, Mapping, Set, Tuple

from megatron.data.data_efficiency import deepspeed_section as data_efficiency_section, routing_section
from megatron.model.random_ltd_settings import deepspeed_random_ltd
from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.observability.comms_logging import deepspeed_section as comms_logger_section

PASSTHROUGH_SECTIONS = ("optimizer", "scheduler", "flops_profiler", "tensorboard", "wandb", "csv_monitor",
                        "comms_logger", "checkpoint", "data_types", "autotuning")
"""NeoXArgs fields that are DeepSpeed config sections of the same name, copied when set."""

QUIET_STEPS_PER_PRINT = 2 ** 31 - 1
"""DeepSpeed's steps_per_print without wall_clock_breakdown: an interval no run reaches. What DeepSpeed prints at
that interval is then only its PipelineEngine's `steps: N loss: X` line, which repeats the loss line this
project's logger writes every log_interval steps (its other reports there are timings, wall_clock_breakdown's,
and INFO logs the workers do not show)."""

NOT_DEEPSPEED_KEYS = ("deepspeed", "curriculum_seqlen", "deepspeed_extra_args")
"""Fields of the DeepSpeed argument group that are not keys of DeepSpeed's config."""

DEEPSPEED_KEY_ALIASES = {"bfloat16": "bf16"}
"""Older DeepSpeed key names that DeepSpeed still reads as the newer one."""

REFUSED_EXTRA_KEYS = {
    "torch_autocast": "precision is chosen by precision / fp16 / bf16; DeepSpeed's torch_autocast is not "
                      "supported yet",
}
"""DeepSpeed keys that would change what a NeoX argument decides, refused in deepspeed_extra_args."""

UNSAFE_LOADING_KEYS = {
    ("checkpoint", "load_universal"):
        "DeepSpeed reads universal checkpoints with its own loader (runtime/base_optimizer.py, zero/stage3.py, "
        "checkpoint/universal_checkpoint.py: torch.load(weights_only=False)), which runs any code a planted file "
        "holds; this project does not read them. Resume from this project's checkpoints (they reshard to another "
        "parallel layout themselves), or convert: tools/ckpts",
    ("checkpoint", "writer"):
        "DeepSpeed's fast and decoupled checkpoint writers read checkpoints back with their own torch.load, past "
        "this project's safe reader and checksums; use async_save for saving in the background",
    ("datastates_ckpt",):
        "the DataStates checkpoint engine reads checkpoints back with its own loader, past this project's safe "
        "reader and checksums; use async_save for saving in the background",
}
"""DeepSpeed config keys (as key paths) that make DeepSpeed's engine read checkpoint files with a loader of its own
instead of megatron.checkpoint.files' (which unpickles nothing but tensors and plain data): refused wherever they
are written (the `checkpoint` section or deepspeed_extra_args), with why. Found by reading every torch.load that
DeepSpeed 0.19's engine.load_checkpoint reaches: the rest go through engine.checkpoint_engine.load, which
megatron.checkpoint.files.use_safe_loading replaces."""


def merge_without_contradiction(base: Mapping[str, Any], extra: Mapping[str, Any], path: str = ""
                                ) -> Tuple[Dict[str, Any], List[Tuple[str, Any, Any]]]:
    """`base` with the keys of `extra` added (nested dicts merged); returns (merged, contradictions), each
    contradiction (key path, base value, extra value) for a leaf that both set to different values."""
    merged = dict(base)
    contradictions: List[Tuple[str, Any, Any]] = []
    for key, value in extra.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in merged:
            merged[key] = value
        elif isinstance(merged[key], dict) and isinstance(value, dict):
            merged[key], inner = merge_without_contradiction(merged[key], value, where)
            contradictions += inner
        elif merged[key] != value:
            contradictions.append((where, merged[key], value))
    return merged, contradictions


def fold_deepspeed_extra_args(values: Dict[str, Any], origin: Dict[str, str], deepspeed_fields: Iterable[str],
                              all_fields: Set[str]) -> Tuple[List[str], Set[str]]:
    """Move the keys of deepspeed_extra_args that are NeoX arguments into those arguments (in place, before
    type checks and derivation); return (problems, the arguments deepspeed_extra_args set or added to)."""
    extra = values.get("deepspeed_extra_args")
    if not isinstance(extra, dict):
        return [], set()  # absent, or the type check reports it
    deepspeed_fields = set(deepspeed_fields) - set(NOT_DEEPSPEED_KEYS)
    problems: List[str] = []
    folded: Set[str] = set()
    remaining: Dict[str, Any] = {}
    for key, value in extra.items():
        name = DEEPSPEED_KEY_ALIASES.get(key, key)
        if key in REFUSED_EXTRA_KEYS:
            problems.append(f"deepspeed_extra_args['{key}']: {REFUSED_EXTRA_KEYS[key]}")
        elif name in deepspeed_fields:
            folded.add(name)
            if name not in values or values[name] is None:
                values[name] = value
                origin[name] = "deepspeed_extra_args"
                continue
            where = origin.get(name, "the config")
            if isinstance(values[name], dict) and isinstance(value, dict):
                values[name], contradictions = merge_without_contradiction(values[name], value, name)
                problems += [f"deepspeed_extra_args: {path}={theirs!r} contradicts {path}={ours!r} ({where})"
                             for path, ours, theirs in contradictions]
            elif values[name] != value:
                problems.append(f"deepspeed_extra_args: {key}={value!r} contradicts {name}={values[name]!r} "
                                f"({where}); set it once")
        elif name in all_fields:
            problems.append(f"deepspeed_extra_args['{key}']: '{key}' is a NeoX argument, not a DeepSpeed config key; "
                            f"set it at the top level of the config")
        else:
            remaining[key] = value
    values["deepspeed_extra_args"] = remaining or None
    return problems, folded


def note_extra_args_origin(problems: List[str], folded: Set[str]) -> List[str]:
    """Say where a problem's dict came from when deepspeed_extra_args set (part of) it."""
    noted = []
    for problem in problems:
        sources = [name for name in sorted(folded) if re.search(rf"(?<![\w.]){re.escape(name)}[.=]", problem)]
        noted.append(problem + "".join(f" ({name} is set, at least in part, in deepspeed_extra_args)"
                                       for name in sources if "deepspeed_extra_args" not in problem))
    return noted


def _zero_section(args: NeoXArgsSchema) -> Dict[str, Any]:
    zero = dict(args.zero_optimization or {})
    zero["stage"] = args.zero_stage
    for key, value in (("reduce_scatter", args.zero_reduce_scatter),
                       ("contiguous_gradients", args.zero_contiguous_gradients),
                       ("reduce_bucket_size", args.zero_reduce_bucket_size),
                       ("allgather_bucket_size", args.zero_allgather_bucket_size)):
        if value is not None:  # None: DeepSpeed's default
            zero[key] = value
    return zero


def _fp16_section(args: NeoXArgsSchema) -> Dict[str, Any]:
    if args.precision != "fp16":
        return {**(args.fp16 or {}), "enabled": False}
    return {**(args.fp16 or {}), "enabled": True,
            "loss_scale": 0 if args.dynamic_loss_scale else args.loss_scale,
            "loss_scale_window": int(args.loss_scale_window), "hysteresis": args.hysteresis,
            "min_loss_scale": int(args.min_scale)}


def _activation_checkpointing_section(args: NeoXArgsSchema) -> Dict[str, Any]:
    """What megatron.model.activation_checkpointing hands to deepspeed.checkpointing.configure (DeepSpeed's engine
    does not read this section itself; it is written so that the config states the truth)."""
    section = {"partition_activations": args.partition_activations, "cpu_checkpointing": args.checkpoint_in_cpu,
               "contiguous_memory_optimization": args.contiguous_checkpointing,
               "synchronize_checkpoint_boundary": args.synchronize_each_layer, "profile": args.profile_backward}
    number = (args.activation_checkpointing or {}).get("number_checkpoints")
    if number is not None:
        section["number_checkpoints"] = number
    return section


def build_deepspeed_config(args: NeoXArgsSchema) -> Tuple[Dict[str, Any], List[str]]:
    """Return (config, problems); problems name deepspeed_extra_args keys that contradict the config."""
    config: Dict[str, Any] = {
        "train_batch_size": args.train_batch_size,
        "train_micro_batch_size_per_gpu": args.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.clip_grad,  # one setting with gradient_clipping (derive_optimizer_and_zero)
        "steps_per_print": args.steps_per_print if args.wall_clock_breakdown else QUIET_STEPS_PER_PRINT,
        "wall_clock_breakdown": args.wall_clock_breakdown,
        "prescale_gradients": args.prescale_gradients,
        "gradient_predivide_factor": args.gradient_predivide_factor,
        "dump_state": args.dump_state,
        "zero_optimization": _zero_section(args),
        "fp16": _fp16_section(args),
        "bf16": {**(args.bf16 or {}), "enabled": args.precision == "bfloat16"},
        "activation_checkpointing": _activation_checkpointing_section(args),
    }
    for section in PASSTHROUGH_SECTIONS:
        value = getattr(args, section)
        if value is not None:
            config[section] = value
    if args.comms_logger is not None:
        config["comms_logger"] = comms_logger_section(args.comms_logger)
    efficiency = data_efficiency_section(args.data_efficiency,
                                         deepspeed_random_ltd(routing_section(args.data_efficiency)))
    if efficiency is not None:  # DeepSpeed's engine schedules random-LTD (and parses the sampling section)
        config["data_efficiency"] = efficiency
    if args.communication_data_type is not None:
        config["communication_data_type"] = args.communication_data_type
    elif args.fp32_allreduce:
        config["communication_data_type"] = "fp32"
    config, contradictions = merge_without_contradiction(config, args.deepspeed_extra_args or {})
    problems = [f"deepspeed_extra_args: {path}={theirs!r} contradicts {path}={ours!r}, which the config sets "
                f"from its own arguments; set it once, as a top-level argument" for path, ours, theirs in contradictions]
    return config, problems + unsafe_loading_problems(config)


_ABSENT = object()


def _setting(config: Mapping[str, Any], path: Tuple[str, ...]) -> Any:
    """The value at key path ``path`` of ``config`` (_ABSENT where a level is missing or not a dict)."""
    value: Any = config
    for key in path:
        value = value.get(key, _ABSENT) if isinstance(value, Mapping) else _ABSENT
    return value


def unsafe_loading_problems(config: Mapping[str, Any]) -> List[str]:
    """One problem per UNSAFE_LOADING_KEYS key the DeepSpeed config turns on: any value but false, and but null
    where DeepSpeed reads null as off (datastates_ckpt: null turns DataStates on)."""
    problems = []
    for path, why in UNSAFE_LOADING_KEYS.items():
        value = _setting(config, path)
        harmless = (_ABSENT, False) if path == ("datastates_ckpt",) else (_ABSENT, False, None)
        if not any(value is off for off in harmless):
            problems.append(f"{'.'.join(path)}={value!r} (a DeepSpeed setting, in the checkpoint section or "
                            f"deepspeed_extra_args) is refused: {why}")
    return problems
