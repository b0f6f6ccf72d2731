"""The fused-kernel choice for the model: which op implementations its layers call, by fusion flag.

Every layer asks :func:`model_fused_ops` for a :class:`~megatron.fused_kernels.FusedOps`; a flag that is
off gives the pure-PyTorch reference, so the unfused model never imports triton. Flags that are on but
cannot run here (no triton, or no GPU without TRITON_INTERPRET=1), or that name an op this model does not
contain (e.g. rope_fusion without rotary embeddings), raise one ConfigError naming the flag and the fix,
when the model is built rather than at the first forward. The softmax fusion flags of a model whose every
layer is 'flash' (which computes its own softmax) are left out: there is nothing for them to fuse, and the
config loader has already warned about it (as GPT-NeoX accepts such configs).

Bias fusion (bias_gelu_fusion, bias_dropout_fusion) needs the linear layer's output *before* its bias:
the layers call the tensor-parallel linears' ``forward_without_bias`` and hand the bias to the fused op.
"""
from __future__ import annotations

from types import SimpleNamespace

from megatron.fused_kernels import KERNELS, FusedOps
from megatron.neox_arguments.validation import SOFTMAX_FUSION_FLAGS, fusion_flag_problems, unused_softmax_fusion_flags
from megatron.neox_arguments.errors import ConfigError

SOFTMAX_FLAGS = SOFTMAX_FUSION_FLAGS


def _on(neox_args, flag: str) -> bool:
    return bool(getattr(neox_args, flag, False))


def softmax_fusion_on(neox_args) -> bool:
    """True when either fused-softmax flag asks attention to take the explicit-scores path."""
    return any(_on(neox_args, flag) for flag in SOFTMAX_FLAGS)


def model_fused_ops(neox_args) -> FusedOps:
    """The ops this model's layers call, fused where the flag is on (see module docstring).

    Raises ConfigError naming the flag when a fused op cannot be used here.
    """
    problems = fusion_flag_problems(neox_args)
    if problems:
        raise ConfigError(problems)
    unused = unused_softmax_fusion_flags(neox_args)
    flags = SimpleNamespace(**{flag: _on(neox_args, flag) and flag not in unused for flag, _, _ in KERNELS.values()})
    try:
        return FusedOps.from_args(flags)
    except RuntimeError as err:  # triton missing, or no device for it: one message with the fix
        raise ConfigError([str(err)]) from None
