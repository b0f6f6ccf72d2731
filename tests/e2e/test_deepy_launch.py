"""deepy.py launches the real DeepSpeed runner, and every rank rebuilds identical NeoXArgs."""

import json
import re

import pytest

from megatron.neox_arguments import NeoXArgs
from tests.e2e.launch import free_port, run_deepy

CONFIG = """{
  "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
  "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
  "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
  "zero_optimization": {"stage": 1},
  "num_gpus": 2,
}
"""


@pytest.mark.slow
def test_two_cpu_ranks_rebuild_identical_args(tmp_path):
    config = tmp_path / "tiny.yml"
    config.write_text(CONFIG)
    port = free_port()
    result = run_deepy(["tests/e2e/workers/dump_args.py", str(config), "--master_port", str(port)],
                       extra_env={"NEOX_TEST_OUT": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    # the encoded config (~5 KB) travels in the environment and is echoed nowhere
    assert not re.search(r"[A-Za-z0-9_=-]{1000,}", result.stdout + result.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r.pop("rank") for r in ranks] == [0, 1]
    assert [r.pop("local_rank") for r in ranks] == [0, 1]
    assert [r.pop("world_size") for r in ranks] == [2, 2]
    assert ranks[0] == ranks[1]
    expected = NeoXArgs.from_ymls([str(config)], overwrite_values={
        "master_port": port, "user_script": "tests/e2e/workers/dump_args.py"}).to_dict()
    for key in ("rank", "local_rank", "world_size"):
        expected.pop(key)
    assert json.loads(json.dumps(expected, sort_keys=True)) == ranks[0]
    assert ranks[0]["train_batch_size"] == 8 and ranks[0]["data_parallel_size"] == 2


def test_bad_config_exits_nonzero_with_every_message_and_no_traceback(tmp_path):
    config = tmp_path / "bad.yml"
    config.write_text("{num_layers: 2, hidden_size: 66, num_attention_heads: 4, seq_length: 32,\n"
                      " train_micro_batch_size_per_gpu: 2, num_layer: 3, norm: batchnorm}\n")
    result = run_deepy(["tests/e2e/workers/dump_args.py", str(config)])
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for needle in ("unknown argument 'num_layer'", "did you mean 'num_layers'", "norm='batchnorm'"):
        assert needle in result.stderr


def test_help_explains_usage():
    result = run_deepy(["--help"])
    assert result.returncode == 0
    assert "user_script" in result.stdout and "--hostfile" in result.stdout and "--num_gpus" in result.stdout
    assert "--verbose" in result.stdout


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.attack("kill -9 of deepy.py, to leave DeepSpeed's launcher and the ranks running and holding the lock")
def test_kill_9_of_deepy_leaves_no_launcher_no_rank_and_no_lock(tmp_path):
    """deepy.py killed by SIGKILL cannot pass anything on: the kernel signals its child (DeepSpeed's launcher) and
    the ranks signal themselves when their parent ends (PR_SET_PDEATHSIG, megatron.utils.process_tree); all end,
    and the save directory's lock is free for the relaunch. Real processes: deepy.py, the runner, the launcher and
    two ranks of an idle worker."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from megatron.checkpoint.run_lock import lock_problem
    from tests.e2e.launch import REPO, deepy_environment

    save = tmp_path / "save"
    config = tmp_path / "tiny.yml"
    config.write_text(CONFIG.replace('"num_gpus": 2,', f'"num_gpus": 2, "save": "{save}",'))
    deepy = subprocess.Popen([sys.executable, "deepy.py", "tests/e2e/workers/idle.py", str(config), "--master_port",
                              str(free_port())], cwd=REPO, env=deepy_environment({"NEOX_TEST_OUT": str(tmp_path)}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not all((tmp_path / f"rank{r}.pid").is_file() for r in (0, 1)):
            assert deepy.poll() is None, "deepy.py ended before its ranks started"
            time.sleep(0.2)
        ranks = [tuple(map(int, (tmp_path / f"rank{r}.pid").read_text().split())) for r in (0, 1)]
        launcher = ranks[0][1]
        pids = [launcher, *(pid for pid, _ in ranks)]
        assert all(map(_alive, pids)) and lock_problem(str(save)) is not None
        deepy.send_signal(signal.SIGKILL)
        deepy.wait()
        deadline = time.time() + 60
        while time.time() < deadline and any(map(_alive, pids)):
            time.sleep(0.2)
        left = [pid for pid in pids if _alive(pid)]
        assert not left, f"left running after kill -9 of deepy.py: {left} (launcher {launcher})"
        assert lock_problem(str(save)) is None
    finally:
        for pid in pids:  # the processes this test started, if the assertion above failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if deepy.poll() is None:
            deepy.kill()


@pytest.mark.slow
def test_a_failing_worker_shows_its_traceback_and_deepy_names_its_status(tmp_path):
    """DeepSpeed's launcher is quiet by default (issue 31), the worker's own traceback is not: it is the workers'
    stderr, which the runner never touches. deepy.py's last line says the launch failed, with the status."""
    config = tmp_path / "tiny.yml"
    config.write_text(CONFIG.replace('"num_gpus": 2', '"num_gpus": 1'))
    script = tmp_path / "broken_worker.py"
    script.write_text("print('worker started', flush=True)\nraise ValueError('the worker broke')\n")
    result = run_deepy([str(script), str(config), "--master_port", str(free_port())])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "worker started" in result.stdout
    assert "Traceback" in result.stderr and "ValueError: the worker broke" in result.stderr
    assert result.stderr.rstrip().splitlines()[-1] == \
        "deepy.py: broken_worker.py failed: a rank exited with status 1 (its error is printed above)"
    assert "exits with return code" not in result.stderr + result.stdout and "[INFO]" not in result.stdout
