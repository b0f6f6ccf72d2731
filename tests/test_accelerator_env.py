"""Test processes get DeepSpeed's CPU accelerator only where there is no CUDA (tests.accelerator), and no test or
library file forces it otherwise."""

import os
import re

from tests.accelerator import deepspeed_accelerator_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORCED_CPU = re.compile(r"""DS_ACCELERATOR["']?\s*[,:=)]\s*["']cpu["']""")
"""DS_ACCELERATOR set to "cpu" in code: an environment dict entry, a keyword, setdefault / putenv arguments."""


def test_cpu_accelerator_only_where_there_is_no_cuda_unless_chosen():
    assert deepspeed_accelerator_env(has_cuda=False, environ={}) == {"DS_ACCELERATOR": "cpu"}
    assert deepspeed_accelerator_env(has_cuda=True, environ={}) == {}
    assert deepspeed_accelerator_env(has_cuda=True, environ={"DS_ACCELERATOR": "cuda"}) == {"DS_ACCELERATOR": "cuda"}


def test_nothing_else_forces_deepspeeds_cpu_accelerator():
    assert FORCED_CPU.search('os.environ.setdefault("DS_ACCELERATOR", "cpu")')
    assert FORCED_CPU.search('env = {"PYTHONPATH": REPO, "DS_ACCELERATOR": "cpu"}')
    assert FORCED_CPU.search('dict(os.environ, DS_ACCELERATOR="cpu")')
    offenders = []
    for top in ("tests", "megatron"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                path = os.path.join(root, name)
                if not name.endswith(".py") or path in (os.path.join(REPO, "tests", "accelerator.py"), __file__):
                    continue
                with open(path, encoding="utf-8") as f:
                    if FORCED_CPU.search(f.read()):
                        offenders.append(os.path.relpath(path, REPO))
    assert offenders == [], f"{offenders} force DeepSpeed's CPU accelerator: use tests.accelerator instead"
