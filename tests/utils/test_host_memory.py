"""megatron.utils.host_memory: glibc keeps freed blocks for reuse (far fewer page faults for a step's worth of
tensors allocated and freed again), and is left alone where the user chose the allocator or its options."""
import platform
import subprocess
import sys
import textwrap

import pytest

from megatron.utils.host_memory import allocator_left_alone, reuse_freed_host_memory

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

FAULTS_PER_STEP = textwrap.dedent("""
    import resource, sys, torch
    from megatron.utils.host_memory import reuse_freed_host_memory
    if sys.argv[1] == "tuned":
        assert reuse_freed_host_memory({}) is not None
    def step():  # a step's tensors of 4..28 MiB, written, then all freed
        kept = [torch.ones(2 ** 20 * k) for k in range(1, 8)]
        del kept
    step(); step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
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
def test_freed_blocks_come_back_without_page_faults():
    faults = {}
    for mode in ("plain", "tuned"):
        out = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, mode], capture_output=True, text=True,
                             check=True)
        faults[mode] = float(out.stdout.strip().splitlines()[-1])
    print(f"minor page faults per step of 112 MiB of tensors: {faults}")
    assert faults["tuned"] * 4 < faults["plain"]
