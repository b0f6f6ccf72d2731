"""NeoXArgsParallelism: How the model is split over devices: pipeline, tensor (model) and sequence parallelism.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class NeoXArgsParallelism:
    """How the model is split over devices: pipeline, tensor (model) and sequence parallelism."""

    pipe_parallel_size: int = 0
    """
    Number of pipeline parallel stages. Disable with 0.
    """

    model_parallel_size: int = 1
    """
    Size of the model parallelism.
    """

    pipe_partition_method: str = 'type:transformer|mlp'
    """
    method used to distribute model layers across pipeline stages. Choose from "parameters", which
    balances the number of parameters on each pipeline stage, "uniform", which naively balances the
    number of layers per stage, or "type:[regex]", which balances layers whose class names match [regex].
    The default also balances Mamba and RWKV layers (their class names do not match "transformer").
    """

    world_size: Optional[int] = None
    """
    Total world size (i.e number of gpus in cluster). Configured post-launch using distributed launcher
    """

    is_pipe_parallel: bool = False
    """
    flag to determine whether pipeline parallelism is on - shouldn't be set by user, is automatically
    determined according to pipeline parallel size.
    """

    sequence_parallel: bool = False
    """
    flag to determine whether Megatron-style Sequence Parallelism (https://arxiv.org/abs/2205.05198)
    (Layernorm inputs and activations are sharded across model parallel group) will be used. Has no
    effect when model_parallel_size is 1. **Set by user, in contrast to neox_args.is_pipe_parallel.**
    """
