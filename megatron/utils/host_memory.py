"""glibc's malloc told to keep freed memory for the next step instead of handing it back to the kernel.

A training step on a CPU allocates and frees the same large tensors every step (activations, logits chunks, their
fp32 casts, gradients). glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised as such
blocks are freed, never above 32 MiB) with a fresh mmap and unmaps it when freed, and returns the free top of its
heap to the kernel beyond the trim threshold: the next step then page-faults every page of those tensors again,
the kernel zeroing each one. On issue 34's 2-core AMD EPYC VM (2026-11-28) that was a tenth of a CPU step or more:
the quickstart's median step went from 112-121 ms to 102-104 ms in fp32 and from 89-105 ms to 70-85 ms in bf16 (three
alternating runs each, nothing else running) with the mmap threshold fixed at 32 MiB and the heap never trimmed.
jemalloc or tcmalloc preloaded (LD_PRELOAD) do the same, and are left alone; so are the user's own MALLOC_* or
GLIBC_TUNABLES settings.

The cost: a process keeps its peak heap for its lifetime (a training worker's peak is every step's anyway). Blocks
of more than 32 MiB still come from mmap (glibc refuses a higher threshold). Applied by train.py's workers when
there is no CUDA device (host memory is where a CPU run's tensors live)."""
from __future__ import annotations

import ctypes
import os
import platform
from typing import Mapping, Optional

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2 ** 20
"""glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2); mallopt refuses more."""
TRIM_THRESHOLD_BYTES = 2 ** 31 - 1
"""mallopt takes a C int: about 2 GiB of free heap top kept, in effect never trimmed."""
USER_ALLOCATOR_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def allocator_left_alone(environ: Mapping[str, str]) -> Optional[str]:
    """Why the allocator is not tuned in this environment (another allocator preloaded, the user's own settings),
    or None."""
    preload = environ.get("LD_PRELOAD", "")
    other = next((name for name in OTHER_ALLOCATORS if name in preload), None)
    if other:
        return f"{other} is preloaded (LD_PRELOAD)"
    if any(name in environ for name in USER_ALLOCATOR_SETTINGS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "the environment sets glibc's malloc options itself"
    return None


def reuse_freed_host_memory(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Fix glibc's mmap threshold at 32 MiB and stop it trimming the heap (module docstring). Returns what was done,
    or None where nothing was (not glibc, another allocator, the user's settings, or mallopt refused)."""
    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or allocator_left_alone(environ):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        return None
    return (f"glibc malloc: blocks up to {MMAP_THRESHOLD_BYTES // 2 ** 20} MiB from the heap, freed memory kept for "
            f"reuse (megatron.utils.host_memory)")
