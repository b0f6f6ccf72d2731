"""What each fusion flag runs on a GPU, and the measurements that choice rests on.

A user who turns on a fusion flag expects a faster op. Each op here has two candidates: its Triton
kernel and PyTorch's implementation (the op's reference; for the norms those are PyTorch's own fused
CUDA kernels, F.layer_norm and F.rms_norm). On CUDA tensors a flag runs the candidate that was
measured faster on a GPU (``CUDA_CHOICE``); on CPU tensors (Triton's interpreter, which exists for
testing) it always runs the Triton kernel, so the kernels stay tested end to end. A flag that is off
runs the reference everywhere.

Measured on the first GPU run (NVIDIA H200, torch 2.11, Triton 3.6, bf16, forward + backward, median
of triton.testing.do_bench), with the Triton kernels as they were then::

    op                           shape                         Triton ms   PyTorch ms   runs on CUDA
    layer_norm                   [16384, 2048]                 0.777       0.209        PyTorch
    layer_norm                   [16384, 2560]                 0.748       0.234        PyTorch
    layer_norm                   [4096, 12288]                 0.604       0.299        PyTorch
    rms_norm                     [16384, 4096]                 0.619       0.302        PyTorch
    bias_gelu                    [16384, 8192]                 0.888       0.753        PyTorch
    bias_dropout_add p=0         [16384, 2048]                 0.319       0.174        PyTorch
    bias_dropout_add p=0.1       [16384, 2048]                 0.608       0.276        PyTorch
    upper_triang_masked_softmax  [4, 16, 2048, 2048]           0.700       8.030        Triton
    masked_softmax               [4, 16, 2048, 2048]           0.800       8.011        Triton
    masked_softmax               [1, 4, 256, 32768]            0.392       0.773        Triton
    rotary rot=128               [8, 2048, 16, 128]            0.423       1.397        Triton
    rotary rot=16                [8, 2048, 12, 64]             0.453       0.880        Triton
    swiglu                       halves of [16384, 11264]      0.535       1.335        Triton
    cross_entropy                [16384, 50304]                1.288       10.622       Triton

The four losing kernels were rewritten since (norms: several rows a program, a persistent backward that
sums the weight/bias gradients in registers, chunked rows past one block; bias_gelu / bias_dropout_add:
[rows, columns] tiles without a 64-bit division per element, one Philox call per four elements, the bias
gradient summed while dx is written) and timed again on the same H200 (bench/gpu_check.py, 2026-11-28,
commit 4b0fe57): they still lose, so their flags keep running PyTorch's implementation on CUDA::

    layer_norm                   [16384, 2048]                 0.560       0.210        PyTorch
    layer_norm                   [8192, 8192]                  0.893       0.380        PyTorch
    rms_norm                     [16384, 4096]                 0.646       0.303        PyTorch
    bias_gelu (exact GeLU)       [16384, 8192]                 0.831       0.810        PyTorch
    bias_dropout_add p=0.1       [16384, 2048]                 0.850       0.352        PyTorch

``bench/gpu_check.py`` times both candidates of every op (:func:`megatron.fused_kernels.kernel_candidates`)
and marks a row where the measurement disagrees with the choice; flip an entry below, with its numbers, where
the Triton kernel wins. For the two bias ops, also compare a model step with the flag on and off: where the
flag runs PyTorch's implementation the layers keep the bias inside the linear's GEMM (:func:`runs_triton`),
which the op-level PyTorch column (a separate x + bias) does not credit, so the Triton kernel must beat
that too (it saves at most one pass over dx in the backward).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

TRITON, PYTORCH = "triton", "pytorch"


@dataclass(frozen=True)
class Choice:
    """The candidate a fusion flag runs on CUDA tensors, and the measurement behind it."""

    runs: str
    measured: str


CUDA_CHOICE: Mapping[str, Choice] = MappingProxyType({
    "layer_norm": Choice(PYTORCH, "H200 bf16 fwd+bwd [16384, 2048]: Triton 0.560 ms, F.layer_norm 0.210 ms"),
    "rms_norm": Choice(PYTORCH, "H200 bf16 fwd+bwd [16384, 4096]: Triton 0.646 ms, F.rms_norm 0.303 ms"),
    "bias_gelu": Choice(PYTORCH, "H200 bf16 fwd+bwd [16384, 8192]: Triton 0.831 ms, PyTorch 0.810 ms"),
    "bias_dropout_add": Choice(PYTORCH, "H200 bf16 fwd+bwd [16384, 2048] p=0.1: Triton 0.850 ms, PyTorch 0.352 ms"),
    "upper_triang_masked_softmax": Choice(TRITON, "H200 bf16 fwd+bwd [4, 16, 2048, 2048]: Triton 0.700 ms, "
                                                  "PyTorch 8.030 ms"),
    "masked_softmax": Choice(TRITON, "H200 bf16 fwd+bwd [4, 16, 2048, 2048]: Triton 0.800 ms, PyTorch 8.011 ms"),
    "rotary": Choice(TRITON, "H200 bf16 fwd+bwd [8, 2048, 16, 128]: Triton 0.423 ms, PyTorch 1.397 ms"),
    "swiglu": Choice(TRITON, "H200 bf16 fwd+bwd halves of [16384, 11264]: Triton 0.535 ms, PyTorch 1.335 ms"),
    "cross_entropy": Choice(TRITON, "H200 bf16 fwd+bwd [16384, 50304]: Triton 1.288 ms, PyTorch 10.622 ms"),
})


@dataclass(frozen=True)
class PytorchOnCuda:
    """Runs ``pytorch`` on CUDA tensors and ``triton`` on any other (the interpreter, for tests); dispatched
    on the op's first argument, a tensor in every op here."""

    triton: Callable[..., Any]
    pytorch: Callable[..., Any]

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (self.pytorch if x.is_cuda else self.triton)(x, *args, **kwargs)


def runs_triton(op: Callable[..., Any], x: torch.Tensor) -> bool:
    """Whether ``op`` (a FusedOps field) runs its Triton kernel on ``x``: False for a flag that runs PyTorch's
    implementation on CUDA, with a CUDA tensor. The bias fusions take the bias out of the linear layer for
    their kernel to add; where the kernel would not run, a layer keeps the bias in the linear (one GEMM with
    its bias, as with the flag off) instead of adding it in a separate pass."""
    return not (isinstance(op, PytorchOnCuda) and x.is_cuda)


def flag_implementation(name: str, triton: Callable[..., Any], pytorch: Callable[..., Any]) -> Callable[..., Any]:
    """What op ``name``'s fusion flag runs: the Triton kernel, or PyTorch's on CUDA (see CUDA_CHOICE)."""
    return triton if CUDA_CHOICE[name].runs == TRITON else PytorchOnCuda(triton, pytorch)


@dataclass(frozen=True)
class Candidates:
    """Both implementations of one op, for timing them side by side (bench/gpu_check.py)."""

    op: str
    flag: str
    triton: Callable[..., Any]
    pytorch: Callable[..., Any]
    on_cuda: str
    measured: str

    def flag_runs_on_cuda(self) -> Callable[..., Any]:
        """The candidate the fusion flag runs on CUDA tensors."""
        return self.triton if self.on_cuda == TRITON else self.pytorch
