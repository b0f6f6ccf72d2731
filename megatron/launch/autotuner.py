"""Running DeepSpeed's autotuner from deepy.py on one node, CPU ranks included (config side:
megatron/neox_arguments/autotuning.py).

DeepSpeed's runner, given `--autotuning tune`, builds deepspeed.autotuning.Autotuner in this process, which
launches every experiment with `deepspeed --include localhost:SLOTS ...`. `local_autotuner` starts it with these
adjustments, all undone on exit (DeepSpeed's installed files are not touched):

* CPU slots: DeepSpeed's CPU accelerator counts one device per NUMA node unless LOCAL_SIZE says otherwise (its
  launcher sets LOCAL_SIZE in every worker), and the autotuner offers experiments only that many slots, so an
  experiment with 2 CPU ranks would be refused. Without CUDA, LOCAL_SIZE is set to the ranks the config asks for.
* cleanup: after each experiment DeepSpeed runs `pdsh -w HOSTS pkill -f EXPERIMENT_NAME`, which needs pdsh and
  ssh and would, on a shared machine, kill any process whose command line contains the name (another user's
  experiment z0_gas1_tmbspg1). On one node the experiment's launcher has already waited for all of its ranks
  when the cleanup runs, so nothing is left to kill and the cleanup is skipped (autotuning_run is refused for
  several nodes).
* polling: the resource manager looks at its experiments every 5 s; here every second (a tuning of N experiments
  would otherwise idle about 5 N seconds).
* signals: SIGTERM / SIGINT to deepy.py reach the ranks of the running experiment (`AutotuningSignals`; the
  experiment's own `deepspeed` runner has no handler and would die leaving them orphaned), and no further
  experiment starts; deepy.py then exits 128 + the signal without the `run`.
* activation memory: the profile run measures one micro batch's activation memory as the growth of the
  accelerator's allocated memory during the forward; on CPU that is the process's RSS, which for a small model
  often does not grow at all (the allocator reuses freed pages). The autotuner divides by it, so a measurement
  <= 0 is replaced by the usual estimate for a transformer (Korthikanti et al. 2022: per layer
  seq x hidden x (34 + 5 heads seq / hidden) bytes in 16 bits, twice that in fp32). On CPU the memory it compares
  against is the machine's RAM: bound the search with autotuning.max_train_micro_batch_size_per_gpu."""

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import psutil

from megatron.launch.signals import ForwardSignals, signal_targets
from megatron.neox_arguments.groups import NeoXArgsSchema

POLL_SECONDS = 1


def missing_packages(args: NeoXArgsSchema) -> List[str]:
    """What the autotuner imports in deepy.py's process and is not installed (checked before launch)."""
    if args.autotuning_run is None:
        return []
    problems = []
    try:
        import tabulate  # noqa: F401  (DeepSpeed's Autotuner asserts it)
    except ImportError:
        problems.append("autotuning_run needs the Python package 'tabulate' (DeepSpeed's autotuning extra): "
                        "pip install -r requirements/requirements-autotuning.txt")
    section = args.autotuning or {}
    if section.get("tuner_type") == "model_based" and not section.get("fast", True):
        try:
            import xgboost  # noqa: F401
        except ImportError:
            problems.append("autotuning.tuner_type='model_based' needs the Python package 'xgboost' (DeepSpeed's "
                            "autotuning_ml extra): pip install xgboost, or use tuner_type gridsearch or random")
    return problems


def activation_bytes_per_sample(args: NeoXArgsSchema) -> int:
    """Activation memory of one sample (Korthikanti et al. 2022, no recomputation), at the config's precision."""
    seq, hidden, heads = args.seq_length, args.hidden_size, args.num_attention_heads
    per_layer_16bit = seq * hidden * (34 + 5 * heads * seq / hidden)
    width = 2 if args.precision == "fp32" else 1
    return int(args.num_layers * per_layer_16bit * width / max(args.model_parallel_size, 1))


def with_activation_estimate(model_info: Optional[Dict[str, Any]], args: NeoXArgsSchema) -> Optional[Dict[str, Any]]:
    """The profile run's model info, with the estimate where the measured activation memory is not positive."""
    if model_info is None or (model_info.get("activation_mem_per_gpu") or 0) > 0:
        return model_info
    return {**model_info, "activation_mem_per_gpu": activation_bytes_per_sample(args)}


def _skip_local_cleanup(exp: Dict[str, Any], reservations: Any) -> None:
    """DeepSpeed's clean_up, on one node: the experiment's launcher has already waited for its ranks."""


class AutotuningSignals(ForwardSignals):
    """ForwardSignals for a tuning: the ranks are two levels down (deepy.py -> each experiment's `deepspeed`
    runner -> DeepSpeed's launcher -> ranks). With no experiment running, the signal ends deepy.py."""

    def targets(self) -> List[Any]:

        return [rank for runner in psutil.Process().children() for rank in signal_targets(runner.pid)]


@contextlib.contextmanager
def local_autotuner(args: NeoXArgsSchema, cuda: bool, stopped: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """DeepSpeed's runner, for the duration, builds an autotuner adjusted as the module docstring says; once
    `stopped()` is true, no further experiment is launched."""
    from deepspeed.autotuning import scheduler
    from deepspeed.autotuning.autotuner import Autotuner
    from deepspeed.launcher import runner

    class NeoXAutotuner(Autotuner):
        def model_info_profile_run(self):  # noqa: D102 (DeepSpeed's)
            return with_activation_estimate(super().model_info_profile_run(), args)

    launch_experiment = scheduler.run_experiment

    def run_unless_stopped(exp: Dict[str, Any], reservations: Any, user_script: str, user_args: List[str]) -> None:
        if not stopped():  # else the autotuner finds no stderr.log and counts the experiment as failed
            launch_experiment(exp, reservations, user_script, user_args)

    saved = (runner.Autotuner, scheduler.clean_up, scheduler.TIMEOUT, scheduler.run_experiment,
             os.environ.get("LOCAL_SIZE"))
    runner.Autotuner, scheduler.clean_up, scheduler.TIMEOUT = NeoXAutotuner, _skip_local_cleanup, POLL_SECONDS
    scheduler.run_experiment = run_unless_stopped
    if not cuda and args.global_num_gpus:
        os.environ["LOCAL_SIZE"] = str(args.global_num_gpus)
    try:
        yield
    finally:
        runner.Autotuner, scheduler.clean_up, scheduler.TIMEOUT, scheduler.run_experiment = saved[:4]
        if saved[4] is None:
            os.environ.pop("LOCAL_SIZE", None)
        else:
            os.environ["LOCAL_SIZE"] = saved[4]


