"""DeepSpeed carried to a GPU machine as wheels (bench/gpu_check.py).

A lent GPU machine has its own torch and Triton but no DeepSpeed and no network. So, on the CPU machine,
``prepare`` fills a git-ignored folder (.whl/ by default, ~6 MB) with the DeepSpeed wheel (pure Python: its ops
JIT-build with nvcc where they run) and its dependencies, as wheels for Python 3.12 on manylinux x86_64 (the GPU
machine's); pip resolves them through this machine's pip configuration (`pip config list`: local mirrors).
On the GPU machine ``install_missing`` unpacks, with pip --target into a temporary folder, DeepSpeed and those
dependencies whose modules do not import there (the machine's own versions win); the caller puts the folder on
PYTHONPATH (and its bin/ on PATH) of what it starts."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from typing import Dict, List, Optional

DEEPSPEED = "deepspeed==0.19.8"
# DeepSpeed 0.19.8's requirements that a bare torch environment may lack (pydantic-core pinned to the pydantic)
DEPENDENCIES = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types", "typing-inspection",
                "typing-extensions>=4.16", "hjson", "einops", "msgpack", "py-cpuinfo", "ninja", "psutil"]
GPU_PYTHON = "3.12"
GPU_PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64"]


def prepare(directory: str) -> int:
    """Download the wheels into `directory` (run on the CPU machine); returns pip's exit status."""
    os.makedirs(directory, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    print("pip configuration here (`pip config list`):", flush=True)
    subprocess.run(pip + ["config", "list"], check=False)
    steps = [pip + ["wheel", "--no-deps", "-q", "-w", directory, DEEPSPEED],
             pip + ["download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", GPU_PYTHON,
                    *[arg for platform in GPU_PLATFORMS for arg in ("--platform", platform)], "-d", directory,
                    *DEPENDENCIES]]
    for step in steps:
        print("$", " ".join(step), flush=True)
        status = subprocess.run(step, check=False).returncode
        if status != 0:
            print(f"--prepare-wheels: pip failed (exit {status}); see its message above", flush=True)
            return status
    wheels = sorted(name for name in os.listdir(directory) if name.endswith(".whl"))
    total = sum(os.path.getsize(os.path.join(directory, name)) for name in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {directory}:\n  " + "\n  ".join(wheels), flush=True)
    return 0


def wheel_modules(path: str) -> List[str]:
    """The top-level modules a wheel installs (its top-level folders and .py / extension files)."""
    tops = {name.split("/")[0] for name in zipfile.ZipFile(path).namelist()}
    return sorted({top.split(".")[0] for top in tops if not top.endswith((".dist-info", ".data"))})


def deepspeed_imports(env: Optional[Dict[str, str]] = None) -> bool:
    """Whether `import deepspeed` works in a fresh interpreter with `env`."""
    return subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True,
                          check=False).returncode == 0


def wheels_to_install(directory: str, importable=lambda module: importlib.util.find_spec(module) is not None) \
        -> List[str]:
    """DeepSpeed's wheel and every other wheel in `directory` one of whose modules is not `importable`."""
    chosen = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(".whl") and (name.startswith("deepspeed-") or
                                      not all(importable(m) for m in wheel_modules(path))):
            chosen.append(path)
    return chosen


def install_missing(directory: str, target: str) -> List[str]:
    """Install into `target` what `wheels_to_install` picks (pip --target, no index; a plain unzip where pip is
    missing); returns the wheel file names installed."""
    wheels = wheels_to_install(directory)
    if not wheels:
        return []
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target, *wheels]
    if subprocess.run(pip, capture_output=True, check=False).returncode != 0:
        for wheel in wheels:  # a wheel is a zip of the installed files (scripts aside)
            zipfile.ZipFile(wheel).extractall(target)
    return [os.path.basename(w) for w in wheels]
