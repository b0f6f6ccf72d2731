"""Mixture of experts: the MoE MLP of the layers in ``config.moe_layers``.

* ``layer``: the dropless layer (``moe_type: megablocks``), plain PyTorch;
* ``router``: top-k and Sinkhorn routing, jitter, the load-balancing loss;
* ``stats``: the auxiliary loss's gradient and the per-layer expert load for the logs.
With tensor parallelism the experts are split over the tensor-parallel ranks (GPT-NeoX's dMoE). Expert
parallelism (moe_expert_parallel_size > 1), DeepSpeed's expert tensor parallelism and its token-dropping layer
(moe_type deepspeed) are not built yet: megatron.neox_arguments refuses them.
"""
from __future__ import annotations

from megatron.model.moe.layer import DroplessMoE
from megatron.model.moe.stats import MoELayerBase, moe_layers, moe_metrics, set_aux_loss_scale
from megatron.model_config import ModelConfig

__all__ = ["DroplessMoE", "MoELayerBase", "build_moe_mlp", "moe_layers", "moe_metrics", "set_aux_loss_scale"]


def build_moe_mlp(config: ModelConfig, parallel_state, initializer, layer_number: int) -> MoELayerBase:
    """The MoE MLP of layer ``layer_number``; ValueError for a configuration not built here (validation refuses
    those first, naming the key)."""
    unbuilt = []
    if config.moe_type != "megablocks":
        unbuilt.append(f"moe_type={config.moe_type!r}")
    if config.moe_expert_parallel_size != 1:
        unbuilt.append(f"moe_expert_parallel_size={config.moe_expert_parallel_size}")
    if config.moe_token_dropping:
        unbuilt.append("moe_token_dropping=true")
    if unbuilt:
        raise ValueError(f"mixture of experts with {', '.join(unbuilt)} is not supported yet (the dropless layer, "
                         f"moe_type megablocks, is built, with moe_expert_parallel_size 1)")
    return DroplessMoE(config, parallel_state, initializer, layer_number)
