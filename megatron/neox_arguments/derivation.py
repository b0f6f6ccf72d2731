"""Values GPT-NeoX computes from the user's arguments before launching.

Each function reads what the user provided (`provided`: the keys actually set, since a default of 1 for
gradient_accumulation_steps must not count as "given") and fills derived fields, returning problems
instead of raising so that every problem is reported at once."""

import dataclasses
import inspect
import subprocess
from typing import Any, Callable, Dict, List, Optional, Set

from megatron.errors import ConfigError
from megatron.model.config import expand_attention_config
from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.hostfile import count_global_ranks
from megatron.utils.bf16_speed import auto_precision


def derive_world(args: NeoXArgsSchema) -> List[str]:
    """global_num_gpus and the data-parallel size."""
    problems: List[str] = []
    if args.global_num_gpus is None:
        try:
            args.global_num_gpus = count_global_ranks(args.hostfile, args.include, args.exclude,
                                                      args.num_nodes, args.num_gpus)
        except ConfigError as err:
            return err.problems
    if args.global_num_gpus < 1:
        return [f"global_num_gpus is {args.global_num_gpus}; at least one rank is needed"]
    args.is_pipe_parallel = args.pipe_parallel_size >= 1
    stages = max(args.pipe_parallel_size, 1)
    context = max(args.context_parallel_size, 1)  # below 1 is refused by parallelism_problems
    model_ranks = stages * context * args.model_parallel_size
    if args.global_num_gpus % model_ranks:
        problems.append(
            f"global_num_gpus={args.global_num_gpus} is not divisible by pipe_parallel_size x context_parallel_size x "
            f"model_parallel_size = {stages} x {context} x {args.model_parallel_size}; change num_gpus (or the "
            f"hostfile) or the parallel sizes")
    else:
        args.data_parallel_size = args.global_num_gpus // model_ranks
    return problems


def derive_batch(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """Solve train_batch_size = micro x grad_acc x dp from whichever two (or three) were given."""
    if args.batch_size is not None and "train_micro_batch_size_per_gpu" not in provided:
        args.train_micro_batch_size_per_gpu = args.batch_size
        provided = provided | {"train_micro_batch_size_per_gpu"}
    dp = args.data_parallel_size
    if dp is None:
        return []
    train = args.train_batch_size if "train_batch_size" in provided else None
    micro = args.train_micro_batch_size_per_gpu if "train_micro_batch_size_per_gpu" in provided else None
    acc = args.gradient_accumulation_steps if "gradient_accumulation_steps" in provided else None
    for name, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", acc)):
        if value is not None and value < 1:
            return [f"{name}={value} must be >= 1"]
    if train is not None and micro is not None and acc is not None:
        if train != micro * acc * dp:
            return [f"train_batch_size={train} != train_micro_batch_size_per_gpu={micro} x "
                    f"gradient_accumulation_steps={acc} x data-parallel size {dp}; set only two of the three"]
    elif train is not None and micro is not None:
        acc, rest = divmod(train, micro * dp)
        if rest or acc == 0:
            return [f"train_batch_size={train} is not a multiple of train_micro_batch_size_per_gpu={micro} x "
                    f"data-parallel size {dp}"]
    elif train is not None and acc is not None:
        micro, rest = divmod(train, acc * dp)
        if rest or micro == 0:
            return [f"train_batch_size={train} is not a multiple of gradient_accumulation_steps={acc} x "
                    f"data-parallel size {dp}"]
    elif micro is not None:
        acc = acc if acc is not None else 1
        train = micro * acc * dp
    elif train is not None:
        acc = acc if acc is not None else 1
        micro, rest = divmod(train, acc * dp)
        if rest or micro == 0:
            return [f"train_batch_size={train} is not a multiple of the data-parallel size {dp}"]
    else:
        return []  # generation and evaluation need none; training_problems asks for one
    args.train_batch_size, args.train_micro_batch_size_per_gpu, args.gradient_accumulation_steps = train, micro, acc
    if args.batch_size is not None and args.batch_size != micro:
        return [f"batch_size={args.batch_size} (the older name of train_micro_batch_size_per_gpu) disagrees with "
                f"train_micro_batch_size_per_gpu={micro}; keep one"]
    args.batch_size = micro
    return []


def _enabled(section: Optional[Dict[str, Any]]) -> bool:
    return bool(section) and bool(section.get("enabled", False))


FP16_MIRRORS = (("loss_scale", "loss_scale"), ("loss_scale_window", "loss_scale_window"),
                ("hysteresis", "hysteresis"), ("min_scale", "min_loss_scale"))
"""(top-level argument, key of the DeepSpeed fp16 dict): one setting written in either place."""

ZERO_MIRRORS = (("zero_stage", "stage"), ("zero_reduce_scatter", "reduce_scatter"),
                ("zero_contiguous_gradients", "contiguous_gradients"), ("zero_reduce_bucket_size", "reduce_bucket_size"),
                ("zero_allgather_bucket_size", "allgather_bucket_size"))
"""(top-level argument, key of the DeepSpeed zero_optimization dict)."""

ACTIVATION_CHECKPOINTING_MIRRORS = (("partition_activations", "partition_activations"),
                                    ("checkpoint_in_cpu", "cpu_checkpointing"),
                                    ("contiguous_checkpointing", "contiguous_memory_optimization"),
                                    ("synchronize_each_layer", "synchronize_checkpoint_boundary"),
                                    ("profile_backward", "profile"))
"""(top-level argument, key of the DeepSpeed activation_checkpointing dict)."""

ACTIVATION_CHECKPOINTING_KEYS = tuple(key for _, key in ACTIVATION_CHECKPOINTING_MIRRORS) + ("number_checkpoints",)
"""Every key DeepSpeed's activation_checkpointing section has."""


def _defaults(args: NeoXArgsSchema) -> Dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(args)}


def _whole_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()


def derive_precision(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """precision from the fp16 / bf16 dicts; the top-level fp16 loss-scaling arguments and the fp16 dict made
    one setting (either may be written; both written and different is a problem)."""
    problems: List[str] = []
    fp16_on, bf16_on = _enabled(args.fp16), _enabled(args.bf16)
    if fp16_on and args.fp16.get("type", "fp16") not in ("fp16", "bfloat16"):
        problems.append(f"fp16.type={args.fp16['type']!r} must be 'fp16' or 'bfloat16' (GPT-NeoX's spellings); "
                        f"DeepSpeed needs no type key")
        return problems
    if fp16_on and args.fp16.get("type") == "bfloat16":  # older GPT-NeoX spelling of bf16
        fp16_on, bf16_on = False, True
        args.bf16 = {"enabled": True}
        args.fp16 = None
    if fp16_on and bf16_on:
        problems.append("fp16.enabled and bf16.enabled are both true; choose one precision")
        return problems
    implied = "fp16" if fp16_on else "bfloat16" if bf16_on else None
    if args.precision == "auto":
        if implied is not None:
            problems.append(f"precision='auto' decides between bf16 and fp32 itself, but "
                            f"{'fp16' if fp16_on else 'bf16'}.enabled=true already says {implied!r}; remove one")
            return problems
        choice = auto_precision()
        args.precision, args.precision_choice = choice.precision, choice.reason
    if "precision" in provided and args.precision is not None:
        if implied is not None and implied != args.precision:
            problems.append(f"precision={args.precision!r} contradicts "
                            f"{'fp16' if fp16_on else 'bf16'}.enabled=true (which means {implied!r})")
        elif implied is None and args.precision == "fp16":
            args.fp16 = {**(args.fp16 or {}), "enabled": True}
        elif implied is None and args.precision == "bfloat16":
            args.bf16 = {**(args.bf16 or {}), "enabled": True}
    else:
        args.precision = implied or "fp32"
    if args.precision == "fp16":
        problems += _unify_fp16(args, provided)
    else:
        defaults = _defaults(args)
        for name, _key in FP16_MIRRORS:
            value = getattr(args, name)
            if name in provided and value != defaults[name] and not (name == "loss_scale" and not value):
                problems.append(f"{name}={value!r} is an fp16 loss-scaling setting but precision is "
                                f"{args.precision!r}; remove it")
        if "dynamic_loss_scale" in provided and args.dynamic_loss_scale:
            problems.append(f"dynamic_loss_scale=true is an fp16 loss-scaling setting but precision is "
                            f"{args.precision!r}; remove it")
        args.dynamic_loss_scale = False
    return problems


def _same_loss_scale(name: str, ours: Any, theirs: Any) -> bool:
    if name == "loss_scale":  # None and 0 both mean dynamic
        return (ours or 0) == (theirs or 0)
    return ours == theirs


def _unify_fp16(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    args.fp16 = {k: v for k, v in (args.fp16 or {}).items() if k != "type"}
    problems = _unify_section(args, provided, "fp16", FP16_MIRRORS, same=_same_loss_scale)
    if args.loss_scale is None:
        args.loss_scale = 0
    for name in ("loss_scale_window", "min_scale"):
        value = getattr(args, name)
        if not _whole_number(value) or value < 1:
            problems.append(f"{name}={value!r} must be a whole number >= 1 (DeepSpeed's fp16 setting is an int)")
    if not _whole_number(args.loss_scale) or args.loss_scale < 0:
        problems.append(f"loss_scale={args.loss_scale!r} must be 0 (dynamic) or a positive whole number")
    dynamic = not args.loss_scale
    if "dynamic_loss_scale" in provided and args.dynamic_loss_scale is not None and args.dynamic_loss_scale != dynamic:
        if dynamic:
            problems.append("dynamic_loss_scale=false needs a static scale: set loss_scale (or fp16.loss_scale) "
                            "to a power of two")
        else:
            problems.append(f"dynamic_loss_scale=true contradicts the static loss_scale={args.loss_scale!r}; "
                            f"loss_scale 0 means dynamic")
    args.dynamic_loss_scale = dynamic
    args.fp16 = {**args.fp16, "loss_scale": args.loss_scale, "enabled": True}
    return problems


def _unify_section(args: NeoXArgsSchema, provided: Set[str], section: str, mirrors,
                   same: Callable[[str, Any, Any], bool] = lambda _name, a, b: a == b) -> List[str]:
    """Make each (argument, key of the `section` dict) pair one value: whichever side was written fills the
    other; both written and different is a problem naming both. Afterwards the dict holds every pair whose
    value is set (None leaves DeepSpeed's default)."""
    raw = getattr(args, section)
    if raw is not None and not isinstance(raw, dict):
        return [f"{section} must be a dict, got {raw!r}"]
    problems: List[str] = []
    values = dict(raw or {})
    for name, key in mirrors:
        value = getattr(args, name)
        given = name in provided and value is not None
        if given and key in values:
            if not same(name, value, values[key]):
                problems.append(f"{name}={value!r} contradicts {section}.{key}={values[key]!r}; they are one "
                                f"setting, set it in one place")
        elif key in values:
            setattr(args, name, values[key])
        if getattr(args, name) is not None and not (given and key in values):
            values[key] = getattr(args, name)
    setattr(args, section, values)
    return problems


def derive_optimizer_and_zero(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """optimizer_type and lr from the optimizer dict; zero_* and zero_optimization as one setting; clip_grad and
    gradient_clipping as one setting."""
    problems: List[str] = []
    if args.optimizer is not None:
        kind = args.optimizer.get("type")
        if not isinstance(kind, str):
            problems.append(f"optimizer must have a string 'type' (e.g. Adam), got {args.optimizer!r}")
        else:
            args.optimizer_type = kind.lower()
        params = args.optimizer.get("params", {}) or {}
        if not isinstance(params, dict):
            problems.append(f"optimizer.params must be a dict, got {params!r}")
        elif "lr" in params:
            lr = params["lr"]
            if isinstance(lr, bool) or not isinstance(lr, (int, float)):
                problems.append(f"optimizer.params.lr must be a number, got {lr!r}")
            elif "lr" in provided and args.lr != lr:
                problems.append(f"lr={args.lr} disagrees with optimizer.params.lr={lr}; set it in one place")
            else:
                args.lr = float(lr)
    problems += _unify_section(args, provided, "zero_optimization", ZERO_MIRRORS)
    args.zero_optimization.setdefault("stage", 0)
    args.zero_stage = args.zero_optimization["stage"]
    if "clip_grad" in provided and "gradient_clipping" in provided and args.clip_grad != args.gradient_clipping:
        problems.append(f"clip_grad={args.clip_grad!r} contradicts gradient_clipping={args.gradient_clipping!r}; "
                        f"they are one setting (DeepSpeed's gradient_clipping), set it in one place")
    elif "clip_grad" in provided:
        args.gradient_clipping = args.clip_grad
    else:
        args.clip_grad = args.gradient_clipping
    return problems


def derive_recompute(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """Megatron-LM's recompute keys onto GPT-NeoX's: recompute_granularity 'full' is checkpoint_activations,
    method 'uniform' with checkpoint_num_layers = recompute_num_layers, method 'block' with one layer per checkpoint
    (recompute_num_layers is then the number of layers checkpointed per stage, ModelConfig.recompute_block_layers);
    'selective' is read by the attention layers (ModelConfig.recompute_granularity)."""
    granularity, layers = args.recompute_granularity, args.recompute_num_layers
    if granularity is None:
        return [f"{name}={getattr(args, name)!r} needs recompute_granularity: full" for name in
                ("recompute_method", "recompute_num_layers") if getattr(args, name) is not None]
    if granularity == "selective":
        problems = [f"{name}={getattr(args, name)!r} is a setting of recompute_granularity 'full', not 'selective' "
                    f"(which recomputes the attention core of every layer)" for name in
                    ("recompute_method", "recompute_num_layers") if getattr(args, name) is not None]
        if args.checkpoint_activations:
            problems.append("recompute_granularity 'selective' with checkpoint_activations: true; full-layer "
                            "checkpointing already recomputes the attention core, choose one")
        return problems
    if "checkpoint_activations" in provided and not args.checkpoint_activations:
        return ["recompute_granularity 'full' with checkpoint_activations: false; they are one setting, keep one"]
    if args.recompute_method == "block":
        if "checkpoint_num_layers" in provided and args.checkpoint_num_layers != 1:
            return [f"recompute_method 'block' with checkpoint_num_layers={args.checkpoint_num_layers}: block "
                    f"checkpoints each of the first recompute_num_layers layers of a stage on its own; remove "
                    f"checkpoint_num_layers"]
    elif layers is not None:
        if "checkpoint_num_layers" in provided and args.checkpoint_num_layers != layers:
            return [f"recompute_num_layers={layers} and checkpoint_num_layers={args.checkpoint_num_layers} are one "
                    f"setting with two values; keep one"]
        args.checkpoint_num_layers = layers
    args.checkpoint_activations = True
    return []


def derive_activation_checkpointing(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """The top-level activation-checkpointing flags and DeepSpeed's activation_checkpointing dict as one setting;
    number_checkpoints (DeepSpeed's buffer count for contiguous checkpointing) defaults to the number of
    checkpointed chunks, ceil(num_layers / checkpoint_num_layers), as GPT-NeoX computes it."""
    section = args.activation_checkpointing
    if isinstance(section, dict):
        unknown = sorted(set(section) - set(ACTIVATION_CHECKPOINTING_KEYS))
        if unknown:
            return [f"activation_checkpointing has unknown keys {unknown}; DeepSpeed's keys are "
                    f"{', '.join(ACTIVATION_CHECKPOINTING_KEYS)}"]
    problems = _unify_section(args, provided, "activation_checkpointing", ACTIVATION_CHECKPOINTING_MIRRORS)
    if args.contiguous_checkpointing and not args.partition_activations:
        problems.append("contiguous_checkpointing (activation_checkpointing.contiguous_memory_optimization) needs "
                        "partition_activations=true: DeepSpeed copies the partitioned activations into its buffers")
    if problems or not isinstance(args.num_layers, int) or not isinstance(args.checkpoint_num_layers, int) \
            or args.checkpoint_num_layers < 1:
        return problems
    needed = -(-args.num_layers // args.checkpoint_num_layers)
    given = args.activation_checkpointing.get("number_checkpoints")
    if given is None:
        args.activation_checkpointing["number_checkpoints"] = needed
    elif isinstance(given, bool) or not isinstance(given, int) or given < needed:
        problems.append(f"activation_checkpointing.number_checkpoints={given!r} must be an integer >= {needed}, the "
                        f"number of checkpointed chunks (num_layers={args.num_layers} / checkpoint_num_layers="
                        f"{args.checkpoint_num_layers}); DeepSpeed keeps one contiguous buffer per checkpoint")
    return problems


SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed schedulers a `scheduler` dict may name (DeepSpeed builds it and steps it after each optimizer step)."""

BUILT_IN_SCHEDULE_ARGUMENTS = ("lr_decay_style", "lr_decay_iters", "lr_decay_fraction", "min_lr", "warmup",
                               "override_lr_scheduler", "use_checkpoint_lr_scheduler", "lr_wsd_decay_style",
                               "lr_wsd_decay_iters", "lr_warmup_iters", "lr_warmup_init", "decoupled_lr",
                               "decoupled_min_lr", "start_weight_decay", "end_weight_decay",
                               "weight_decay_incr_style", "lr_decay_samples", "lr_warmup_samples",
                               "lr_wsd_decay_samples")
"""Arguments of the built-in schedule (AnnealingLR), which a `scheduler` dict replaces."""


def derive_scheduler(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """Check a DeepSpeed `scheduler` dict against the scheduler's own signature; its peak learning rate is lr.

    With a scheduler dict, DeepSpeed builds that scheduler instead of the built-in AnnealingLR (as GPT-NeoX's
    DeepSpeed did), so arguments that only configure AnnealingLR are refused when set to non-default values."""
    if args.scheduler is None:
        return []
    scheduler = args.scheduler
    kind = scheduler.get("type")
    problems = [f"scheduler has unknown keys {sorted(set(scheduler) - {'type', 'params'})}; it takes type and "
                f"params"] if set(scheduler) - {"type", "params"} else []
    if kind in ("OneCycle", "LRRangeTest"):
        return problems + [f"scheduler.type={kind!r} is not supported yet; use one of {', '.join(SCHEDULER_TYPES)} "
                           f"or the built-in schedule (lr_decay_style, warmup, ...)"]
    if kind not in SCHEDULER_TYPES:
        return problems + [f"scheduler.type={kind!r} must be one of {', '.join(SCHEDULER_TYPES)} (DeepSpeed's "
                           f"schedulers), or remove the scheduler dict to use the built-in schedule"]
    params = scheduler.get("params") or {}
    if not isinstance(params, dict):
        return problems + [f"scheduler.params must be a dict, got {params!r}"]

    from deepspeed.runtime import lr_schedules

    signature = inspect.signature(getattr(lr_schedules, kind).__init__).parameters
    allowed = [name for name in signature if name not in ("self", "optimizer", "last_batch_iteration")]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        problems.append(f"scheduler.params has keys {unknown} that {kind} does not take; it takes {', '.join(allowed)}"
                        + (" (last_batch_iteration comes from the checkpoint when resuming)"
                           if "last_batch_iteration" in unknown else ""))
    missing = [name for name in allowed if signature[name].default is inspect.Parameter.empty and name not in params]
    if missing:
        problems.append(f"scheduler.params lacks {', '.join(missing)}, which {kind} needs (e.g. total_num_steps: "
                        f"train_iters)")
    steps = params.get("warmup_num_steps", 1000)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        problems.append(f"scheduler.params.warmup_num_steps={steps!r} must be a positive integer")
    if kind != "WarmupCosineLR":  # WarmupCosineLR scales the optimizer's lr; the others set warmup_max_lr
        peak = params.get("warmup_max_lr")
        if peak is None and args.lr is not None:
            params = {**params, "warmup_max_lr": args.lr}
        elif peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))):
            problems.append(f"scheduler.params.warmup_max_lr={peak!r} must be a number")
        elif peak is not None and args.lr is not None and float(peak) != args.lr:
            problems.append(f"scheduler.params.warmup_max_lr={peak!r} contradicts lr={args.lr!r} (the optimizer's "
                            f"lr); they are one setting, set it in one place")
    defaults = _defaults(args)
    for name in BUILT_IN_SCHEDULE_ARGUMENTS:
        value = getattr(args, name)
        if name in provided and value != defaults[name]:
            problems.append(f"{name}={value!r} configures the built-in learning-rate schedule, which the scheduler "
                            f"dict ({kind}) replaces; remove {name} or the scheduler dict")
    args.scheduler = {"type": kind, "params": params}
    return problems


def derive_model(args: NeoXArgsSchema) -> List[str]:
    """attention_config expansion, max_position_embeddings, text_gen_type, git_hash. (How long training runs,
    and what follows from it, is megatron.training_schedule.TrainingSchedule's.)"""
    problems: List[str] = []
    if isinstance(args.num_layers, int):
        try:
            args.attention_config = list(expand_attention_config(args.attention_config, args.num_layers))
        except ValueError as exc:
            problems.append(f"attention_config={args.attention_config!r}: {exc}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.text_gen_type is None:
        args.text_gen_type = "input-file" if args.sample_input_file else "unconditional"
    args.git_hash = _git_hash() or args.git_hash
    return problems


def _git_hash() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=__file__.rsplit("/", 3)[0])
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


MOE_SETTINGS = ("expert_interval", "moe_expert_interval", "moe_top_k", "moe_loss_coeff", "moe_train_capacity_factor",
                "moe_eval_capacity_factor", "moe_min_capacity", "moe_token_dropping", "create_moe_param_group",
                "moe_use_residual", "moe_expert_parallel_size", "moe_type", "moe_glu", "moe_lbl_in_fp32",
                "moe_jitter_eps", "enable_expert_tensor_parallelism", "moe_router_type", "use_tutel")
"""The arguments only a mixture of experts (moe_num_experts > 1) reads."""


def derive_moe(args: NeoXArgsSchema, provided: Set[str]) -> List[str]:
    """The mixture-of-experts settings GPT-NeoX spells twice become one value, and what depends on the run's layout
    is checked (the layer's own rules are megatron.model.config.moe_problems).

    * expert_interval (GPT-NeoX until 2025, default 2) and moe_expert_interval (its current name, default 1) are one
      setting: the one written wins; both written with different values is an error; neither gives 2.
    * moe_type deepspeed routes with DeepSpeed's top-k gate: moe_router_type becomes 'topk' unless written (then
      ModelConfig refuses 'sinkhorn' for it).
    * Without experts (moe_num_experts 1) every other MoE setting is refused when written: nothing would read it."""
    if args.moe_num_experts <= 1:
        return [f"{name}={getattr(args, name)!r} is a setting of mixture of experts, which is off "
                f"(moe_num_experts={args.moe_num_experts}); remove it or set moe_num_experts > 1"
                for name in MOE_SETTINGS if name in provided and getattr(args, name) != _defaults(args)[name]]
    problems: List[str] = []
    if "moe_expert_interval" in provided:
        if "expert_interval" in provided and args.expert_interval != args.moe_expert_interval:
            problems.append(f"expert_interval={args.expert_interval} and moe_expert_interval="
                            f"{args.moe_expert_interval} are one setting (GPT-NeoX's older and newer name); set one")
        args.expert_interval = args.moe_expert_interval
    else:
        args.moe_expert_interval = args.expert_interval
    if args.moe_type == "deepspeed" and "moe_router_type" not in provided:
        args.moe_router_type = "topk"
    if args.moe_type == "megablocks" and args.moe_token_dropping:
        problems.append("moe_token_dropping=true with moe_type='megablocks': the dropless layer never drops tokens; "
                        "token dropping with a capacity is DeepSpeed's layer (moe_type: deepspeed)")
    if args.moe_type == "megablocks" and args.enable_expert_tensor_parallelism:
        problems.append("enable_expert_tensor_parallelism=true with moe_type='megablocks': it splits each of DeepSpeed's "
                        "experts column / row over the tensor-parallel ranks (moe_type: deepspeed); the dropless layer "
                        "splits whole experts over them already; remove it or use moe_type deepspeed")
    if args.moe_type == "megablocks" and "moe_use_residual" in provided and args.moe_use_residual:
        problems.append("moe_use_residual=true with moe_type='megablocks': residual MoE (a dense MLP beside the "
                        "experts) is DeepSpeed's layer (moe_type: deepspeed); remove it or set it false")
    ep = args.moe_expert_parallel_size
    dp = args.data_parallel_size
    if ep > 1 and dp is not None and dp % ep:
        problems.append(f"moe_expert_parallel_size={ep} must divide the data-parallel size {dp} (the experts are split "
                        f"over groups of data-parallel ranks)")
    problems += _moe_engine_problems(args)
    return problems


def _moe_engine_problems(args: NeoXArgsSchema) -> List[str]:
    """What DeepSpeed's engine cannot combine with the experts."""
    problems = []
    zero = args.zero_stage if isinstance(args.zero_stage, int) else 0
    if zero == 3:
        problems.append("zero_optimization.stage=3 with a mixture of experts (moe_num_experts > 1): DeepSpeed supports "
                        "its MoE experts with ZeRO stages 0, 1 and 2 only")
    expert_groups = args.moe_type == "deepspeed" or args.moe_expert_parallel_size > 1
    if zero in (1, 2) and expert_groups and not args.create_moe_param_group:
        problems.append(f"create_moe_param_group=false with ZeRO stage {zero}: DeepSpeed's ZeRO needs the experts in "
                        f"their own parameter groups (moe_type deepspeed, or moe_expert_parallel_size > 1)")
    return problems
