"""An autotuner's DeepSpeed config read back into NeoXArgs (megatron.neox_arguments.autotuning's step 2 and 3): a
`--deepspeed_config` value, whether it is an experiment, and the args with its batch and ZeRO settings, validated
again. Above megatron.neox_arguments.validation (it re-checks the parallelism of the tuned args), below arguments."""

import base64
import binascii
import json
import os
from typing import Any, Dict, Mapping, Optional

from megatron.errors import ConfigError
from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.validation import parallelism_problems
from megatron.utils.text_files import parse_json, read_json


def read_deepspeed_config(value: str) -> Dict[str, Any]:
    """A `--deepspeed_config` argument: a JSON file, or the base64 JSON that the autotuner's experiments pass."""
    if value.endswith(".json") and os.path.isfile(value):
        return read_json(value, lambda problem: ConfigError([f"--deepspeed_config: {problem}"]))
    try:
        return parse_json(base64.urlsafe_b64decode(value.encode("ascii")).decode("utf-8"), "the base64 config")
    except (OSError, ValueError, binascii.Error) as exc:
        raise ConfigError([f"--deepspeed_config {value[:60]!r} is neither a DeepSpeed config JSON file nor the "
                           f"base64 config of an autotuning experiment ({exc})"]) from None


def is_experiment(ds_config: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed config is one of the autotuner's experiments (its engine measures and exits)."""
    return bool((ds_config.get("autotuning") or {}).get("enabled", False))


def _experiment_dir(ds_config: Mapping[str, Any]) -> Optional[str]:
    section = ds_config.get("autotuning") or {}
    path = section.get("metric_path") or section.get("model_info_path")
    return os.path.dirname(path) if path else None


def tuned_args(args: NeoXArgsSchema, ds_config: Mapping[str, Any], experiment: bool) -> NeoXArgsSchema:
    """`args` with the batch and ZeRO settings of a DeepSpeed config the autotuner wrote: an experiment's (then
    without checkpoint loading or saving, wandb or comet, and with its logs in the experiment's result folder)
    or the optimal one (then a normal run: autotuning_run and the autotuning dict are cleared). The engine gets
    that config as it is (our optimizer is built separately, as always). Raises ConfigError."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    accumulation = ds_config.get("gradient_accumulation_steps", 1)
    if not isinstance(micro, int) or not isinstance(accumulation, int) or micro < 1 or accumulation < 1:
        raise ConfigError([f"the autotuner's DeepSpeed config has train_micro_batch_size_per_gpu={micro!r} and "
                           f"gradient_accumulation_steps={accumulation!r}; both must be integers >= 1"])
    train = micro * accumulation * args.data_parallel_size
    if ds_config.get("train_batch_size", train) != train:
        raise ConfigError([f"the autotuner's DeepSpeed config has train_batch_size={ds_config['train_batch_size']} "
                           f"!= {micro} x {accumulation} x data-parallel size {args.data_parallel_size}"])
    zero = dict(ds_config.get("zero_optimization") or {"stage": 0})
    config = {**json.loads(json.dumps(ds_config)), "train_batch_size": train, "zero_optimization": zero}
    changes: Dict[str, Any] = {
        "train_batch_size": train, "train_micro_batch_size_per_gpu": micro, "batch_size": micro,
        "gradient_accumulation_steps": accumulation, "zero_optimization": zero, "zero_stage": zero.get("stage", 0),
        "zero_reduce_scatter": zero.get("reduce_scatter"), "zero_contiguous_gradients": zero.get("contiguous_gradients"),
        "zero_reduce_bucket_size": zero.get("reduce_bucket_size"),
        "zero_allgather_bucket_size": zero.get("allgather_bucket_size"),
        "deepspeed_config": config,
    }
    if experiment:
        folder = _experiment_dir(ds_config)
        changes.update(save=None, load=None, use_wandb=False, use_comet=False, tensorboard_dir=None,
                       log_dir=os.path.join(folder, "logs") if folder else args.log_dir,
                       autotuning=config.get("autotuning"))
    else:
        config.pop("autotuning", None)
        changes.update(autotuning_run=None, autotuning=None)
    tuned = type(args)(**{**args.to_dict(), **changes})
    problems = parallelism_problems(tuned)
    if problems:
        raise ConfigError([f"the autotuner's DeepSpeed config: {p}" for p in problems])
    return tuned
