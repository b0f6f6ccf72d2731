"""Processes that end with their parent (megatron.utils.process_tree), with real processes killed by SIGKILL."""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.launch import REPO

PARENT = """
import subprocess, sys, time
from megatron.utils.process_tree import children_end_with_this_process
child = {child!r}
if {wrap}:
    with children_end_with_this_process():
        process = subprocess.Popen([sys.executable, "-c", child])
else:
    process = subprocess.Popen([sys.executable, "-c", child])
print(process.pid, flush=True)
time.sleep(600)
"""
CHILD = "import time\n{setup}\ntime.sleep(600)\n"
ENDS_WITH_PARENT = "from megatron.utils.process_tree import end_with_parent\nend_with_parent()"


def _orphan_outlives(wrap: bool, setup: str, wait: float = 5.0) -> bool:
    """Start a parent that starts a child, kill -9 the parent: whether the child is still running ``wait`` s later."""
    code = PARENT.format(child=CHILD.format(setup=setup), wrap=wrap)
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.5)  # the child has set itself up
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.time() + wait
        while time.time() < deadline and _running(child):
            time.sleep(0.1)
        return _running(child)
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)  # the child this test started


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.attack("kill -9 of a launcher, to leave the processes it started running")
def test_a_child_started_inside_or_setting_it_itself_ends_with_its_killed_parent():
    assert _orphan_outlives(wrap=False, setup="", wait=1)  # the test can fail: a plain child outlives its parent
    assert not _orphan_outlives(wrap=True, setup="")  # deepy.py's way: its runner's child
    assert not _orphan_outlives(wrap=False, setup=ENDS_WITH_PARENT)  # a worker's way, against its launcher
