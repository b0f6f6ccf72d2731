"""Mixture of experts: the MoE MLP of the layers in ``config.moe_layers``.

* ``layer``: the dropless layer (``moe_type: megablocks``), plain PyTorch;
* ``deepspeed_layer``: DeepSpeed's token-dropping layer (``moe_type: deepspeed``);
* ``router``: top-k and Sinkhorn routing, jitter, the load-balancing loss;
* ``dispatch``: the dropless layer's rows moved between token order and expert order (permutation gathers);
* ``stats``: the auxiliary loss's gradient and the per-layer expert load for the logs;
* ``expert_parallel``: the dropless layer with its experts split over data-parallel ranks (moe_expert_parallel_size
  > 1; DeepSpeed's layer does it itself, deepspeed_layer);
* ``naming``: an expert-parallel expert's parameter names with its global expert index (per-parameter logs);
* ``pipeline``: DeepSpeed's MoE experts (DeepSpeed's layer, the expert-parallel dropless layer) under DeepSpeed's
  PipelineEngine: the stages kept in step while loading, GPT-NeoX's layer files written beside the expert files.
With tensor parallelism the dropless layer's experts are split over the tensor-parallel ranks (GPT-NeoX's dMoE), with
sequence_parallel too (the sequence gathered for routing, the partial sums reduce-scattered), and with expert
parallelism too over the expert-parallel ranks within each tensor-parallel rank's block (EP x TP).
DeepSpeed's layer runs with tensor parallelism too, its experts replicated over the tensor-parallel ranks or, with
enable_expert_tensor_parallelism, each split column / row over them (deepspeed_layer). With sequence_parallel every
layer gathers the sequence: the dropless ones (with or without expert parallelism) reduce-scatter their partial sums
(layer.sequence_parallel_moe), DeepSpeed's layer runs on the whole sequence and keeps its rank's chunk.
Expert parallelism and DeepSpeed's layer run in a pipeline with data and tensor parallelism (PP x DP x TP).
"""
from __future__ import annotations

from megatron.model.config import ModelConfig
from megatron.model.moe.deepspeed_layer import DeepSpeedMoE
from megatron.model.moe.expert_parallel import ExpertParallelDroplessMoE
from megatron.model.moe.layer import DroplessMoE
from megatron.model.moe.stats import MoELayerBase, moe_layers, moe_metrics, set_aux_loss_scale

__all__ = ["DroplessMoE", "MoELayerBase", "build_moe_mlp", "moe_layers", "moe_metrics", "set_aux_loss_scale"]


def build_moe_mlp(config: ModelConfig, parallel_state, initializer, layer_number: int) -> MoELayerBase:
    """The MoE MLP of layer ``layer_number``; ValueError for a configuration not built here (validation refuses
    those first, naming the key)."""
    unbuilt = []
    if config.moe_type == "megablocks" and config.moe_token_dropping:
        unbuilt.append("moe_token_dropping=true with moe_type 'megablocks' (dropless)")
    if unbuilt:
        raise ValueError(f"mixture of experts with {', '.join(unbuilt)} is not supported yet")
    if config.moe_type == "deepspeed":
        return DeepSpeedMoE(config, parallel_state, initializer, layer_number)
    if config.moe_expert_parallel_size > 1:
        return ExpertParallelDroplessMoE(config, parallel_state, initializer, layer_number)
    return DroplessMoE(config, parallel_state, initializer, layer_number)
