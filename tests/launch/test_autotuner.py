"""The adjustments under which deepy.py runs DeepSpeed's autotuner on one node (megatron/launch/autotuner.py)."""

import os

import pytest

from megatron.launch.autotuner import activation_bytes_per_sample, local_autotuner, with_activation_estimate
from tests.neox_arguments.helpers import tiny

TUNE = {"autotuning_run": "tune", "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2}, "pipe_parallel_size": 0,
        "zero_optimization": {"stage": [0, 1]}, "num_gpus": 2, "train_iters": 10}


def test_activation_estimate_follows_the_transformer_formula():
    args = tiny(**TUNE)  # 2 layers, seq 32, hidden 64, 4 heads, fp32
    per_layer_16bit = 32 * 64 * (34 + 5 * 4 * 32 / 64)
    assert activation_bytes_per_sample(args) == 2 * per_layer_16bit * 2
    assert activation_bytes_per_sample(tiny(**TUNE, precision="bfloat16")) == 2 * per_layer_16bit


@pytest.mark.parametrize("measured,expected", [(None, "estimate"), (0, "estimate"), (-4096, "estimate"),
                                               (123, 123)])
def test_the_profile_runs_measurement_is_kept_unless_it_cannot_be_divided_by(measured, expected):
    args = tiny(**TUNE)
    info = {"num_params": 10} if measured is None else {"num_params": 10, "activation_mem_per_gpu": measured}
    result = with_activation_estimate(info, args)
    assert result["activation_mem_per_gpu"] == (activation_bytes_per_sample(args) if expected == "estimate"
                                                 else expected)
    assert result["num_params"] == 10 and with_activation_estimate(None, args) is None


def test_local_autotuner_offers_a_slot_per_cpu_rank_skips_pdsh_and_restores_deepspeed(monkeypatch):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.autotuning import scheduler
    from deepspeed.autotuning.autotuner import Autotuner
    from deepspeed.launcher import runner

    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setattr(Autotuner, "model_info_profile_run", lambda self: {"num_params": 7})
    before = (runner.Autotuner, scheduler.clean_up, scheduler.TIMEOUT)
    args = tiny(**TUNE)
    with local_autotuner(args, cuda=False):
        assert os.environ["LOCAL_SIZE"] == "2" and get_accelerator().device_count() == 2
        assert issubclass(runner.Autotuner, Autotuner) and runner.Autotuner is not Autotuner
        tuner = object.__new__(runner.Autotuner)
        assert tuner.model_info_profile_run()["activation_mem_per_gpu"] == activation_bytes_per_sample(args)
        assert scheduler.clean_up({"exp_id": 0, "name": "z0_gas1_tmbspg1"}, []) is None  # no pdsh, no pkill
        assert scheduler.TIMEOUT == 1
    assert (runner.Autotuner, scheduler.clean_up, scheduler.TIMEOUT) == before
    assert "LOCAL_SIZE" not in os.environ
    monkeypatch.setenv("LOCAL_SIZE", "5")
    with local_autotuner(args, cuda=True):  # GPUs: DeepSpeed counts them itself
        assert os.environ["LOCAL_SIZE"] == "5"
    assert os.environ["LOCAL_SIZE"] == "5"


def test_packages_the_autotuner_imports_are_checked_before_launch(monkeypatch):
    import sys

    from megatron.launch.autotuner import missing_packages

    assert missing_packages(tiny(**TUNE)) == [] and missing_packages(tiny()) == []
    monkeypatch.setitem(sys.modules, "tabulate", None)
    monkeypatch.setitem(sys.modules, "xgboost", None)
    model_based = {**TUNE, "autotuning": {**TUNE["autotuning"], "fast": False, "tuner_type": "model_based"}}
    problems = missing_packages(tiny(**model_based))
    assert "requirements/requirements-autotuning.txt" in problems[0] and "'xgboost'" in problems[1]
    assert len(missing_packages(tiny(**TUNE))) == 1  # fast mode tunes micro batches only: no model-based tuner


def test_train_py_ends_an_autotuning_experiment_that_deepspeed_exits_with_status_0(monkeypatch):
    """DeepSpeed's engine calls exit() after end_profile_step; train.py passes on any other exit."""
    import base64
    import json

    import megatron.training.loop
    import train
    from megatron.neox_arguments.autotuning import autotuner_config

    args = tiny(**TUNE, user_script="train.py", data_path="data",
                optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    experiment = {**autotuner_config(args), "zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 1}
    encoded = base64.urlsafe_b64encode(json.dumps(experiment).encode()).decode()
    monkeypatch.setattr("sys.argv", ["train.py", "--local_rank=0", "--deepspeed_config", encoded])
    for name, value in {"NEOX_ENCODED_CONFIG": args.encode(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    seen = []

    def engine_exits(neox_args, code=None):
        seen.append((neox_args.zero_stage, neox_args.train_batch_size))
        raise SystemExit(code)

    monkeypatch.setattr(megatron.training.loop, "pretrain", engine_exits)
    assert train.main() == 0 and seen == [(1, 2)]
    monkeypatch.setattr(megatron.training.loop, "pretrain", lambda neox_args: engine_exits(neox_args, 3))
    with pytest.raises(SystemExit):
        train.main()


def test_after_a_signal_no_further_experiment_starts(monkeypatch):
    from deepspeed.autotuning import scheduler

    launched = []
    monkeypatch.setattr(scheduler, "run_experiment", lambda exp, *rest: launched.append(exp["name"]))
    stop = []
    with local_autotuner(tiny(**TUNE), cuda=False, stopped=lambda: bool(stop)):
        scheduler.run_experiment({"name": "z0_gas1_tmbspg1"}, [], "train.py", [])
        stop.append("SIGTERM")
        scheduler.run_experiment({"name": "z0_gas1_tmbspg2"}, [], "train.py", [])
    assert launched == ["z0_gas1_tmbspg1"]


def test_signals_reach_the_ranks_under_each_experiments_runner():
    """deepy.py -> the experiment's `deepspeed` runner -> DeepSpeed's launcher -> ranks: the ranks get the signal
    (the runner itself would die of it, leaving them orphaned)."""
    import subprocess
    import sys
    import time

    import psutil

    from megatron.launch.autotuner import AutotuningSignals

    # a stand-in runner whose child carries the launcher's module name on its command line and starts one "rank"
    launcher = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                "time.sleep(60)")
    runner = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               f"'-c', {launcher!r}, 'deepspeed.launcher.launch']); time.sleep(60)"])
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(psutil.Process(runner.pid).children(recursive=True)) < 2:
            time.sleep(0.1)
        launch = psutil.Process(runner.pid).children()[0]
        assert [p.pid for p in AutotuningSignals().targets()] == [p.pid for p in launch.children()]
        assert len(launch.children()) == 1
    finally:
        for process in psutil.Process(runner.pid).children(recursive=True) + [psutil.Process(runner.pid)]:
            process.kill()
        runner.wait()


@pytest.mark.parametrize("mode", ["tune", "run", "nothing_trained"])
def test_deepy_autotune_hands_the_search_space_to_the_runner_then_trains_with_what_was_measured(tmp_path, monkeypatch,
                                                                                                mode):
    """deepy.autotune with DeepSpeed's runner replaced by what the autotuner leaves in results_dir."""
    import json
    from pathlib import Path

    import deepy

    results = tmp_path / "results"
    args = tiny(**{**TUNE, "autotuning_run": "run" if mode == "run" else "tune", "user_script": "train.py",
                   "autotuning": {**TUNE["autotuning"], "results_dir": str(results)}}).freeze()
    optimal = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1}}
    launches = []

    def runner(launched_args, argv, forwarding=None):
        launches.append((launched_args, argv))
        if len(launches) == 1:  # the tuning: DeepSpeed's autotuner reads the config file named after the script
            config = json.loads(Path(argv[argv.index("--deepspeed_config") + 1]).read_text())
            assert argv[argv.index("train.py") - 2:argv.index("train.py")] == ["--autotuning", "tune"]
            assert config["zero_optimization"]["stage"] == [0, 1] and "train_batch_size" not in config
            (results / "z1_gas1_tmbspg2").mkdir(parents=True)
            (results / "ds_config_optimal.json").write_text(json.dumps(optimal))
            (results / "z1_gas1_tmbspg2" / "ds_config.json").write_text(json.dumps({**optimal, "autotuning": {}}))
            if mode != "nothing_trained":
                (results / "z1_gas1_tmbspg2" / "metrics.json").write_text('{"throughput": 2.0}')
        return 0

    monkeypatch.setattr(deepy, "_run_runner", runner)
    assert deepy.autotune(args) == (1 if mode == "nothing_trained" else 0)
    assert len(launches) == (2 if mode == "run" else 1)
    if mode == "run":
        tuned, argv = launches[1]
        assert "--autotuning" not in argv and "--deepspeed_config" not in argv
        assert (tuned.autotuning_run, tuned.zero_stage, tuned.train_batch_size) == (None, 1, 4)
