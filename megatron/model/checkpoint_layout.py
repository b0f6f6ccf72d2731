"""GPT-NeoX's checkpoint entries beyond this model's parameters, in one place.

The model's parameters already carry GPT-NeoX's names and layouts: the slot indices and module keys
(megatron.model.gpt2_model), RMSNorm ``scale`` / ``offset`` (norms.py), the fused QKV rows and the shared
``rpe`` table (attention.py), the registration order (transformer.py). What GPT-NeoX's checkpoints hold
besides them, and how a GPT-NeoX model differs from this config's model, is handled here, on one slot's
state dict (names relative to the slot, this tensor-parallel rank's shards). Both the slot modules'
state-dict hooks (so that DeepSpeed's engine saves and loads GPT-NeoX's files as they are) and the
converter (megatron.checkpoint_conversion, which reads and writes the files itself) call it.

``to_neox`` adds to a slot's parameters:
  * the buffers GPT-NeoX saves although they are computed: ``position_embeddings.inv_freq`` (slot 0, pos_emb
    sinusoidal), ``attention.alibi_embed.slopes`` (layers, pos_emb alibi: this rank's heads' slopes),
    ``attention.rotary_emb.inv_freq`` (layers, rotary_save_freqs_buffer); in the dtype of the slot's
    parameters, as GPT-NeoX's buffers are cast with its model;
  * with gpt_j_tied, ``post_attention_layernorm.*``, which GPT-NeoX builds and saves but never uses, as a copy
    of ``input_layernorm.*`` (so the checkpoint is also right for an untied reader);
  * in gMLP / aMLP slots, GPT-NeoX's never-added ``input_linear.bias`` / ``output_linear.bias`` (zeros;
    dropped again on load);
and with gpt_j_residual and T > 1 tensor-parallel ranks stores each rank's share of the row-parallel biases
(``attention.dense.bias``, ``mlp.linear2.bias``) as bias / T: GPT-NeoX's parallel residual adds every rank's
bias before its one all-reduce, so its model's bias is the sum over ranks, where this model (and GPT-NeoX
without gpt_j_residual) adds one replicated bias after the reduction.
``from_neox`` returns this model's parameters from a GPT-NeoX slot state dict:
  * computed buffers are checked against this model's values (to the precision of a 16-bit checkpoint) and
    dropped, including a rotary ``inv_freq`` this config would not save;
  * gpt_j_residual with T > 1: the row-parallel biases are T x the rank's share (ranks hold equal shares:
    same initialisation, same gradients);
  * gpt_j_tied's unused ``post_attention_layernorm.*`` is dropped;
  * GPT-NeoX's RMSNorm never has an ``offset`` whatever use_bias_in_norms says: a missing offset loads as zero
    (the same function); its LayerNorm always has a ``bias``: with use_bias_in_norms false a zero bias is
    dropped and any other refused;
  * GPT-NeoX's ``attention.qk_layernorm`` (one norm over [heads, head_dim] shared by queries and keys) is
    refused: this model's use_qk_layernorm (separate ``q_norm`` / ``k_norm`` over head_dim) is another function.
"""
from __future__ import annotations

import functools
from typing import Dict, Mapping, Optional, Sequence

import torch
from torch import nn

from megatron.model.config import ModelConfig
from megatron.model.positional import alibi_slopes, rotary_frequencies, sinusoidal_inv_freq

EMBEDDING, LAYER, FINAL_NORM, HEAD = "embedding", "layer", "final_norm", "head"
MAMBA_LAYER, RWKV_LAYER = "mamba_layer", "rwkv_layer"
"""Slots of Mamba / RWKV blocks: their parameters are GPT-NeoX's as they are (megatron.model.mamba, rwkv);
only a Mamba block's ``norm`` follows the norm rules below (RWKV's ln1 / ln2 are always LayerNorms with
biases, as GPT-NeoX's)."""
GMLP_LAYER = "gmlp_layer"
"""Slots of gMLP / aMLP blocks (megatron.model.gmlp): GPT-NeoX's GMLPBlock also saves ``input_linear.bias`` and
``output_linear.bias``, which its forward never adds (zeros, written here as GPT-NeoX's model has them; dropped
on load, whatever they hold, since they do not change GPT-NeoX's function); its norms follow the norm rules."""
BLOCK_KINDS = {"mamba": MAMBA_LAYER, "rwkv": RWKV_LAYER, "gmlp": GMLP_LAYER, "amlp": GMLP_LAYER}
UNUSED_GMLP_BIASES = ("input_linear.bias", "output_linear.bias")
SUMMED_BIASES = ("attention.dense.bias", "mlp.linear2.bias")
"""Row-parallel biases GPT-NeoX's parallel residual sums over tensor-parallel ranks."""
_NORMS = {LAYER: ("input_layernorm.", "post_attention_layernorm.", "attention.q_norm.", "attention.k_norm."),
          FINAL_NORM: ("norm.",), MAMBA_LAYER: ("norm.",), GMLP_LAYER: ("norm.", "sgu.norm.")}
_WHAT = {"position_embeddings.inv_freq": "hidden_size", "attention.alibi_embed.slopes":
         "num_attention_heads / model_parallel_size",
         "attention.rotary_emb.inv_freq": "rotary_pct / rotary_emb_base / rope_scaling"}


class LayoutError(ValueError):
    """A checkpoint entry this model cannot take; the message names it and the setting to change."""


def slot_kind(slot: int, num_layers: int, attention_types: Sequence[str] = ()) -> Optional[str]:
    """What GPT-NeoX's slot ``slot`` holds (megatron.model.gpt2_model), None for a parameter-free slot; with
    the model's ``attention_types`` a Mamba or RWKV block's slot is told from an attention layer's."""
    if slot == 0:
        return EMBEDDING
    if 2 <= slot <= num_layers + 1:
        kind = attention_types[slot - 2] if len(attention_types) == num_layers else None
        return BLOCK_KINDS.get(kind, LAYER)
    return {num_layers + 3: FINAL_NORM, num_layers + 4: HEAD}.get(slot)


def _rotary_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The layers' rotary inverse frequencies, RoPE scaling included (dynamic NTK: those within
    max_position_embeddings)."""
    return rotary_frequencies(config.rotary_dim, float(config.rotary_emb_base), config.rope_scaling_dict,
                              config.positions)[0]


def _unscaled_rotary(name: str, saved: torch.Tensor, config: ModelConfig) -> bool:
    """A rotary inv_freq saved without the RoPE scaling this config adds (a checkpoint trained before its context
    was extended): the buffer is computed, never learned, so the model takes its own."""
    if name != "attention.rotary_emb.inv_freq" or not config.rope_scaling:
        return False
    plain = rotary_frequencies(config.rotary_dim, float(config.rotary_emb_base), None, config.positions)[0]
    return saved.shape == plain.shape and torch.allclose(saved.float().cpu(), plain, rtol=1e-2, atol=0)


def computed_entries(kind: str, config: ModelConfig, tp_rank: int, tp: int) -> Dict[str, torch.Tensor]:
    """{name: fp32 value} of the computed buffers GPT-NeoX's checkpoints hold in a slot of this kind."""
    if kind == EMBEDDING and config.pos_emb == "sinusoidal":
        return {"position_embeddings.inv_freq": sinusoidal_inv_freq(config.hidden_size)}
    entries = {}
    if kind == LAYER and config.pos_emb == "alibi":
        local = config.num_attention_heads // tp
        entries["attention.alibi_embed.slopes"] = alibi_slopes(config.num_attention_heads)[
            tp_rank * local:(tp_rank + 1) * local]
    if kind == LAYER and config.pos_emb == "rotary" and config.rotary_save_freqs_buffer:
        entries["attention.rotary_emb.inv_freq"] = _rotary_inv_freq(config)
    return entries


def _tied_norm(kind: str, config: ModelConfig) -> bool:
    return kind == LAYER and config.gpt_j_residual and config.gpt_j_tied


def _summed_biases(kind: str, config: ModelConfig, tp: int) -> bool:
    return kind == LAYER and config.gpt_j_residual and tp > 1


def to_neox(kind: str, state: Mapping[str, torch.Tensor], config: ModelConfig, tp_rank: int = 0,
            tp: int = 1) -> Dict[str, torch.Tensor]:
    """A slot's parameters (``state``) with the entries GPT-NeoX's checkpoint of that slot also holds."""
    out = dict(state)
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    for name, value in computed_entries(kind, config, tp_rank, tp).items():
        out[name] = value.to(dtype)
    if _tied_norm(kind, config):
        for name, value in state.items():
            if name.startswith("input_layernorm."):
                out["post_attention_layernorm." + name[len("input_layernorm."):]] = value.detach().clone()
    if _summed_biases(kind, config, tp):
        for name in SUMMED_BIASES:
            if name in out:
                out[name] = out[name].detach() / tp
    if kind == GMLP_LAYER and "input_linear.weight" in state:
        out["input_linear.bias"] = torch.zeros(state["input_linear.weight"].size(0), dtype=dtype)
        out["output_linear.bias"] = torch.zeros(config.hidden_size, dtype=dtype)
    return out


def from_neox(kind: str, state: Mapping[str, torch.Tensor], config: ModelConfig, tp_rank: int = 0, tp: int = 1,
              source: str = "the checkpoint", prefix: str = "") -> Dict[str, torch.Tensor]:
    """This model's parameters from a GPT-NeoX slot state dict (see the module docstring); LayoutError for an
    entry this model cannot take (``source`` and ``prefix``, the slot's key prefix, name it)."""
    out = dict(state)
    expected = computed_entries(kind, config, tp_rank, tp)
    if kind == LAYER and config.pos_emb == "rotary":
        expected["attention.rotary_emb.inv_freq"] = _rotary_inv_freq(config)
    for name, ours in expected.items():
        saved = out.pop(name, None)
        if saved is None:
            continue
        if saved.shape != ours.shape:
            raise LayoutError(f"{source}: {prefix}{name} has shape {tuple(saved.shape)}, this model's "
                              f"{tuple(ours.shape)}: {_WHAT[name]} of the config differ from the checkpoint's")
        if not torch.allclose(saved.float().cpu(), ours, rtol=1e-2, atol=0) and not _unscaled_rotary(name, saved,
                                                                                                    config):
            raise LayoutError(f"{source}: {prefix}{name} holds other values than this model computes: "
                              f"{_WHAT[name]} of the config differ from the checkpoint's")
    if _tied_norm(kind, config):
        for name in [n for n in out if n.startswith("post_attention_layernorm.")]:
            del out[name]
    if kind == GMLP_LAYER:
        for name in UNUSED_GMLP_BIASES:
            out.pop(name, None)
    if _summed_biases(kind, config, tp):
        for name in SUMMED_BIASES:
            if name in out:
                out[name] = out[name] * tp
    if any(name.startswith("attention.qk_layernorm.") for name in out):
        raise LayoutError(f"{source} has GPT-NeoX's {prefix}attention.qk_layernorm (one norm over [heads, head_dim] "
                          f"shared by queries and keys), which this model's use_qk_layernorm (separate q_norm / "
                          f"k_norm over head_dim) cannot represent")
    for norm in _NORMS.get(kind, ()):
        where = prefix + norm
        if config.norm == "rmsnorm" and config.use_bias_in_norms and norm + "scale" in out \
                and norm + "offset" not in out:
            out[norm + "offset"] = torch.zeros_like(out[norm + "scale"])
        if config.norm == "layernorm" and not config.use_bias_in_norms and norm + "bias" in out:
            if torch.count_nonzero(out[norm + "bias"]).item():
                raise LayoutError(f"{source}: {where}bias is a non-zero LayerNorm bias (GPT-NeoX's LayerNorm always "
                                  f"has one) but this model's norms have none: set use_bias_in_norms: true")
            del out[norm + "bias"]
    return out


def _save_hook(kind: str, config: ModelConfig, tp_rank: int, tp: int, module: nn.Module, state_dict,
               prefix: str, local_metadata) -> None:
    local = {key[len(prefix):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
    state_dict.update({prefix + k: v for k, v in to_neox(kind, local, config, tp_rank, tp).items()})


def _load_hook(kind: str, config: ModelConfig, tp_rank: int, tp: int, module: nn.Module, state_dict, prefix: str,
               *_) -> None:
    local = {key[len(prefix):]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
    params = from_neox(kind, local, config, tp_rank, tp, prefix=prefix)
    state_dict.update({prefix + k: v for k, v in params.items()})


def install_hooks(module: nn.Module, kind: str, config: ModelConfig, parallel_state) -> None:
    """Make ``module`` (the slot of that kind) save GPT-NeoX's entries and load GPT-NeoX's checkpoints."""
    args = (kind, config, parallel_state.get_model_parallel_rank(), parallel_state.get_model_parallel_world_size())
    module.register_state_dict_post_hook(functools.partial(_save_hook, *args))
    module.register_load_state_dict_pre_hook(functools.partial(_load_hook, *args))
