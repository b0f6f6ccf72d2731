"""Our GPT <-> Hugging Face GPTNeoXForCausalLM (a reward model's value head: GPTNeoXForSequenceClassification's
`score`, num_labels 1).

The fused QKV layout of multi-head attention (per head [q | k | v]) and the rotate-half rotary on the
first rotary_pct of each head are GPTNeoX's own, so tensors convert by renaming. GPT-J parallel residual
is ``use_parallel_residual``; with gpt_j_tied the single input norm is written as both of GPTNeoX's
norms (GPTNeoX applies its second norm to the same layer input, so the result is identical). GPTNeoX has
no grouped-query attention, no RMSNorm and always has MLP and norm biases: such models go to Llama.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from megatron.checkpoint_conversion.common import (common_problems, moe_refusal, refuse_unrepresentable,
                                                   rope_parameters, rope_scaling_from_hf, rope_settings, take,
                                                   transformers_module)
from megatron.errors import ConversionError
from megatron.model.config import ModelConfig

ACTIVATIONS_TO_HF = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu", "mish": "mish"}
ACTIVATIONS_FROM_HF = {"gelu": "gelu", "relu": "relu", "silu": "silu", "swish": "silu", "mish": "mish"}
HEAD_NAMES = ("embed_out.weight", "lm_head.weight")
_LAYER_RENAMES = (("input_layernorm.", "input_layernorm."),
                  ("post_attention_layernorm.", "post_attention_layernorm."),
                  ("attention.query_key_value.", "attention.query_key_value."),
                  ("attention.dense.", "attention.dense."),
                  ("mlp.linear1.", "mlp.dense_h_to_4h."), ("mlp.linear2.", "mlp.dense_4h_to_h."))


def gptneox_problems(config: ModelConfig) -> list:
    """What GPTNeoXForCausalLM cannot represent about the model ``config``."""
    problems = common_problems(config) + moe_refusal(config)
    if config.norm != "layernorm":
        problems.append(f"norm={config.norm!r}: GPTNeoX uses LayerNorm (rmsnorm models: --architecture llama)")
    if not config.use_bias_in_norms:
        problems.append("use_bias_in_norms=false: GPTNeoX's LayerNorms have biases")
    if config.qkv_bias != config.use_bias_in_attn_linear:
        problems.append(f"use_bias_in_qkv={str(config.qkv_bias).lower()} with use_bias_in_attn_linear="
                        f"{str(config.use_bias_in_attn_linear).lower()}: GPTNeoX's attention_bias sets the query / "
                        f"key / value and output biases together (q/k/v biases only: --architecture qwen2)")
    if not config.use_bias_in_mlp:
        problems.append("use_bias_in_mlp=false: GPTNeoX's MLP has biases (bias-free models: --architecture llama)")
    if config.activation not in ACTIVATIONS_TO_HF:
        problems.append(f"activation={config.activation!r}: GPTNeoX takes {sorted(ACTIVATIONS_TO_HF)} "
                        f"(swiglu models: --architecture llama)")
    if config.kv_heads != config.num_attention_heads:
        problems.append(f"num_kv_heads={config.num_kv_heads}: GPTNeoX has no grouped-query attention (use "
                        f"--architecture llama)")
    if config.sliding_window_width is not None:
        problems.append("sliding_window_width: GPTNeoX has no sliding-window attention")
    return problems


def to_hf(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(GPTNeoXConfig, GPTNeoX state dict) of the model ``config`` with merged ``state`` (flat names)."""
    GPTNeoXConfig = transformers_module().GPTNeoXConfig

    refuse_unrepresentable("GPTNeoXForCausalLM", gptneox_problems(config))
    layers = config.num_layers
    gpt_j_tied = config.gpt_j_residual and config.gpt_j_tied
    src = "the checkpoint"
    hf: Dict[str, torch.Tensor] = {"gpt_neox.embed_in.weight": take(state, "embedding.word_embeddings.weight", src)}
    for i in range(layers):
        for ours, theirs in _LAYER_RENAMES:
            for kind in ("weight", "bias"):
                name = f"layers.{i}.{ours}{kind}"
                if gpt_j_tied and ours.startswith("post_attention_layernorm"):
                    name = f"layers.{i}.input_layernorm.{kind}"
                if name in state:
                    hf[f"gpt_neox.layers.{i}.{theirs}{kind}"] = state[name]
    hf["gpt_neox.final_layer_norm.weight"] = take(state, "final_norm.norm.weight", src)
    hf["gpt_neox.final_layer_norm.bias"] = take(state, "final_norm.norm.bias", src)
    if config.value_head:
        hf["score.weight"] = take(state, "head.value_head.weight", src)
    elif not config.tied_embeddings:
        hf["embed_out.weight"] = take(state, "head.final_linear.weight", src)
    vocab, hidden = hf["gpt_neox.embed_in.weight"].shape
    hf_config = GPTNeoXConfig(
        vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=int(take(state, "layers.0.mlp.linear1.weight", src).shape[0]),
        hidden_act=ACTIVATIONS_TO_HF[config.activation], max_position_embeddings=config.positions,
        layer_norm_eps=float(config.layernorm_epsilon), use_parallel_residual=config.gpt_j_residual,
        rope_parameters=rope_parameters(float(config.rotary_emb_base), float(config.rotary_pct),
                                        config.rope_scaling_dict),
        rotary_pct=float(config.rotary_pct), rotary_emb_base=int(config.rotary_emb_base),
        attention_bias=config.use_bias_in_attn_linear, tie_word_embeddings=config.tied_embeddings,
        initializer_range=float(config.init_method_std), attention_dropout=0.0, hidden_dropout=0.0,
        bos_token_id=None, eos_token_id=None, **({"num_labels": 1} if config.value_head else {}))
    return hf_config, hf


def from_hf(hf_config: Any, hf: Mapping[str, torch.Tensor]) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """(our ModelConfig, our merged state dict) of a GPTNeoXForCausalLM."""
    act = getattr(hf_config, "hidden_act", "gelu")
    if act not in ACTIVATIONS_FROM_HF:
        raise ConversionError(f"config.json hidden_act={act!r} is not supported; this framework has "
                              f"{sorted(ACTIVATIONS_FROM_HF)} (its gelu is the exact erf form)")
    theta, pct = rope_settings(hf_config)
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta={theta} is not an integer (rotary_emb_base is an int here)")
    if int(hf_config.hidden_size) % int(hf_config.num_attention_heads):
        raise ConversionError("config.json hidden_size is not divisible by num_attention_heads")
    layers = int(hf_config.num_hidden_layers)
    src = "the Hugging Face weights"
    state: Dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": take(hf, "gpt_neox.embed_in.weight", src)}
    for i in range(layers):
        for ours, theirs in _LAYER_RENAMES:
            for kind in ("weight", "bias"):
                name = f"gpt_neox.layers.{i}.{theirs}{kind}"
                if name in hf:
                    state[f"layers.{i}.{ours}{kind}"] = hf[name]
    state["final_norm.norm.weight"] = take(hf, "gpt_neox.final_layer_norm.weight", src)
    state["final_norm.norm.bias"] = take(hf, "gpt_neox.final_layer_norm.bias", src)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if not tied:
        head = next((hf[n] for n in HEAD_NAMES if n in hf), None)
        if head is None:
            raise ConversionError(f"{src} have no output head ({' or '.join(HEAD_NAMES)}) and "
                                  f"tie_word_embeddings is false")
        state["head.final_linear.weight"] = head
    config = ModelConfig(
        num_layers=layers, hidden_size=int(hf_config.hidden_size),
        num_attention_heads=int(hf_config.num_attention_heads), seq_length=int(hf_config.max_position_embeddings),
        max_position_embeddings=int(hf_config.max_position_embeddings),
        padded_vocab_size=int(state["embedding.word_embeddings.weight"].shape[0]),
        intermediate_size=int(hf_config.intermediate_size), mlp_multiple_of=1, activation=ACTIVATIONS_FROM_HF[act],
        norm="layernorm", layernorm_epsilon=float(hf_config.layer_norm_eps), pos_emb="rotary", rotary_pct=pct,
        rotary_emb_base=int(theta), gpt_j_residual=bool(getattr(hf_config, "use_parallel_residual", True)),
        gpt_j_tied=False, no_weight_tying=not tied, use_bias_in_norms=True, use_bias_in_mlp=True,
        use_bias_in_attn_linear=bool(getattr(hf_config, "attention_bias", True)),
        rope_scaling=rope_scaling_from_hf(hf_config))
    return config, state
