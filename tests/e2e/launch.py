"""Running deepy.py as a user would, in a subprocess, from the repository root."""

import os
import random
import socket
import subprocess
import sys
from typing import Dict, List, Optional

from tests.accelerator import deepspeed_accelerator_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below Linux's ephemeral range (32768-60999): a port the kernel hands out
    for bind(0) can be taken a moment later by one of the many outgoing connections of the gloo ranks that run
    beside it (seen: "rank 0 cannot listen on 127.0.0.1:33213"); ports below that range are only ever taken by
    another listener."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free TCP port between 20000 and 32000 on 127.0.0.1")


def deepy_environment(extra_env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **deepspeed_accelerator_env(), "OMP_NUM_THREADS": "1", **(extra_env or {})}


def run_deepy(args: List[str], extra_env: Optional[Dict[str, str]] = None, timeout: int = 600):
    return subprocess.run([sys.executable, "deepy.py", *args], cwd=REPO, env=deepy_environment(extra_env),
                          capture_output=True, text=True, timeout=timeout)
