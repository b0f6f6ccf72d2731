"""Values GPT-NeoX computes from the user's arguments before launching.

Each function reads what the user provided (`provided`: the keys actually set, since a default of 1 for
gradient_accumulation_steps must not count as "given") and fills derived fields, returning problems
instead of raising so that every problem is reported at once."""

import subprocess
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set

from megatron.neox_arguments.errors import ConfigError
from megatron.model_config import expand_attention_config
from megatron.neox_arguments.hostfile import count_global_ranks

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs


def derive_world(args: "NeoXArgs") -> List[str]:
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
    model_ranks = stages * args.model_parallel_size
    if args.global_num_gpus % model_ranks:
        problems.append(
            f"global_num_gpus={args.global_num_gpus} is not divisible by pipe_parallel_size x model_parallel_size "
            f"= {stages} x {args.model_parallel_size}; change num_gpus (or the hostfile) or the parallel sizes")
    else:
        args.data_parallel_size = args.global_num_gpus // model_ranks
    return problems


def derive_batch(args: "NeoXArgs", provided: Set[str]) -> List[str]:
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


def derive_precision(args: "NeoXArgs", provided: Set[str]) -> List[str]:
    """precision from the fp16 / bf16 dicts, and the fp16 loss-scaling fields from the fp16 dict."""
    problems: List[str] = []
    fp16_on, bf16_on = _enabled(args.fp16), _enabled(args.bf16)
    if fp16_on and args.fp16.get("type") == "bfloat16":  # older GPT-NeoX spelling of bf16
        fp16_on, bf16_on = False, True
        args.bf16 = {"enabled": True}
        args.fp16 = None
    if fp16_on and bf16_on:
        problems.append("fp16.enabled and bf16.enabled are both true; choose one precision")
        return problems
    implied = "fp16" if fp16_on else "bfloat16" if bf16_on else None
    if "precision" in provided and args.precision is not None:
        if implied is not None and implied != args.precision:
            problems.append(f"precision={args.precision!r} contradicts the {'fp16' if fp16_on else 'bf16'} dict, "
                            f"which enables {implied}")
        elif implied is None and args.precision == "fp16":
            args.fp16 = {**(args.fp16 or {}), "enabled": True}
        elif implied is None and args.precision == "bfloat16":
            args.bf16 = {**(args.bf16 or {}), "enabled": True}
    else:
        args.precision = implied or "fp32"
    if args.precision == "fp16":
        fp16 = args.fp16 or {}
        if "loss_scale" not in provided:
            args.loss_scale = fp16.get("loss_scale", 0)
        args.dynamic_loss_scale = not args.loss_scale
        args.loss_scale_window = fp16.get("loss_scale_window", args.loss_scale_window)
        args.hysteresis = fp16.get("hysteresis", args.hysteresis)
        args.min_scale = fp16.get("min_loss_scale", args.min_scale)
    else:
        args.dynamic_loss_scale = False
    return problems


def derive_optimizer_and_zero(args: "NeoXArgs", provided: Set[str]) -> List[str]:
    """optimizer_type and lr from the optimizer dict; zero_* from zero_optimization; clip_grad."""
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
    zero = args.zero_optimization or {}
    if "zero_stage" not in provided:
        args.zero_stage = zero.get("stage", 0)
    elif zero.get("stage", args.zero_stage) != args.zero_stage:
        problems.append(f"zero_stage={args.zero_stage} disagrees with zero_optimization.stage={zero['stage']}")
    for field_name, key in (("zero_reduce_scatter", "reduce_scatter"), ("zero_contiguous_gradients",
                            "contiguous_gradients"), ("zero_reduce_bucket_size", "reduce_bucket_size"),
                            ("zero_allgather_bucket_size", "allgather_bucket_size")):
        if field_name not in provided and key in zero:
            setattr(args, field_name, zero[key])
    if "gradient_clipping" in provided or "clip_grad" not in provided:
        args.clip_grad = args.gradient_clipping
    return problems


def derive_model(args: "NeoXArgs") -> List[str]:
    """attention_config expansion, max_position_embeddings, text_gen_type, save_iters, git_hash."""
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
    if args.train_iters is not None and args.lr_decay_fraction is not None:
        args.lr_decay_iters = int(args.lr_decay_fraction * args.train_iters)
    if args.save_iters is None and args.train_iters is not None:
        args.save_iters = checkpoint_iterations(args.checkpoint_factor, args.checkpoint_scale,
                                                args.extra_save_iters, args.train_iters)
    args.git_hash = _git_hash() or args.git_hash
    return problems


def checkpoint_iterations(factor: Optional[int], scale: str, extra: Optional[list], train_iters: int) -> List[int]:
    """Iterations at which a checkpoint is saved: every `factor` (linear) or at powers of `factor` (log)."""
    iterations: Set[int] = set(int(i) for i in (extra or []) if 0 < int(i) <= train_iters)
    if factor:
        if scale == "linear":
            iterations.update(range(factor, train_iters + 1, factor))
        elif factor > 1:
            step = factor
            while step <= train_iters:
                iterations.add(step)
                step *= factor
    return sorted(iterations)


def _git_hash() -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=__file__.rsplit("/", 3)[0])
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
