"""NeoXArgsParallelism: How the model is split over devices: pipeline, tensor (model), context and sequence
parallelism.

Fields, types, defaults and docs follow the GPT-NeoX argument reference."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class NeoXArgsParallelism:
    """How the model is split over devices: pipeline, tensor (model), context and sequence parallelism."""

    pipe_parallel_size: int = 0
    """
    Number of pipeline parallel stages. Disable with 0.
    """

    model_parallel_size: int = 1
    """
    Size of the model parallelism.
    """

    context_parallel_size: int = 1
    """
    Number of ranks that split each sequence (context parallelism; Megatron-LM's --context-parallel-size, which
    is accepted as context-parallel-size). The sequence is cut into 2 x context_parallel_size chunks and each
    rank holds two (chunk i and its mirror 2 x size - 1 - i, which balances causal attention); attention passes
    keys and values around the ranks in a ring and merges the partial softmaxes, so the loss and gradients equal
    those of 1 while attention activations per rank shrink by the factor. The ranks multiply with the others:
    data_parallel_size = world size / (pipe x context x model). seq_length must be divisible by 2 x
    context_parallel_size. Composes with tensor (and sequence), pipeline and data parallelism, ZeRO 0-3 and
    checkpoint_activations; its checkpoints resume in any layout (context_parallel_size included: the weights
    are not split, the optimizer state is resharded). Not supported yet with: ZeRO-3's reduce_scatter false,
    local / sparse / gmlp / mamba / rwkv layers, alibi or rpe positions, sliding_window_width, MoE, soft
    prompts, selective recompute, attention_dropout > 0, the fused-softmax flags, reset_attention_mask,
    inter_document_attention_masking, curriculum_learning, train_impl other than 'normal', and generation / evaluation (train with it, then
    generate with 1: the checkpoint is the same).
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
