"""Lazy access to Triton, so that ``import megatron.fused_kernels`` never imports triton.

The Triton kernels live in :mod:`megatron.fused_kernels.triton_kernels`, whose modules import
triton at their top. Every fused op gets its kernel module from :func:`load_kernels` when it
runs (Python caches the import), which turns a missing package or a wrong mode into one clear
error.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional

import torch

TRITON_REQUIREMENTS_FILE = "requirements/requirements-triton.txt"


def triton_installed() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def require_triton(*flags: str) -> None:
    """Raise one clear error, naming every flag given, when these fusion flags are on but Triton cannot run here.

    Triton kernels run compiled on a CUDA device, or, for testing only, on CPU tensors through
    Triton's interpreter when TRITON_INTERPRET=1 is set before triton is first imported.
    """
    if not flags:
        return
    named = ", ".join(repr(flag) for flag in flags)
    plural = "are" if len(flags) > 1 else "is"
    if not triton_installed():
        raise RuntimeError(
            f"{named} {plural} enabled but the 'triton' package is not installed. Install it with "
            f"`pip install -r {TRITON_REQUIREMENTS_FILE}` or set {named} to false."
        )
    if not torch.cuda.is_available() and not interpreter_requested():
        raise RuntimeError(
            f"{named} {plural} enabled but no CUDA device is available. Triton kernels need a GPU; "
            f"set {named} to false on CPU (or TRITON_INTERPRET=1 to run them slowly in Triton's "
            f"interpreter for testing)."
        )


def triton_language_interpreted() -> bool:
    """Whether triton.language was imported in interpreter mode (its own @jit helpers such as
    tl.sum and tl.rand are built once, at import, for one mode; the mode cannot change after)."""
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def load_kernels(name: str) -> ModuleType:
    """Import ``megatron.fused_kernels.triton_kernels.<name>``, or explain why it cannot be used."""
    if not triton_installed():
        raise RuntimeError(
            f"The fused kernel '{name}' needs the 'triton' package; install it with "
            f"`pip install -r {TRITON_REQUIREMENTS_FILE}`."
        )
    wanted = interpreter_requested()
    if triton_language_interpreted() != wanted:
        raise RuntimeError(
            f"The fused kernel '{name}' cannot run: TRITON_INTERPRET is {'on' if wanted else 'off'} now but was "
            f"{'off' if wanted else 'on'} when triton was first imported in this process. Set TRITON_INTERPRET "
            f"before anything imports triton (Triton's interpreter mode is fixed at import)."
        )
    module = importlib.import_module(f"megatron.fused_kernels.triton_kernels.{name}")
    if module.BUILT_FOR_INTERPRETER != wanted:
        # Our kernels were first imported under the other setting: rebuild them for this one.
        module = importlib.reload(module)
    return module


def check_device(tensor: torch.Tensor, name: str) -> None:
    """Refuse CPU tensors unless Triton's interpreter is active, instead of failing inside Triton."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and interpreter_requested():
        return
    raise RuntimeError(
        f"The fused kernel '{name}' got a tensor on '{tensor.device}'. Triton kernels run on CUDA "
        f"tensors, or on CPU tensors only through Triton's interpreter (TRITON_INTERPRET=1 set before "
        f"triton is imported; testing only). Turn the fusion flag off to use the PyTorch reference."
    )


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (Triton block sizes must be powers of two)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def compiled_kernel_report() -> list:
    """Registers and spills of every Triton kernel this process has compiled and launched (on a GPU), as
    dicts: kernel, constexprs, num_warps, registers, spilled (bytes). tests/fused_kernels/cuda_compile_check.py
    checks the pinned Triton ahead of time; this reads what the GPU machine's own Triton built, from the JIT
    caches of the kernel modules already imported (Triton's internal layout: anything unreadable is skipped)."""
    report = []
    prefix = "megatron.fused_kernels.triton_kernels."
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith(prefix) or module is None:
            continue
        for kernel_name, kernel in sorted(vars(module).items()):
            for entry in getattr(kernel, "device_caches", {}).values():
                for compiled in (entry[0] if isinstance(entry, tuple) and entry else {}).values():
                    report.append(_describe_compiled(kernel_name, compiled))
    return [row for row in report if row is not None]


def _describe_compiled(kernel_name: str, compiled) -> Optional[dict]:
    try:
        source = getattr(compiled, "src", None)
        names = getattr(getattr(source, "fn", None), "arg_names", [])
        constants = {names[key[0]] if isinstance(key, tuple) and key[0] < len(names) else str(key): value
                     for key, value in getattr(source, "constants", {}).items()}
        return {"kernel": kernel_name, "constexprs": constants, "num_warps": compiled.metadata.num_warps,
                "registers": compiled.n_regs, "spilled": compiled.n_spills}
    except (AttributeError, IndexError, TypeError):  # not yet loaded on a device, or another Triton layout
        return None
