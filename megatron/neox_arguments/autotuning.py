"""DeepSpeed's autotuner driven from a GPT-NeoX config: `autotuning_run: tune | run` and the `autotuning` dict.

How a tuning launch goes (deepy.py, as in GPT-NeoX):
  1. deepy.py writes `autotuner_config(args)` (the DeepSpeed config with the tuning space: zero_optimization.stage
     a list or 'all'; no train_batch_size, so that each experiment's micro batch and gradient accumulation decide
     it) to a JSON file and starts DeepSpeed's runner with `--autotuning tune` and `train.py --deepspeed_config
     FILE` (`runner_autotuning_argv`).
  2. DeepSpeed's Autotuner (in deepy.py's process) profiles the model once (ZeRO-3, micro batch 1) and then
     runs one experiment per ZeRO stage x micro batch, each a `deepspeed --include ... train.py
     --deepspeed_config BASE64` launch. Each worker reads that config back (`tuned_args`), trains with it
     without loading or saving checkpoints (its logs go to the experiment's result folder), and DeepSpeed's
     engine writes the experiment's metrics (latency, throughput, FLOPS per GPU) and exits after
     autotuning.end_profile_step.
  3. The autotuner writes results_dir/summary.txt, ds_config_optimal.json and cmd_optimal.txt (where DeepSpeed
     documents them). With `run`, deepy.py then launches a normal training run with the optimal config
     (`tuned_args(..., experiment=False)`: batch and ZeRO settings from ds_config_optimal.json, saving and
     resuming as configured).

This module holds the config side's rules and the autotuner's config; megatron/neox_arguments/autotuned.py reads an
experiment's (or the optimal) config back into NeoXArgs (it re-validates them, so it sits above validation, which
uses the rules here); megatron/launch/autotuner.py holds the launcher side (the runner call and the patches that make the
autotuner run on one node without pdsh)."""

import json
import os
from typing import Any, Dict, List, Optional

from megatron.neox_arguments.groups import NeoXArgsSchema
from megatron.neox_arguments.launcher import multi_node_launch

AUTOTUNING_KEYS = {
    "enabled": bool, "fast": bool, "metric": str, "start_profile_step": int, "end_profile_step": int,
    "tuner_type": str, "tuner_early_stopping": int, "tuner_num_trials": int, "max_train_batch_size": int,
    "min_train_batch_size": int, "max_train_micro_batch_size_per_gpu": int,
    "min_train_micro_batch_size_per_gpu": int, "num_tuning_micro_batch_sizes": int, "mp_size": int,
    "results_dir": str, "exps_dir": str, "overwrite": bool, "arg_mappings": dict, "model_info": dict,
    "model_info_path": str, "metric_path": str,
}
"""The keys of DeepSpeed's autotuning section (deepspeed.autotuning.constants) with their types."""
METRICS = ("latency", "throughput", "flops")
TUNER_TYPES = ("gridsearch", "random", "model_based")
DEFAULT_RESULTS_DIR = "autotuning_results"
DEFAULT_EXPS_DIR = "autotuning_exps"
DEFAULT_END_PROFILE_STEP = 5
OPTIMAL_CONFIG = "ds_config_optimal.json"
"""What the autotuner writes in results_dir: the best experiment's DeepSpeed config (autotuning section removed)."""


def _section(args: NeoXArgsSchema) -> Dict[str, Any]:
    return dict(args.autotuning or {})


def autotuning_problems(args: NeoXArgsSchema) -> List[str]:
    """The autotuning dict's keys and values, and what a tuning launch needs of the rest of the config."""
    section = _section(args)
    problems = []
    for key, value in section.items():
        kind = AUTOTUNING_KEYS.get(key)
        if kind is None:
            problems.append(f"autotuning.{key} is not a key of DeepSpeed's autotuning section; known keys: "
                            f"{', '.join(sorted(AUTOTUNING_KEYS))}")
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            problems.append(f"autotuning.{key}={value!r} must be {kind.__name__}")
    if problems:
        return problems
    if section.get("metric", "throughput") not in METRICS:
        problems.append(f"autotuning.metric={section['metric']!r} must be one of {', '.join(METRICS)}")
    if section.get("tuner_type", "gridsearch") not in TUNER_TYPES:
        problems.append(f"autotuning.tuner_type={section['tuner_type']!r} must be one of {', '.join(TUNER_TYPES)}")
    start, end = section.get("start_profile_step", 3), section.get("end_profile_step", DEFAULT_END_PROFILE_STEP)
    if not 0 <= start < end:
        problems.append(f"autotuning.start_profile_step={start} and end_profile_step={end}: need 0 <= start < end "
                        f"(the experiment measures the steps between them, then exits)")
    if args.autotuning_run is None:
        if section.get("enabled", False):
            problems.append("autotuning.enabled=true only means something inside DeepSpeed's autotuning experiments "
                            "(the engine stops after end_profile_step); set autotuning_run: tune (or run, or deepy.py "
                            "--autotuning tune) to run the autotuner, or enabled: false to train normally")
        return problems
    if not section.get("enabled", False):
        problems.append(f"autotuning_run={args.autotuning_run!r} needs the autotuning dict with enabled: true (DeepSpeed's "
                        f"engine measures an experiment only then), e.g. autotuning: {{enabled: true, fast: true, "
                        f"max_train_micro_batch_size_per_gpu: 8}}")
    if args.pipe_parallel_size >= 1:
        problems.append(f"autotuning_run needs pipe_parallel_size: 0 (it is {args.pipe_parallel_size}): DeepSpeed's "
                        f"autotuner profiles the model with ZeRO stage 3 and explores stages 2 and 3, which DeepSpeed's "
                        f"pipeline engine refuses")
    if section.get("mp_size", args.model_parallel_size) != args.model_parallel_size:
        problems.append(f"autotuning.mp_size={section['mp_size']} must equal model_parallel_size="
                        f"{args.model_parallel_size} (the autotuner divides the world by it); leave it out")
    if args.rampup_batch_size:
        problems.append("autotuning_run with rampup_batch_size: the autotuner sets a fixed batch for each "
                        "experiment; tune without the ramp")
    if args.train_iters is not None and args.train_iters <= end:
        problems.append(f"autotuning.end_profile_step={end} must be < train_iters={args.train_iters}: each "
                        f"experiment trains until the step after end_profile_step, where DeepSpeed measures it")
    if args.moe_num_experts > 1:
        problems.append("autotuning_run with a mixture of experts (moe_num_experts > 1): DeepSpeed's autotuner profiles "
                        "the model with ZeRO stage 3, which DeepSpeed's MoE refuses")

    if multi_node_launch(args):
        problems.append("autotuning_run on several nodes, or through pdsh / MPI / slurm (force_multi, deepspeed_slurm, "
                        "deepspeed_mpi), is not supported yet: DeepSpeed's autotuner starts each experiment with its "
                        "own launcher and cleans up over pdsh (pkill -f on every host); it runs here on one node")
    return problems


def zero_stage_space_problems(zero_stage: Any, autotuning_run: Optional[str]) -> List[str]:
    """A zero_stage that is not one stage: a list of stages or 'all', the autotuner's search space."""
    if autotuning_run is None:
        return [f"zero_stage={zero_stage!r}: lists and 'all' are for DeepSpeed autotuning, the stages it searches; "
                f"set autotuning_run: tune (or run) to search them, or use one stage 0, 1, 2 or 3"]
    if zero_stage == "all" or (isinstance(zero_stage, list) and zero_stage
                               and all(s in (0, 1, 2, 3) and not isinstance(s, bool) for s in zero_stage)):
        return []
    return [f"zero_stage={zero_stage!r}: the stages the autotuner searches must be 'all' or a non-empty list of 0, 1, "
            f"2 and 3"]


def results_dir(args: NeoXArgsSchema) -> str:
    return _section(args).get("results_dir", DEFAULT_RESULTS_DIR)


def autotuner_config(args: NeoXArgsSchema) -> Dict[str, Any]:
    """The DeepSpeed config the autotuner reads: ours, with the user's ZeRO stage search space (a list or 'all'),
    the autotuning section (mp_size = model_parallel_size), and no train_batch_size (every experiment sets
    its micro batch and gradient accumulation; DeepSpeed's profile run sets only the micro batch)."""
    config = json.loads(json.dumps(args.deepspeed_config))
    config.pop("train_batch_size", None)
    config["autotuning"] = {**_section(args), "mp_size": args.model_parallel_size}
    return config


def measured_optimal_config(folder: str) -> Optional[Dict[str, Any]]:
    """results_dir/ds_config_optimal.json if an experiment with that config wrote its metrics, else None: DeepSpeed
    records an experiment that failed with the metric 0 and, when no experiment ran, writes that one as optimal."""
    try:
        with open(os.path.join(folder, OPTIMAL_CONFIG), encoding="utf-8") as handle:
            optimal = json.load(handle)
        entries = list(os.scandir(folder))
    except (OSError, ValueError):
        return None
    for entry in entries:
        config_path, metrics = os.path.join(entry.path, "ds_config.json"), os.path.join(entry.path, "metrics.json")
        if os.path.isfile(config_path) and os.path.isfile(metrics):
            with open(config_path, encoding="utf-8") as handle:
                config = json.load(handle)
            config.pop("autotuning", None)
            if config == optimal:
                return optimal
    return None


def runner_autotuning_argv(args: NeoXArgsSchema, runner_argv: List[str], config_path: str) -> List[str]:
    """The runner's argv for a tuning launch: `--autotuning tune` before the user script, `--deepspeed_config FILE`
    after it (where the autotuner looks for the config; it must end in .json). Always `tune`: deepy.py launches
    the `run` itself with the optimal config, since DeepSpeed would rerun the best experiment's command line,
    which still stops at end_profile_step."""
    script = runner_argv.index(args.user_script)
    return runner_argv[:script] + ["--autotuning", "tune"] + runner_argv[script:] + ["--deepspeed_config", config_path]
