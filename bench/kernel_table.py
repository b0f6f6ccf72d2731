#!/usr/bin/env python
"""Each fused op at real sizes on one GPU, both implementations side by side: the project's Triton kernel and
PyTorch's, with the relative L2 error of the output and input gradients against an fp32 reference on the same
inputs, the median fwd+bwd time, which one the op's fusion flag runs on CUDA
(megatron/fused_kernels/cuda_choice.py), and a marker where the measurement disagrees with that choice. Then the
registers and spills of every Triton kernel this process compiled.

The cases and the comparison are megatron.fused_kernels.benchmark's (one table for the library and the check);
this script only times them and prints.

    python bench/kernel_table.py          # on a CUDA GPU (bench/gpu_check.py runs it)
    python bench/kernel_table.py --tiny   # CPU: tiny shapes under TRITON_INTERPRET=1, every call once, no timing
"""
from __future__ import annotations

import math
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_or_tiny  # noqa: E402


def timer(on_gpu: bool) -> Callable[[Callable[[], None]], float]:
    """do_bench's median on a GPU; on CPU one call (the call path is what --tiny checks) and nan."""
    if on_gpu:
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")

    def once(fn: Callable[[], None]) -> float:
        fn()
        return math.nan
    return once


def main(argv=None) -> int:
    on_gpu = gpu_or_tiny(__doc__, "CPU dry run: tiny shapes, no timing", argv)
    from megatron.fused_kernels import kernel_candidates
    from megatron.fused_kernels.benchmark import cases, compare
    from megatron.fused_kernels.triton_support import compiled_kernel_report

    print("bf16 inputs; err: relative L2 of the output, then of each input gradient, against the fp32 reference on "
          "the same inputs; ms: median fwd+bwd; x: PyTorch time / Triton time (> 1: Triton faster); 'flag runs': "
          "what the fusion flag runs on CUDA", flush=True)
    by_op = {candidate.op: candidate for candidate in kernel_candidates()}
    failed = 0
    for case in cases("cuda" if on_gpu else "cpu", small=not on_gpu):
        try:
            torch.manual_seed(0)
            print(compare(case, by_op[case.op], timer(on_gpu)).line(), flush=True)
        except Exception as exc:  # noqa: BLE001  one case failing must not hide the others
            failed += 1
            print(f"{case.label:48s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
    report = compiled_kernel_report()
    for row in report:
        if row["spilled"]:
            print("SPILLS", row)
    print(f"{len(report)} compiled kernels, {sum(bool(row['spilled']) for row in report)} with spills")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
