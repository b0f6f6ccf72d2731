"""The fused-kernel choice for the model: which op implementations its layers call, by fusion flag.

Every layer asks :func:`model_fused_ops` for a :class:`~megatron.fused_kernels.FusedOps`; a flag that is
off gives the pure-PyTorch reference, so the unfused model never imports triton. Flags that are on but
cannot run here (no triton, or no GPU without TRITON_INTERPRET=1), or that name an op this model does not
contain (e.g. rope_fusion without rotary embeddings, see ``megatron.model.config.fusion_flag_problems``),
raise one ConfigError naming the flag and the fix when the model is built rather than at the first forward.
The softmax fusion flags of a model whose every layer is 'flash' (which computes its own softmax) are left
out: there is nothing for them to fuse, and the config loader has already warned about it (GPT-NeoX accepts
such configs).

Bias fusion (bias_gelu_fusion, bias_dropout_fusion) needs the linear layer's output *before* its bias:
the layers call the tensor-parallel linears' ``forward_without_bias`` and hand the bias to the fused op.
"""
from __future__ import annotations

from megatron.errors import ConfigError
from megatron.fused_kernels import FusedOps
from megatron.model.config import SOFTMAX_FUSION_FLAGS, ModelConfig, fusion_flag_problems


def model_fused_ops(config: ModelConfig) -> FusedOps:
    """The ops this model's layers call, fused where the flag is on (see module docstring).

    Raises ConfigError naming the flag when a fused op cannot be used here.
    """
    problems = fusion_flag_problems(config)
    if problems:
        raise ConfigError(problems)
    if not config.softmax_fusion:  # no layer can use a fused softmax: never ask for its kernel
        config = config.replace(**{flag: False for flag in SOFTMAX_FUSION_FLAGS})
    try:
        return FusedOps.from_args(config)
    except RuntimeError as err:  # triton missing, or no device for it: one message with the fix
        raise ConfigError([str(err)]) from None
