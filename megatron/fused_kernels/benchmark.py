"""Both implementations of every fused op at real sizes, side by side: error against an fp32 reference
and forward + backward time, for the GPU check (bench/gpu_check.py) to print and for keeping
:mod:`megatron.fused_kernels.cuda_choice` honest.

``cases(device)`` gives the shapes (the first GPU run's, plus the rows that now take the chunked
kernels: hidden 8192 / 12288, 32k keys); ``cases(device, small=True)`` the same ops at tiny shapes for
a CPU dry run (Triton's interpreter). ``compare(case, candidate, timer)`` runs one case through the
op's Triton kernel and PyTorch's implementation (:func:`megatron.fused_kernels.kernel_candidates`)
and returns a :class:`Row` whose ``line()`` says which one the flag runs on CUDA and whether the
measurement disagrees with that choice. The timer is the caller's (on a GPU
``triton.testing.do_bench(fn, return_mode="median")``); nothing here synchronises or times by itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megatron.fused_kernels.cuda_choice import PYTORCH, TRITON, Candidates
from megatron.fused_kernels.rotary import rotary_tables

SWITCH_MARGIN = 0.05
"""A row suggests flipping the CUDA choice only when the other candidate is this much faster."""


@dataclass(frozen=True)
class Case:
    """One op at one shape: ``make()`` returns fresh arguments (bf16 leaves that require grad, and any
    other arguments); ``split`` turns them into the op's arguments inside the timed call where the op
    takes views (swiglu's halves of one projection); ``time_only`` where the candidates differ by design
    (dropout masks)."""

    op: str
    label: str
    make: Callable[[], tuple]
    time_only: bool = False
    split: Callable[[tuple], tuple] = tuple

    def call(self, fn: Callable, args: tuple) -> torch.Tensor:
        return fn(*self.split(args))


def _leaf(device, *shape: int, scale: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_()


def cases(device: torch.device | str, small: bool = False) -> list:
    """The benchmark cases of every op (see module docstring)."""
    def leaf(*shape: int, **kwargs) -> torch.Tensor:
        return _leaf(device, *shape, **kwargs)

    tokens, hidden, seq, batch, heads = (16384, 2048, 2048, 4, 16) if not small else (8, 24, 16, 1, 2)
    norm_shapes = ([(16384, 2048), (16384, 2560), (8192, 8192), (4096, 12288)] if not small else [(8, 24)])
    out = []
    for rows, width in norm_shapes:
        out.append(Case("layer_norm", f"layer_norm [{rows}, {width}]", lambda r=rows, w=width: (
            leaf(r, w), leaf(w, scale=0.1), leaf(w, scale=0.1), 1e-5)))
    for rows, width in ([(16384, 4096), (8192, 8192)] if not small else [(8, 24)]):
        out.append(Case("rms_norm", f"rms_norm [{rows}, {width}]", lambda r=rows, w=width: (
            leaf(r, w), leaf(w), None, 1e-6)))
    out.append(Case("upper_triang_masked_softmax", f"upper_triang_softmax [{batch}, {heads}, {seq}, {seq}]",
                    lambda: (leaf(batch, heads, seq, seq, scale=4.0), 0.125)))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    out.append(Case("masked_softmax", f"masked_softmax [{batch}, {heads}, {seq}, {seq}] causal mask",
                    lambda: (leaf(batch, heads, seq, seq, scale=4.0), causal, 0.125)))
    long_q, long_k = (256, 32768) if not small else (2, 64)
    out.append(Case("masked_softmax", f"masked_softmax [1, 4, {long_q}, {long_k}] no mask",
                    lambda: (leaf(1, 4, long_q, long_k, scale=4.0), None, 1.0)))
    out.append(Case("upper_triang_masked_softmax", f"upper_triang_softmax [1, 4, {long_q}, {long_k}]",
                    lambda: (leaf(1, 4, long_q, long_k, scale=4.0), 1.0)))
    for h, d, rot in ((16, 128, 128), (12, 64, 16)) if not small else ((2, 8, 4),):
        cos, sin = rotary_tables(seq, rot, device=device)
        out.append(Case("rotary", f"rotary [8, {seq}, {h}, {d}] rot={rot}", lambda h=h, d=d, c=cos, s=sin: (
            leaf(8 if not small else 1, seq, h, d), c, s)))
    for approximate in ("none", "tanh"):  # the model's exact GeLU; the first GPU run timed tanh
        out.append(Case("bias_gelu", f"bias_gelu {approximate} [{tokens}, {4 * hidden}]", lambda a=approximate: (
            leaf(tokens, 4 * hidden), leaf(4 * hidden, scale=0.1), a)))
    for p in (0.0, 0.1):
        out.append(Case("bias_dropout_add", f"bias_dropout_add p={p} [{tokens}, {hidden}]", lambda p=p: (
            leaf(tokens, hidden), leaf(hidden), leaf(tokens, hidden), p), time_only=p > 0))
    ffn = 5632 if not small else 8
    out.append(Case("swiglu", f"swiglu halves of [{tokens}, {2 * ffn}]", lambda: (leaf(tokens, 2 * ffn),),
                    split=_gate_and_up))
    vocab = 50304 if not small else 40
    targets = torch.randint(0, vocab, (tokens,), device=device)
    out.append(Case("cross_entropy", f"cross_entropy [{tokens}, {vocab}]", lambda: (
        leaf(tokens, vocab, scale=2.0), targets)))
    return out


def _gate_and_up(args: tuple) -> tuple:
    """(gate, up) as GPT-NeoX's SwiGLU splits its projection: ``up, gate = h.chunk(2, -1)``."""
    up, gate = args[0].chunk(2, dim=-1)
    return gate, up


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp32 (nan when actual is not finite)."""
    actual, expected = actual.detach().float(), expected.detach().float()
    if not torch.isfinite(actual).all():
        return float("nan")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _grad_leaves(args: Sequence) -> list:
    return [a for a in args if torch.is_tensor(a) and a.requires_grad]


def _as_fp32(args: Sequence) -> tuple:
    return tuple(a.detach().float().requires_grad_(a.requires_grad) if torch.is_tensor(a) and a.is_floating_point()
                 else a for a in args)


def _forward_backward(case: Case, fn: Callable, args: tuple, dy: torch.Tensor) -> Callable[[], None]:
    leaves = _grad_leaves(args)

    def run() -> None:
        torch.autograd.grad(case.call(fn, args), leaves, dy)
    return run


def _errors(case: Case, fn: Callable, args: tuple, reference: Callable, dy: torch.Tensor) -> tuple:
    out = case.call(fn, args)
    grads = torch.autograd.grad(out, _grad_leaves(args), dy)
    args32 = _as_fp32(args)
    out32 = case.call(reference, args32)
    grads32 = torch.autograd.grad(out32, _grad_leaves(args32), dy.float())
    return (relative_error(out, out32),) + tuple(relative_error(g, g32) for g, g32 in zip(grads, grads32))


@dataclass(frozen=True)
class Row:
    """One case's result: errors (output, then each gradient) of both candidates against the fp32
    reference, their times, and which one the flag runs on CUDA."""

    label: str
    errors_triton: tuple
    errors_pytorch: tuple
    ms_triton: float
    ms_pytorch: float
    flag_runs: str

    def faster(self) -> str:
        """The candidate measured faster by more than SWITCH_MARGIN, or the flag's (a tie, or no times)."""
        if math.isnan(self.ms_triton) or math.isnan(self.ms_pytorch):
            return self.flag_runs
        if self.ms_triton < self.ms_pytorch * (1 - SWITCH_MARGIN):
            return TRITON
        if self.ms_pytorch < self.ms_triton * (1 - SWITCH_MARGIN):
            return PYTORCH
        return self.flag_runs

    def line(self) -> str:
        err = lambda errors: "time only" if not errors else " ".join(f"{e:.1e}" for e in errors)  # noqa: E731
        verdict = "" if self.faster() == self.flag_runs else f"  <-- {self.faster()} faster: flip cuda_choice"
        return (f"{self.label:48s} triton {self.ms_triton:7.3f} ms  pytorch {self.ms_pytorch:7.3f} ms  "
                f"x{self.ms_pytorch / self.ms_triton:5.2f}  flag runs {self.flag_runs:7s}  "
                f"err triton [{err(self.errors_triton)}] pytorch [{err(self.errors_pytorch)}]{verdict}")


def compare(case: Case, candidate: Candidates, timer: Callable[[Callable[[], None]], float]) -> Row:
    """Run ``case`` through both candidates: errors against fp32 PyTorch, and ``timer`` of forward + backward."""
    args = case.make()
    with torch.no_grad():
        dy = torch.randn_like(case.call(candidate.pytorch, args))
    errors = {}
    for name, fn in ((TRITON, candidate.triton), (PYTORCH, candidate.pytorch)):
        errors[name] = () if case.time_only else _errors(case, fn, args, candidate.pytorch, dy)
    ms_triton = timer(_forward_backward(case, candidate.triton, args, dy))
    ms_pytorch = timer(_forward_backward(case, candidate.pytorch, args, dy))
    return Row(case.label, errors[TRITON], errors[PYTORCH], ms_triton, ms_pytorch, candidate.on_cuda)
