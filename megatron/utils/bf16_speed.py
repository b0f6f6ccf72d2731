"""Whether this machine trains faster in bf16 than in fp32: what ``precision: auto`` decides with.

On a GPU that supports bf16 (torch.cuda.is_bf16_supported: Ampere and later) bf16 is the fast precision. On a CPU it
depends on the chip: with AVX512-BF16 or AMX the bf16 matmuls run 2-4x faster than fp32 ones (measured 870 against
~210 GFLOP/s on a 2-core AMD EPYC with avx512_bf16, and a training step 1.96x faster), without them PyTorch emulates
bf16 and it is slower than fp32. The flags alone do not say how fast (a hypervisor may hide or emulate them), so a
short probe times one matmul in each precision, and bf16 is chosen when it is at least ``BF16_SPEEDUP_NEEDED`` times
faster, or ``BF16_SPEEDUP_WITH_FLAGS`` times where the CPU advertises avx512_bf16 or amx_bf16 (native bf16: a probe
on a busy machine measures less than the chip does). The probe takes ~0.1-0.3 s on an idle machine, once, in the
process that derives the arguments (deepy.py: the workers receive the decided precision). torch is imported by the
functions that probe, not by this module: deepy.py imports it and starts without torch (0.3 s), and only a config
with `precision: auto` pays for it."""

import dataclasses
import time
from typing import List, Tuple

BF16_SPEEDUP_NEEDED = 2.0
"""bf16 is chosen on a CPU whose bf16 matmul is at least this much faster than fp32 (a step gains less than its
matmuls: the measured 4x matmul gave a 1.96x step)."""
PROBE_SIZE = 1024
"""The probe multiplies two PROBE_SIZE x PROBE_SIZE matrices (2 GFLOP: long enough to time, short to wait for)."""
BF16_SPEEDUP_WITH_FLAGS = 1.5
"""The same where the CPU advertises BF16_CPU_FLAGS (measured 4x on an idle machine, 2.2x under a load of 10)."""
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    """'bfloat16' or 'fp32'."""
    reason: str
    """One line: what was measured or read, for the run's output."""


def cpu_bf16_flags() -> List[str]:
    """The bf16 instruction-set flags this CPU advertises (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


def matmul_gflops(dtype, size: int = PROBE_SIZE, repeats: int = 3) -> float:
    """GFLOP/s of the fastest of ``repeats`` size x size matmuls in ``dtype`` on the CPU (after one warm-up)."""
    import torch

    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best / 1e9


def cpu_matmul_rates(size: int = PROBE_SIZE) -> Tuple[float, float]:
    """(fp32, bf16) GFLOP/s of a size x size matmul on this CPU, measured alternately (fp32, bf16, fp32, bf16:
    the best of each, so that a neighbour's burst does not decide)."""
    import torch

    fp32, bf16 = 0.0, 0.0
    for _ in range(2):
        fp32 = max(fp32, matmul_gflops(torch.float32, size))
        bf16 = max(bf16, matmul_gflops(torch.bfloat16, size))
    return fp32, bf16


def auto_precision() -> PrecisionChoice:
    """``precision: auto`` on this machine (module docstring)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bfloat16", f"precision: auto chose bf16 ({name} supports it)")
        return PrecisionChoice("fp32", f"precision: auto chose fp32 ({name} has no bf16; fp16 is not chosen "
                                       f"automatically: set it with its loss scaling if you want it)")
    fp32, bf16 = cpu_matmul_rates()
    flags = cpu_bf16_flags()
    measured = (f"a {PROBE_SIZE}x{PROBE_SIZE} matmul ran at {bf16:.0f} GFLOP/s in bf16 and {fp32:.0f} in fp32 "
                f"({bf16 / fp32:.2f}x) on this CPU, flags: {', '.join(flags) or 'no avx512_bf16 / amx_bf16'}")
    needed = BF16_SPEEDUP_WITH_FLAGS if flags else BF16_SPEEDUP_NEEDED
    if bf16 >= needed * fp32:
        return PrecisionChoice("bfloat16", f"precision: auto chose bf16 with fp32 master weights: {measured}")
    return PrecisionChoice("fp32", f"precision: auto chose fp32 (bf16 is not {needed:g}x faster here): {measured}")
