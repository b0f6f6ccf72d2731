"""One training run per save directory: the lock is exclusive, names its holder, and dies with its process."""

import os
import socket
import subprocess
import sys

import pytest

from megatron.errors import CheckpointError
from megatron.checkpoint.run_lock import LOCK_FILE, RunLock, lock_problem
from tests.e2e.launch import REPO


pytestmark = pytest.mark.fault


def test_a_second_lock_is_refused_naming_the_holder_until_the_first_is_released(tmp_path):
    first, second = RunLock(str(tmp_path / "ckpt")), RunLock(str(tmp_path / "ckpt"))
    assert first.acquire() is None and lock_problem(str(tmp_path / "ckpt")) is not None
    message = second.acquire()
    assert message.startswith(f"save='{tmp_path / 'ckpt'}' is in use by another training run (host "
                              f"{socket.gethostname()}, pid {os.getpid()}, since ")
    assert "Stop that run, or set save (and load) to another directory" in message
    first.release()
    assert lock_problem(str(tmp_path / "ckpt")) is None
    assert second.acquire() is None
    second.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; from megatron.checkpoint.run_lock import RunLock; "
                               f"assert RunLock({str(tmp_path)!r}).acquire() is None; print('held', flush=True); "
                               "time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    assert holder.stdout.readline().strip() == "held"
    assert f"pid {holder.pid}" in lock_problem(str(tmp_path))
    holder.kill()
    holder.wait()
    assert (tmp_path / LOCK_FILE).is_file() and lock_problem(str(tmp_path)) is None


@pytest.mark.attack("a training run started on a save directory another run holds")
def test_training_refuses_a_save_directory_in_use(tmp_path):
    from megatron.training.loop import _claim_save_directory
    from tests.checkpoint.test_engine import args_for

    held = RunLock(str(tmp_path))
    assert held.acquire() is None
    with pytest.raises(CheckpointError, match="is in use by another training run"):
        _claim_save_directory(args_for(tmp_path))
    held.release()
    lock = _claim_save_directory(args_for(tmp_path))
    assert lock_problem(str(tmp_path)) is not None
    lock.release()
