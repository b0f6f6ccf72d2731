"""How each parameter of the GPT is split across tensor-parallel ranks, and merging / splitting shards.

Names end in the model's (GPT-NeoX's) parameter names, e.g. ``layers.0.attention.query_key_value.weight``.
Splits follow megatron.mpu's layers, which are GPT-NeoX's: vocabulary-parallel embedding and output head
(rows), column-parallel fused QKV (rows: consecutive heads with multi-head attention; each rank's share of
the query, key and value blocks with grouped-query attention, see megatron.model.attention) and MLP up
projection (rows; a gated MLP's [up | gate] halves are each split), row-parallel attention output and MLP
down projection (columns), the rpe table and ALiBi slopes (heads), the MoE experts' stacked w1 / w2 / w3 (rows:
whole experts), DeepSpeed's experts with enable_expert_tensor_parallelism as the dense MLP (else replicated; its
residual MLP always replicated); Mamba's inner channels (in_proj's [x | z] halves each split) and RWKV's heads, as
megatron.model.mamba / rwkv split them. Everything else (norms, row-parallel biases, learned positions, RWKV's
time-mix tables over hidden_size) is replicated.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from megatron.errors import ConversionError
from megatron.model.attention import qkv_blocks
from megatron.model.config import GATED_ACTIVATIONS, ModelConfig
from megatron.mpu.utils import Chunks, join_shards, shard_of

_QKV = ("attention.query_key_value.weight", "attention.query_key_value.bias")
_GATED = ("mlp.linear1.weight", "mlp.linear1.bias")
_COLUMN = ("word_embeddings.weight", "final_linear.weight")
_ROW = ("attention.dense.weight", "mlp.linear2.weight", "attention.rpe.weight")
_HEADS = ("attention.alibi_embed.slopes",)
_EXPERTS = ("mlp.experts.mlp.w1", "mlp.experts.mlp.w2", "mlp.experts.mlp.w3")
"""The dropless MoE's stacked expert weights: split by rows, i.e. by expert (megatron.model.moe.layer)."""
_RESIDUAL = "mlp.mlp.linear"
"""DeepSpeed's residual MoE (moe_use_residual): its dense MLP ``mlp.mlp`` is a copy of the whole expert, replicated
over the tensor-parallel ranks as the experts are (megatron.model.moe.deepspeed_layer), even with
enable_expert_tensor_parallelism (which splits the experts only)."""
_MAMBA_XZ = ("mixer.in_proj.weight", "mixer.in_proj.bias")
_CHANNELS = ("mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_proj.weight", "mixer.dt_proj.bias", "mixer.A_log",
             "mixer.D", "att.receptance.weight", "att.key.weight", "att.value.weight", "att.gate.weight",
             "att.time_faaaa", "att.ln_x.weight", "att.ln_x.bias", "ffn.key.weight")
"""Mamba's inner channels and RWKV's heads / channel-mix width, split in rows (megatron.model.mamba, rwkv)."""
_RECURRENT_ROW = ("mixer.x_proj.weight", "mixer.out_proj.weight", "att.output.weight", "ffn.value.weight",
                  "att.time_decay_w2")


LORA_FACTORS = (".lora.lora_A", ".lora.lora_B")
"""The names' ends of a LoRA adapter's factors (megatron.mpu.lora) of the linear layer named before them."""


def split_rule(name: str, config: ModelConfig) -> Optional[Tuple[int, Chunks]]:
    """(dimension, blocks) along which ``name`` is split, or None when every rank holds all of it."""
    if name.endswith(LORA_FACTORS):  # B as its column-parallel base layer's weight, A as its row-parallel one's
        base_rule = split_rule(name[:-len(".lora.lora_A")] + ".weight", config)
        if base_rule is None or (base_rule[0] == 0) != name.endswith("_B"):
            return None
        return base_rule
    if ".deepspeed_experts." in name:  # DeepSpeed's experts: whole, or with enable_expert_tensor_parallelism split
        return _split_expert_rule(name, config)
    if _RESIDUAL in name:  # DeepSpeed's residual MoE MLP: a copy of the whole expert on every tensor-parallel rank
        return None
    if name.endswith(_QKV):
        return 0, qkv_blocks(config)
    if name.endswith(_GATED):
        return 0, 2 if config.gated_mlp else 1
    if name.endswith(_COLUMN + _HEADS + _EXPERTS + _CHANNELS):
        return 0, 1
    if name.endswith(_MAMBA_XZ):
        return 0, 2
    if name.endswith(_ROW + _RECURRENT_ROW):
        return 1, 1
    if name.endswith("att.time_decay"):  # [1, 1, dim_att]
        return 2, 1
    return None


def _split_expert_rule(name: str, config: ModelConfig) -> Optional[Tuple[int, Chunks]]:
    """One of DeepSpeed's experts (megatron.model.moe.deepspeed_layer): a dense MLP (linear1 / linear2) split as
    megatron.model.mlp's with enable_expert_tensor_parallelism, else replicated on every tensor-parallel rank."""
    if not config.enable_expert_tensor_parallelism:
        return None
    if name.endswith((".linear1.weight", ".linear1.bias")):
        return 0, 2 if config.expert_activation in GATED_ACTIVATIONS else 1
    if name.endswith(".linear2.weight"):
        return 1, 1
    return None


def merge_shards(name: str, shards: Sequence[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The full tensor from the tensor-parallel ranks' shards (rank order)."""
    rule = split_rule(name, config)
    if rule is None or len(shards) == 1:
        first = shards[0]
        for rank, other in enumerate(shards[1:], start=1):
            if other.shape != first.shape or not torch.equal(other, first):
                raise ConversionError(f"{name} should be identical on every tensor-parallel rank but rank {rank} "
                                      f"differs from rank 0; the checkpoint is inconsistent")
        return first
    dim, chunks = rule
    try:
        return join_shards(list(shards), dim, chunks)
    except ValueError as exc:
        raise ConversionError(f"{name}: the shards of shape {tuple(shards[0].shape)} do not fit this model's "
                              f"layout ({exc})") from None


def split_full(name: str, full: torch.Tensor, world: int, config: ModelConfig) -> List[torch.Tensor]:
    """The shards of ``full`` for ``world`` tensor-parallel ranks (rank order)."""
    rule = split_rule(name, config)
    if rule is None or world == 1:
        return [full] * world
    dim, chunks = rule
    try:
        return [shard_of(full, dim, rank, world, chunks) for rank in range(world)]
    except ValueError as exc:
        raise ConversionError(f"{name} of shape {tuple(full.shape)} cannot be split over model_parallel_size="
                              f"{world}: {exc}") from None
