#!/usr/bin/env python
"""What a GPU check ran on: the GPU and driver, Python, torch / CUDA / NCCL / Triton against the project's pins,
DeepSpeed (and whether it came from the wheels bench/gpu_check.py carried along), the optional packages
(flash-attn, mamba-ssm, causal-conv1d, transformers, pytest-xdist), DeepSpeed's accelerator, and the settings
that change what runs (TORCH_CUDA_ARCH_LIST, which DeepSpeed's JIT op builds parse; TF32).

    python bench/gpu_env.py
"""
from __future__ import annotations

import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Dict, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARRIED_ENV = "GPU_CHECK_CARRIED"  # the folder bench/gpu_check.py installed carried wheels into, if any
OPTIONAL = ("deepspeed", "flash_attn", "transformers", "mamba_ssm", "causal_conv1d", "xdist")


def pins() -> Dict[str, str]:
    """package -> requirement as the project's requirements files pin it (torch, triton, deepspeed, ...)."""
    found = {}
    folder = os.path.join(REPO, "requirements")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        with open(os.path.join(folder, name)) as handle:
            for line in handle:
                match = re.match(r"^([A-Za-z0-9_.-]+)\s*([<>=!~].*)?$", line.split("#")[0].strip())
                if match and match.group(2):
                    found[match.group(1).lower().replace("_", "-")] = match.group(2).strip()
    return found


def package_line(module: str, carried: Optional[str]) -> str:
    try:
        imported = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  a broken install is reported, not fatal
        return f"{module}: not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:150]})"
    where = getattr(imported, "__file__", "") or ""
    origin = " (from the carried wheels)" if carried and where.startswith(carried) else ""
    return f"{module}: {getattr(imported, '__version__', '?')}{origin}  {os.path.dirname(where)}"


def main() -> int:
    print(f"python {platform.python_version()} ({sys.executable}), {platform.platform()}")
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, check=False)
        print("nvidia-smi:", (query.stdout or query.stderr).strip())
    import torch
    import triton

    wanted = pins()
    print(f"torch {torch.__version__} (pinned {wanted.get('torch', '?')}), CUDA {torch.version.cuda}, "
          f"triton {triton.__version__} (pinned {wanted.get('triton', '?')})")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in old ones
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
        print(f"{p.name}: sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB; "
              f"{torch.cuda.device_count()} device(s); NCCL {nccl}; "
              f"torch built for {' '.join(torch.cuda.get_arch_list())}")
    else:
        print("no CUDA device (dry run)")
    print(f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST')!r} (DeepSpeed's JIT op builds read it)")
    carried = os.environ.get(CARRIED_ENV)
    print(f"carried wheels installed into: {carried or '(none: DeepSpeed was importable)'}; deepspeed pinned "
          f"{wanted.get('deepspeed', '?')}")
    for module in OPTIONAL:
        print(package_line(module, carried))
    try:
        from deepspeed.accelerator import get_accelerator

        print(f"DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r} -> DeepSpeed accelerator "
              f"{get_accelerator().device_name()}")
    except Exception as exc:  # noqa: BLE001
        print(f"DeepSpeed accelerator: {type(exc).__name__}: {exc}")
    print(f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, cuDNN {torch.backends.cudnn.allow_tf32}; "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
