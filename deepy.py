#!/usr/bin/env python
"""Launch a NeoX script on one or many machines through DeepSpeed's runner.

    python deepy.py train.py configs/125M.yml configs/local_setup.yml
    python deepy.py generate.py -d configs 125M.yml text_generation.yml -i prompts.txt -o samples.jsonl
    python deepy.py eval.py configs/125M.yml --eval_tasks lambada_openai
    python deepy.py train.py configs/125M.yml configs/local_setup.yml --set train_iters=100 \\
        --set optimizer.params.lr=3e-4

The YAML files are merged, validated and derived here, and the files, hosts and ports the workers will
need are checked (megatron/launch/prelaunch.py), before any process starts; every problem is
printed at once and the exit status is 2. The validated config travels to every worker encoded in one
environment variable, which the worker turns back into NeoXArgs with NeoXArgs.consume_neox_args().

DeepSpeed's runner and launcher are quiet unless --verbose is given; when a launch ends with anything but
success, the last line says how, in words (megatron/launch/outcome.py, which also lists the exit statuses)."""

import argparse
import logging
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from megatron.launch.autotuner import missing_packages
from megatron.launch.signals import ForwardSignals, interrupted_exit_code, killed_rank_message
from megatron.launch import prelaunch
from megatron.launch.outcome import latest_checkpoint, outcome_message, runner_log_level
from megatron.neox_arguments import NeoXArgs
from megatron.errors import ConfigError
from megatron.neox_arguments.hostfile import is_local_launch
from megatron.neox_arguments.launcher import (ENCODED_CONFIG_ENV, forward_variables_to_workers, multi_node_launch,
                                              worker_environment)
from megatron.neox_arguments.loading import resolve_config_paths
from megatron.neox_arguments.overrides import name_set_options
from megatron.utils.process_tree import children_end_with_this_process

TRAINING_SCRIPTS = ("train.py",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("user_script", help="the worker script to run: train.py, generate.py, eval.py or your own")
    parser.add_argument("conf_file", nargs="+",
                        help="YAML config files, merged; a key may be set in one file only; NAME means NAME.yml")
    parser.add_argument("-d", "--conf_dir", help="directory the config file names are relative to")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="set_options",
                        help="change one config value for this run, e.g. --set train_iters=100 --set "
                             "optimizer.params.lr=3e-4 (repeatable): KEY is any argument of "
                             "configs/neox_arguments.md, dots reach into a dict-valued one; VALUE is read as YAML "
                             "after 'KEY:'; checked like the files' values, and saved with the checkpoint's "
                             "configs as command_line_overrides.yml")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show DeepSpeed's runner and launcher log (the command line, the world info, each "
                             "process it starts); hidden by default")
    runner = parser.add_argument_group("launching (override the config)")
    runner.add_argument("-H", "--hostfile", help="MPI-style hostfile: one 'HOSTNAME slots=N' line per node "
                        "(default: the config's hostfile, DLTS_HOSTFILE, /job/hostfile)")
    runner.add_argument("--include", help="hosts/slots to use, e.g. 'worker-0@worker-1:0,2'")
    runner.add_argument("--exclude", help="hosts/slots to leave out, same format as --include")
    runner.add_argument("--num_nodes", type=int, help="use the first N hosts of the hostfile")
    runner.add_argument("--num_gpus", type=int,
                        help="GPUs per node; on a machine without GPUs, the number of CPU ranks to start")
    runner.add_argument("--master_port", type=int, help="torch.distributed port (one per concurrent launch)")
    runner.add_argument("--master_addr", help="address of rank 0's node")
    runner.add_argument("--launcher", choices=["pdsh", "openmpi", "mvapich", "slurm"], help="multi-node launcher")
    runner.add_argument("--autotuning", choices=["tune", "run"], dest="autotuning_run",
                        help="run DeepSpeed's autotuner (the config's autotuning dict); 'run' then trains with the "
                             "best configuration it found (overrides autotuning_run)")
    wandb = parser.add_argument_group("Weights & Biases")
    wandb.add_argument("--wandb_group", help="group the runs of one experiment")
    wandb.add_argument("--wandb_team", help="wandb team (entity)")
    wandb.add_argument("--wandb_run_name", help="name of this run")
    generation = parser.add_argument_group("generate.py")
    generation.add_argument("-i", "--sample_input_file", help="prompts, one per line")
    generation.add_argument("-o", "--sample_output_file", help="where to write the samples (JSONL)")
    evaluation = parser.add_argument_group("eval.py")
    evaluation.add_argument("--eval_tasks", nargs="+",
                            help="lm-evaluation-harness task names, or paths to local task YAML files / folders")
    evaluation.add_argument("--load", help="checkpoint directory to load instead of the config's load (e.g. the "
                                           "result of a fine-tuning run, evaluated with that run's config)")
    evaluation.add_argument("--iteration", type=int, help="checkpoint iteration to load")
    evaluation.add_argument("--eval_results_prefix", help="prefix of the results JSON file")
    return parser


OVERRIDE_KEYS = ("hostfile", "include", "exclude", "num_nodes", "num_gpus", "master_port", "master_addr", "launcher",
                 "autotuning_run",
                 "wandb_group", "wandb_team", "wandb_run_name", "sample_input_file", "sample_output_file",
                 "eval_tasks", "load", "iteration", "eval_results_prefix")


def _overrides(ns: argparse.Namespace, extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The config values the command line sets."""
    overrides: Dict[str, Any] = {k: getattr(ns, k) for k in OVERRIDE_KEYS if getattr(ns, k) is not None}
    overrides["user_script"] = ns.user_script
    if "hostfile" not in overrides and os.environ.get("DLTS_HOSTFILE"):  # GPT-NeoX's sbatch recipes export it
        overrides["hostfile"] = os.environ["DLTS_HOSTFILE"]
    overrides.update(extra or {})
    return overrides


def _build_args(ns: argparse.Namespace, extra: Optional[Dict[str, Any]] = None) -> NeoXArgs:
    return NeoXArgs.from_ymls(resolve_config_paths(ns.conf_file, ns.conf_dir), overwrite_values=_overrides(ns, extra),
                              set_options=ns.set_options)


def _script_problems(ns: argparse.Namespace, args: NeoXArgs) -> List[str]:
    problems = [] if os.path.isfile(ns.user_script) else [f"user script not found: {ns.user_script}"]
    if ns.user_script.startswith("-"):
        problems.append(f"user script {ns.user_script!r} begins with '-', which DeepSpeed's runner would read as an "
                        f"option; write ./{ns.user_script}")
    if os.path.basename(ns.user_script) in TRAINING_SCRIPTS:
        problems += args.training_problems()
    return problems


def load_args(argv: Optional[List[str]] = None) -> NeoXArgs:
    """Parse deepy.py's command line into validated NeoXArgs (raises ConfigError)."""
    ns = build_parser().parse_args(argv)
    args = _build_args(ns)
    problems = _script_problems(ns, args)
    if problems:
        raise ConfigError(name_set_options(problems, ns.set_options))
    return args


def launch_problems(args: NeoXArgs) -> List[str]:
    """What this machine can tell about the launch before any worker starts: files, optional packages, the
    device (megatron/launch/prelaunch.py), the autotuner's packages."""
    return (prelaunch.file_problems(args) + prelaunch.package_problems(args) + prelaunch.device_problems(args)
            + missing_packages(args))


def _config_and_file_problems(ns: argparse.Namespace, err: ConfigError) -> ConfigError:
    """A config that does not validate (``err``), with the launch_problems of the values the YAML gives
    (NeoXArgs.as_given), so that one round shows them all instead of one launch per kind."""
    try:
        given = NeoXArgs.as_given(resolve_config_paths(ns.conf_file, ns.conf_dir), _overrides(ns), ns.set_options)
    except ConfigError:  # the files themselves could not be read: err says so
        return err
    more = [p for p in launch_problems(given) if p not in err.problems]
    return ConfigError(err.problems + more) if more else err


def preflight(argv: Optional[List[str]] = None) -> Tuple[NeoXArgs, List[str], Optional[str]]:
    """The validated args, then everything prelaunch checks on this machine (files, packages, the device, hosts,
    master address and port), all problems raised together, with a config's problems too. Returns (args ready
    to launch, notes to print, finished-run message)."""
    ns = build_parser().parse_args(argv)
    try:
        args = _build_args(ns)
    except ConfigError as err:
        raise _config_and_file_problems(ns, err) from None
    problems = _script_problems(ns, args) + launch_problems(args) + prelaunch.host_problems(args)
    problems += prelaunch.memory_problems(args)
    master_addr, addr_problems = prelaunch.resolve_master_addr(args)
    problems += addr_problems + prelaunch.shell_problems(args, master_addr)
    if problems:
        raise ConfigError(name_set_options(problems, ns.set_options))
    notes: List[str] = [args.precision_choice] if args.precision_choice else []
    extra: Dict[str, Any] = {}
    if master_addr and master_addr != args.master_addr:
        extra["master_addr"] = master_addr
    port, note = prelaunch.master_port_note(args, master_addr)
    if port is not None:
        extra["master_port"] = port
        notes.append(note)
    if extra:
        if args.precision_choice:  # decided once: the rebuilt arguments keep this probe's choice
            extra["precision"] = args.precision
        args = _build_args(ns, extra)
    return args, notes, prelaunch.finished_run_message(args)


def _cap_cpu_threads(args: NeoXArgs) -> None:
    """CPU ranks on one machine share its cores; without a cap each rank starts one thread per core
    and they slow each other down (measured 10x on 2 cores). Several nodes: their cores are not known
    here; OMP_NUM_THREADS, when set, is forwarded to them."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if torch.cuda.is_available() or not is_local_launch(args.hostfile) or multi_node_launch(args):
        return
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(args.global_num_gpus or 1, 1)))


class _AbbreviateEncodedConfig(logging.Filter):
    """DeepSpeed's runner logs the command it starts; for pdsh / MPI / slurm that command exports the encoded
    config (~5 KB), which says nothing to a reader: shown as its size."""

    def __init__(self, encoded: str) -> None:
        super().__init__()
        self.encoded = encoded

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.encoded in message:
            record.msg = message.replace(self.encoded, f"<config, {len(self.encoded)} bytes>")
            record.args = ()
        return True


def _cpu_accelerator_for_local_ranks(args: NeoXArgs, has_cuda: bool) -> None:
    """On a machine without CUDA whose ranks all run here, DeepSpeed falls back to its CPU accelerator in every
    process it is imported in, each saying so in a warning ("Setting accelerator to CPU..."); naming it in
    DS_ACCELERATOR is the same choice, made once. Left alone when set, when CUDA is here, and for several nodes
    (this machine's hardware says nothing about theirs)."""
    if "DS_ACCELERATOR" in os.environ or has_cuda or not is_local_launch(args.hostfile) or multi_node_launch(args):
        return
    os.environ["DS_ACCELERATOR"] = "cpu"


def launch(args: NeoXArgs, verbose: bool = False) -> int:
    """Hand the validated args to DeepSpeed's runner (which starts the workers and waits for them); with
    autotuning_run, to DeepSpeed's autotuner first (autotune). ``verbose``: DeepSpeed's runner and launcher log
    at their own level (info) instead of only critical errors. A launch that does not finish says how it ended
    in one line (megatron.launch.outcome)."""
    import torch

    has_cuda = torch.cuda.is_available()
    _cap_cpu_threads(args)
    _cpu_accelerator_for_local_ranks(args, has_cuda)
    warning = prelaunch.cpu_oversubscription_warning(args, has_cuda)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    note = prelaunch.cpu_backend_note(args, has_cuda)
    if note:
        print(f"note: {note}", file=sys.stderr)
    if args.autotuning_run is not None:
        return autotune(args, verbose)
    before = latest_checkpoint(args)
    forwarding = ForwardSignals()
    code = _run_runner(args, runner_log_level(verbose) + args.get_deepspeed_main_args(), forwarding)
    message = outcome_message(args, code, forwarding.received, before)
    if message:
        print(message, file=sys.stderr, flush=True)
    return code


def autotune(args: NeoXArgs, verbose: bool = False) -> int:
    """Run DeepSpeed's autotuner over the config's search space (megatron/neox_arguments/autotuning.py); with
    autotuning_run 'run', then train with the optimal DeepSpeed config it wrote. The tuning logs at DeepSpeed's
    level (its experiments and their results are what was asked for); the training run after it as launch's."""
    import json
    import tempfile

    import torch

    from megatron.launch.autotuner import AutotuningSignals, local_autotuner
    from megatron.neox_arguments.autotuned import tuned_args
    from megatron.neox_arguments.autotuning import (OPTIMAL_CONFIG, autotuner_config, measured_optimal_config,
                                                    results_dir, runner_autotuning_argv)

    with tempfile.TemporaryDirectory(prefix="neox-autotuning-") as folder:
        path = os.path.join(folder, "ds_config.json")  # read once, when the autotuner starts
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(autotuner_config(args), handle)
        signals = AutotuningSignals()
        with local_autotuner(args, cuda=torch.cuda.is_available(), stopped=lambda: signals.received is not None):
            code = _run_runner(args, runner_autotuning_argv(args, args.get_deepspeed_main_args(), path), signals)
    if code:
        return code
    optimal = measured_optimal_config(results_dir(args))
    if optimal is None:
        print(f"error: DeepSpeed's autotuner found no configuration that trained; each experiment's output is in "
              f"{results_dir(args)}/<experiment>/stderr.log and stdout.log", file=sys.stderr)
        return 1
    print(f"autotuning: the optimal DeepSpeed config is {os.path.join(results_dir(args), OPTIMAL_CONFIG)} (results "
          f"in {results_dir(args)}/summary.txt)", flush=True)
    if args.autotuning_run == "tune":
        return 0
    try:
        tuned = tuned_args(args, optimal, experiment=False).freeze()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    return _run_runner(tuned, runner_log_level(verbose) + tuned.get_deepspeed_main_args())


def _run_runner(args: NeoXArgs, argv: List[str], forwarding: Optional[ForwardSignals] = None) -> int:
    """DeepSpeed's runner with `argv`, the encoded `args` in the workers' environment, signals forwarded (by
    `forwarding`, default ForwardSignals: to the ranks of a local launch)."""
    from deepspeed.launcher import runner
    from deepspeed.utils import logger as deepspeed_logger

    environment = worker_environment(args)
    os.environ.update(environment)
    forward_variables_to_workers()
    abbreviate = _AbbreviateEncodedConfig(environment[ENCODED_CONFIG_ENV])
    deepspeed_logger.addFilter(abbreviate)
    forwarding = (forwarding or ForwardSignals()).install()
    try:
        with children_end_with_this_process():  # kill -9 of deepy.py: the launcher and the ranks end too
            runner.main(argv)
    except (RuntimeError, ValueError) as exc:  # the runner's own refusals, before any worker starts
        print(f"error: DeepSpeed's runner did not start the workers: {exc}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # the runner passes on a failed launcher's status
        code = stop.code if isinstance(stop.code, int) else 1
    else:
        code = 0
    finally:
        forwarding.restore()
        deepspeed_logger.removeFilter(abbreviate)
    if forwarding.received:  # a rank signalled early has no own code; ranks that had just finished exit 0
        return interrupted_exit_code(forwarding.received)
    killed = killed_rank_message(code)
    if killed is not None:  # exit 1, as a surviving rank does when it finds its peer gone
        print(f"error: {killed}", file=sys.stderr, flush=True)
        return 1
    return code


def main(argv: Optional[List[str]] = None) -> int:
    try:
        args, notes, finished = preflight(argv)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if finished:
        print(finished, file=sys.stderr)
        return 0
    return launch(args, verbose=build_parser().parse_args(argv).verbose)


if __name__ == "__main__":
    sys.exit(main())
