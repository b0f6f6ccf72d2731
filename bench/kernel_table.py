#!/usr/bin/env python
"""Each fused op at real sizes on one GPU: relative L2 error of its output and input gradients against an fp32
reference computed from the same inputs, and the median fwd+bwd time, for every implementation of the op:

    torch       the PyTorch reference (megatron.fused_kernels.*_reference) in the same dtype;
    triton      the project's Triton kernel (the callable in megatron.fused_kernels.KERNELS);
    <others>    where megatron.fused_kernels provides CANDIDATES ({op: {name: callable}}, same contract as the
                op), each of them instead of 'triton' (which it then names itself);
    flag        what the op's fusion flag runs (FusedOps.from_args with every flag on), when it is none of the
                above.

    python bench/kernel_table.py          # on a CUDA GPU (bench/gpu_check.py runs it)
    python bench/kernel_table.py --tiny   # CPU: tiny shapes under TRITON_INTERPRET=1, every call once, no timing
"""
from __future__ import annotations

import os
import sys
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, List, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import gpu_or_tiny  # noqa: E402

ERROR_FLAG = 2e-2  # a bf16 op's error vs fp32 above this is marked for a look


@dataclass(frozen=True)
class Case:
    """One table row group: `op` (a KERNELS name, or cross_entropy) called as call(impl, *make())."""
    label: str
    op: str
    call: Callable
    make: Callable[[], Sequence]
    time_only: bool = False  # e.g. dropout: outputs differ by design, only the timing means something


def implementations(op: str) -> Dict[str, Callable]:
    """name -> callable for `op`: torch, then megatron.fused_kernels.CANDIDATES[op] if it exists (else the
    Triton kernel), then the fusion flag's choice where that is none of them."""
    from megatron import fused_kernels as fk

    if op == "cross_entropy":
        reference, fused = fk.cross_entropy_reference, fk.cross_entropy
    else:
        _, fused, reference = fk.KERNELS[op]
    impls = {"torch": reference}
    candidates = getattr(fk, "CANDIDATES", None)  # another change may expose these; absent: the Triton kernel
    impls.update(dict(candidates[op]) if candidates and op in candidates else {"triton": fused})
    flags = SimpleNamespace(**{flag: True for flag, _, _ in fk.KERNELS.values()})
    chosen = getattr(fk.FusedOps.from_args(flags, fused_cross_entropy=True), op)
    if all(chosen is not impl for impl in impls.values()):
        impls["flag"] = chosen
    return impls


def cases(device: str, tiny: bool) -> List[Case]:
    """The real sizes of a 1-3B model's layers (tiny ones under --tiny)."""
    from megatron import fused_kernels as fk

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16).requires_grad_()

    T, H, S, B, NH = (8, 24, 16, 1, 2) if tiny else (16384, 2048, 2048, 4, 16)
    out = []
    for width in ((24,) if tiny else (2048, 2560, 12288)):
        rows = T if width <= 4096 else 4096
        out.append(Case(f"layer_norm [{rows},{width}]", "layer_norm", lambda f, x, w, b: f(x, w, b, 1e-5),
                        lambda r=rows, n=width: (leaf(r, n), leaf(n, scale=0.1), leaf(n, scale=0.1))))
    out.append(Case(f"rms_norm [{T},{2 * H}]", "rms_norm", lambda f, x, w: f(x, w, None, 1e-6),
                    lambda: (leaf(T, 2 * H), leaf(2 * H))))
    out.append(Case(f"upper_triang_softmax [{B},{NH},{S},{S}]", "upper_triang_masked_softmax",
                    lambda f, x: f(x, 0.125), lambda: (leaf(B, NH, S, S, scale=4),)))
    mask = torch.ones(S, S, dtype=torch.bool, device=device).triu(1)[None, None]
    out.append(Case(f"masked_softmax [{B},{NH},{S},{S}] causal mask", "masked_softmax",
                    lambda f, x: f(x, mask, 0.125), lambda: (leaf(B, NH, S, S, scale=4),)))
    long_k = 64 if tiny else 32768
    out.append(Case(f"masked_softmax [1,4,{2 if tiny else 256},{long_k}] no mask", "masked_softmax",
                    lambda f, x: f(x, None, 1.0), lambda: (leaf(1, 4, 2 if tiny else 256, long_k),)))
    for heads, head_dim, rot in (((2, 8, 4),) if tiny else ((16, 128, 128), (12, 64, 16))):
        cos, sin = fk.rotary_tables(S, rot, device=device)
        batch = 1 if tiny else 8
        out.append(Case(f"rotary [{batch},{S},{heads},{head_dim}] rot={rot}", "rotary",
                        lambda f, x, c=cos, s=sin: f(x, c, s),
                        lambda b=batch, h=heads, d=head_dim: (leaf(b, S, h, d),)))
    out.append(Case(f"bias_gelu [{T},{4 * H}]", "bias_gelu", lambda f, x, b: f(x, b, "tanh"),
                    lambda: (leaf(T, 4 * H), leaf(4 * H, scale=0.1))))
    for p in (0.0, 0.1):
        out.append(Case(f"bias_dropout_add p={p} [{T},{H}]", "bias_dropout_add",
                        lambda f, x, b, r, p=p: f(x, b, r, p), lambda: (leaf(T, H), leaf(H), leaf(T, H)),
                        time_only=p > 0))
    width = 8 if tiny else 2 * 5632
    out.append(Case(f"swiglu halves of [{T},{width}]", "swiglu", lambda f, h: f(*reversed(h.chunk(2, -1))),
                    lambda: (leaf(T, width),)))
    vocab = 40 if tiny else 50304
    targets = torch.randint(0, vocab, (T,), device=device)
    out.append(Case(f"cross_entropy [{T},{vocab}]", "cross_entropy", lambda f, x: f(x, targets),
                    lambda: (leaf(T, vocab, scale=2),)))
    return out


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def median_ms(fn: Callable[[], None], on_gpu: bool) -> float:
    """do_bench's median on a GPU; on CPU one call (the call path is what --tiny checks), nan."""
    if not on_gpu:
        fn()
        return float("nan")
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_case(case: Case, on_gpu: bool) -> int:
    """Print one row per implementation: errors (output, then each input gradient) and time vs torch; returns
    how many implementations failed to run."""
    torch.manual_seed(zlib.crc32(case.label.encode()))
    args = case.make()
    leaves = [a for a in args if torch.is_tensor(a) and a.requires_grad]
    args32 = [a.detach().float().requires_grad_() if torch.is_tensor(a) and a.requires_grad else a for a in args]
    impls = implementations(case.op)
    out32 = case.call(impls["torch"], *args32)
    dy = torch.randn_like(out32).to(torch.bfloat16)  # the same (bf16-exact) upstream gradient for all
    grads32 = torch.autograd.grad(out32, [a for a in args32 if torch.is_tensor(a) and a.requires_grad],
                                  dy.float())
    base, failed = None, 0
    for name, impl in impls.items():
        label = case.label if base is None else ""
        try:
            out = case.call(impl, *args)
            grads = torch.autograd.grad(out, leaves, dy)
            errors = [relative_error(out, out32)] + [relative_error(g, g32) for g, g32 in zip(grads, grads32)]

            def fwd_bwd(impl=impl):
                torch.autograd.grad(case.call(impl, *args), leaves, dy)
            ms = median_ms(fwd_bwd, on_gpu)
            base = ms if base is None else base
            flag = "" if case.time_only or all(e < ERROR_FLAG for e in errors) else "  <-- CHECK"
            shown = "(time only)" if case.time_only else " ".join(f"{e:.1e}" for e in errors)
            print(f"{label:40s} {name:10s} {shown:36s} {ms:8.3f} ms  x{base / ms:5.2f}{flag}", flush=True)
        except Exception as exc:  # noqa: BLE001  one implementation failing must not hide the others
            failed += 1
            print(f"{label:40s} {name:10s} FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}",
                  flush=True)
        finally:
            if on_gpu:
                torch.cuda.empty_cache()
    return failed


def main(argv=None) -> int:
    on_gpu = gpu_or_tiny(__doc__, "CPU dry run: tiny shapes, no timing", argv)
    device = "cuda" if on_gpu else "cpu"
    print("bf16 inputs; error: relative L2 of the output, then of each input gradient, against the fp32 reference "
          "on the same inputs; time: median fwd+bwd; x: speed vs torch (> 1 faster)")
    print(f"{'op [shape]':40s} {'impl':10s} {'error out / grads':36s} {'time':>11s}")
    failed = sum(run_case(case, on_gpu) for case in cases(device, tiny=not on_gpu))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
