"""Fused kernels, each beside its pure-PyTorch reference, chosen by the GPT-NeoX fusion flags.

Use :meth:`FusedOps.from_args` to get the callables the model should call; a flag that is off
gives the reference. A flag that is on runs, on CUDA tensors, whichever of the Triton kernel and
PyTorch's implementation a GPU measured faster (:mod:`megatron.fused_kernels.cuda_choice`, which
lists the numbers: today PyTorch's for layer_norm, rms_norm, bias_gelu and bias_dropout_add, the
Triton kernel for the rest), and the Triton kernel on CPU tensors (Triton's interpreter, for tests).
:func:`kernel_candidates` gives both implementations of every op, for timing them side by side.
Importing this package never imports triton: kernels load on first use.

Layout and contracts (see each module's docstring):

=============================  =====================================  =========================================
field                          flag                                   call
=============================  =====================================  =========================================
upper_triang_masked_softmax    scaled_upper_triang_masked_softmax_    (scores [..., sq, sk], scale)
                               fusion
masked_softmax                 scaled_masked_softmax_fusion           (scores [b, h, sq, sk], mask|None, scale)
layer_norm                     layernorm_fusion                       (x, weight|None, bias|None, eps)
rms_norm                       rmsnorm_fusion                         (x, weight|None, bias|None, eps)
rotary                         rope_fusion                            (x [b, s, h, d], cos, sin, seq_first=False)
bias_gelu                      bias_gelu_fusion                       (x, bias|None, approximate="tanh"|"none")
bias_dropout_add               bias_dropout_fusion                    (x, bias|None, residual, p, training)
swiglu                         use_flashattn_swiglu                   (gate, up) -> silu(gate) * up
cross_entropy                  from_args(..., fused_cross_entropy=)   (logits [t, v], targets int64 [t], ignore_index)
=============================  =====================================  =========================================

May import: nothing of megatron.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron.fused_kernels.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from megatron.fused_kernels.bias_gelu import bias_gelu, bias_gelu_reference
from megatron.fused_kernels.cross_entropy import cross_entropy, cross_entropy_reference
from megatron.fused_kernels.cuda_choice import (CUDA_CHOICE, PYTORCH, TRITON, Candidates, flag_implementation,
                                                runs_triton)
from megatron.fused_kernels.layer_norm import layer_norm, layer_norm_reference
from megatron.fused_kernels.rms_norm import rms_norm, rms_norm_reference
from megatron.fused_kernels.rotary import rotary, rotary_reference, rotary_tables
from megatron.fused_kernels.scaled_masked_softmax import scaled_masked_softmax, scaled_masked_softmax_reference
from megatron.fused_kernels.scaled_upper_triang_masked_softmax import (scaled_upper_triang_masked_softmax,
                                                                       scaled_upper_triang_masked_softmax_reference)
from megatron.fused_kernels.swiglu import swiglu, swiglu_reference
from megatron.fused_kernels.triton_support import TRITON_REQUIREMENTS_FILE, require_triton

# field name -> (NeoX flag, fused callable, reference callable); cross_entropy has no NeoX flag.
KERNELS: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
    "upper_triang_masked_softmax": (
        "scaled_upper_triang_masked_softmax_fusion",
        scaled_upper_triang_masked_softmax,
        scaled_upper_triang_masked_softmax_reference,
    ),
    "masked_softmax": ("scaled_masked_softmax_fusion", scaled_masked_softmax, scaled_masked_softmax_reference),
    "layer_norm": ("layernorm_fusion", layer_norm, layer_norm_reference),
    "rms_norm": ("rmsnorm_fusion", rms_norm, rms_norm_reference),
    "rotary": ("rope_fusion", rotary, rotary_reference),
    "bias_gelu": ("bias_gelu_fusion", bias_gelu, bias_gelu_reference),
    "bias_dropout_add": ("bias_dropout_fusion", bias_dropout_add, bias_dropout_add_reference),
    "swiglu": ("use_flashattn_swiglu", swiglu, swiglu_reference),
}
CROSS_ENTROPY_OPTION = "fused_cross_entropy"


@dataclass(frozen=True)
class FusedOps:
    """The op implementations a model uses, fused or reference per flag (immutable, no global state)."""

    upper_triang_masked_softmax: Callable[..., Any]
    masked_softmax: Callable[..., Any]
    layer_norm: Callable[..., Any]
    rms_norm: Callable[..., Any]
    rotary: Callable[..., Any]
    bias_gelu: Callable[..., Any]
    bias_dropout_add: Callable[..., Any]
    swiglu: Callable[..., Any]
    cross_entropy: Callable[..., Any]

    @classmethod
    def reference(cls) -> "FusedOps":
        """All pure-PyTorch references (every flag off)."""
        ops = {name: reference for name, (_, _, reference) in KERNELS.items()}
        return cls(**ops, cross_entropy=cross_entropy_reference)

    @classmethod
    def fused(cls) -> "FusedOps":
        """All fused Triton versions (needs Triton: a CUDA device, or TRITON_INTERPRET=1 on CPU)."""
        require_triton(*(flag for flag, _, _ in KERNELS.values()), CROSS_ENTROPY_OPTION)
        ops = {name: fused for name, (_, fused, _) in KERNELS.items()}
        return cls(**ops, cross_entropy=cross_entropy)

    @classmethod
    def from_args(cls, flags: Any, fused_cross_entropy: bool = False) -> "FusedOps":
        """Pick each op by its GPT-NeoX flag on ``flags`` (a ModelConfig; a missing attribute counts as off).

        Raises RuntimeError naming the enabled flags (and requirements-triton.txt) when any is
        on but Triton is not installed or has no device to run on.
        """
        enabled = {name for name, (flag, _, _) in KERNELS.items() if bool(getattr(flags, flag, False))}
        flags = [KERNELS[name][0] for name in KERNELS if name in enabled]
        require_triton(*flags, *([CROSS_ENTROPY_OPTION] if fused_cross_entropy else []))
        ops = {name: (flag_implementation(name, fused, reference) if name in enabled else reference)
               for name, (_, fused, reference) in KERNELS.items()}
        loss = (flag_implementation("cross_entropy", cross_entropy, cross_entropy_reference) if fused_cross_entropy
                else cross_entropy_reference)
        return cls(**ops, cross_entropy=loss)


def kernel_candidates() -> tuple:
    """Both implementations of every op (:class:`~megatron.fused_kernels.cuda_choice.Candidates`: the
    Triton kernel, PyTorch's, and which one its flag runs on CUDA), in KERNELS' order then cross_entropy:
    what bench/gpu_check.py times side by side."""
    table = [(name, flag, fused, reference) for name, (flag, fused, reference) in KERNELS.items()]
    table.append(("cross_entropy", CROSS_ENTROPY_OPTION, cross_entropy, cross_entropy_reference))
    return tuple(Candidates(name, flag, fused, reference, CUDA_CHOICE[name].runs, CUDA_CHOICE[name].measured)
                 for name, flag, fused, reference in table)


__all__ = [
    "CROSS_ENTROPY_OPTION",
    "CUDA_CHOICE",
    "PYTORCH",
    "TRITON",
    "Candidates",
    "FusedOps",
    "KERNELS",
    "TRITON_REQUIREMENTS_FILE",
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "cross_entropy",
    "cross_entropy_reference",
    "flag_implementation",
    "kernel_candidates",
    "layer_norm",
    "layer_norm_reference",
    "require_triton",
    "rms_norm",
    "rms_norm_reference",
    "rotary",
    "rotary_reference",
    "rotary_tables",
    "runs_triton",
    "scaled_masked_softmax",
    "scaled_masked_softmax_reference",
    "scaled_upper_triang_masked_softmax",
    "scaled_upper_triang_masked_softmax_reference",
    "swiglu",
    "swiglu_reference",
]
