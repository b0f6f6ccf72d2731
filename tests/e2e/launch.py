"""Running deepy.py as a user would, in a subprocess, from the repository root."""

import os
import socket
import subprocess
import sys
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepy_environment(extra_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(extra_env or {})}


def run_deepy(args: List[str], extra_env: Optional[Dict[str, str]] = None, timeout: int = 600):
    return subprocess.run([sys.executable, "deepy.py", *args], cwd=REPO, env=deepy_environment(extra_env),
                          capture_output=True, text=True, timeout=timeout)
