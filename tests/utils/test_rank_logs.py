"""Per-rank log files in log_dir: each rank's stdout and stderr, DeepSpeed's logger included, console unchanged."""

import socket
import subprocess
import sys

from tests.accelerator import deepspeed_accelerator_env
from tests.e2e.launch import REPO

SCRIPT = """
import sys
from deepspeed.utils import logger
from megatron.utils.rank_logs import tee_rank_output
print("before")
tee_rank_output(sys.argv[1], 3)
tee_rank_output(sys.argv[1], 3)  # once only
print("to stdout")
print("to stderr", file=sys.stderr)
logger.warning("from deepspeed")
"""


def test_each_rank_writes_its_own_stdout_and_stderr_files(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "logs")], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": REPO, "PATH": "", **deepspeed_accelerator_env()})
    assert result.returncode == 0, result.stderr
    stem = tmp_path / "logs" / f"{socket.gethostname()}_rank3"
    out = (stem.parent / f"{stem.name}_stdout.txt").read_text()
    err = (stem.parent / f"{stem.name}_stderr.txt").read_text()
    assert out.startswith("to stdout\n") and "before" not in out and out.count("to stdout") == 1
    assert "from deepspeed" in out  # DeepSpeed's logger writes to stdout
    assert err == "to stderr\n"
    assert "before\nto stdout\n" in result.stdout and "from deepspeed" in result.stdout
    assert "to stderr" in result.stderr
