"""Building the DeepSpeed config dict from NeoXArgs.

It holds exactly DeepSpeed's keys, so `deepspeed.runtime.config.DeepSpeedConfig` parses it unchanged;
GPT-NeoX-only arguments stay on NeoXArgs."""

from typing import TYPE_CHECKING, Any, Dict, List, Tuple

if TYPE_CHECKING:
    from megatron.neox_arguments.arguments import NeoXArgs

PASSTHROUGH_SECTIONS = ("optimizer", "scheduler", "flops_profiler", "activation_checkpointing", "tensorboard",
                        "wandb", "csv_monitor", "comms_logger", "checkpoint", "data_types", "autotuning")
"""NeoXArgs fields that are DeepSpeed config sections of the same name, copied when set."""


def build_deepspeed_config(args: "NeoXArgs") -> Tuple[Dict[str, Any], List[str]]:
    """Return (config, problems); problems name duplicate keys in deepspeed_extra_args."""
    config: Dict[str, Any] = {
        "train_batch_size": args.train_batch_size,
        "train_micro_batch_size_per_gpu": args.train_micro_batch_size_per_gpu,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.gradient_clipping,
        "steps_per_print": args.steps_per_print,
        "wall_clock_breakdown": args.wall_clock_breakdown,
        "prescale_gradients": args.prescale_gradients,
        "gradient_predivide_factor": args.gradient_predivide_factor,
        "dump_state": args.dump_state,
        "zero_optimization": dict(args.zero_optimization or {"stage": args.zero_stage}),
    }
    for section in PASSTHROUGH_SECTIONS:
        value = getattr(args, section)
        if value is not None:
            config[section] = value
    if args.precision == "fp16":
        config["fp16"] = {**(args.fp16 or {}), "enabled": True}
    elif args.precision == "bfloat16":
        config["bf16"] = {**(args.bf16 or {}), "enabled": True}
    if args.communication_data_type is not None:
        config["communication_data_type"] = args.communication_data_type
    elif args.fp32_allreduce:
        config["communication_data_type"] = "fp32"
    problems = []
    for key, value in (args.deepspeed_extra_args or {}).items():
        if key in config:
            problems.append(f"deepspeed_extra_args['{key}'] duplicates the top-level DeepSpeed key '{key}' that "
                            f"NeoX already sets from its own arguments; set it once, as a top-level argument")
        else:
            config[key] = value
    return config, problems
