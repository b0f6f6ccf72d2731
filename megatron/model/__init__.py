"""The GPT model: layers, positional encodings, norms, activations, init, KV cache, and builders.

``build_model(config, parallel_state)`` returns GPT2ModelPipe (a DeepSpeed PipelineModule) when
pipe_parallel_size >= 1 and GPT2ModelSequential otherwise; ``config`` is the frozen
megatron.model_config.ModelConfig, never NeoXArgs.
"""
from megatron.model.batch import BatchOptions, get_batch, masks_and_position_ids
from megatron.model.gpt2_model import (
    GPT2ModelPipe,
    GPT2ModelSequential,
    build_model,
    cross_entropy_loss,
    gpt2_layer_specs,
    loss_function,
)
from megatron.model.kv_cache import KVCache

__all__ = ["GPT2ModelPipe", "GPT2ModelSequential", "build_model", "cross_entropy_loss", "gpt2_layer_specs",
           "loss_function", "BatchOptions", "get_batch", "masks_and_position_ids", "KVCache"]
