"""megatron.utils.host_memory: glibc keeps freed blocks for reuse (a step's worth of tensors, freed, stays with the
process instead of going back to the kernel to be faulted in again), and is left alone where the user chose the allocator or its options."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from megatron.utils.host_memory import allocator_left_alone, reuse_freed_host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

RETURNED_PER_STEP = textwrap.dedent("""
    import os, sys, torch
    from megatron.utils.host_memory import reuse_freed_host_memory
    if sys.argv[1] == "tuned":
        assert reuse_freed_host_memory({}) is not None
    def resident_mib():
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    returned = []
    for _ in range(5):  # a step's tensors of 4..28 MiB (112 MiB), written, then all freed
        kept = [torch.ones(2 ** 20 * k) for k in range(1, 8)]
        before = resident_mib()
        del kept
        returned.append(before - resident_mib())
    print(sum(returned[1:]) / 4)
""")


@pytest.mark.parametrize("environ, reason", [
    ({}, None),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc is preloaded"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "sets glibc's malloc options itself"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "sets glibc's malloc options itself"),
    ({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, None),
])
def test_the_users_allocator_choices_are_left_alone(environ, reason):
    got = allocator_left_alone(environ)
    assert (got is None) if reason is None else (reason in got)
    if reason is not None:
        assert reuse_freed_host_memory(environ) is None


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_freed_blocks_stay_with_the_process_for_the_next_step():
    """Freed, a step's tensors go back to the kernel (to be page-faulted in again next step) unless tuned. Both
    processes start from glibc's initial thresholds held fixed (128 KiB), so that the untuned one hands them back
    whatever glibc's adaptive thresholds would have learnt by then; the tuned one overrides them at run time."""
    initial = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    returned = {}
    for mode in ("plain", "tuned"):
        out = subprocess.run([sys.executable, "-c", RETURNED_PER_STEP, mode], capture_output=True, text=True,
                             check=True, env=initial)
        returned[mode] = float(out.stdout.strip().splitlines()[-1])
    print(f"MiB handed back to the kernel per step of 112 MiB of tensors: {returned}")
    assert returned["plain"] > 100 and returned["tuned"] < 1
