"""Our GPT <-> Hugging Face LlamaForCausalLM / MistralForCausalLM (RMSNorm, SwiGLU, rotary, no parallel
residual).

Attention: our fused QKV rows (GPT-NeoX's, megatron/model/attention.py) are [Q | K | V] with grouped-query
attention and per head [q | k | v] with multi-head attention; Llama keeps separate q/k/v projections whose
query head g * G + j uses kv head g — the same grouping, so q, k and v are the blocks (or per-head slices)
of the fused rows. MLP: our fused first projection is [up | gate] with act(gate) * up (GPT-NeoX's); Llama
has gate_proj, up_proj and down_proj. RMSNorm weights are GPT-NeoX's ``scale``. The
width rule of gated MLPs (megatron/model/mlp.py) gives Llama's intermediate_size I back from
intermediate_size = 3 * I with mlp_multiple_of = 1. Mistral's sliding_window W lets a query see W keys
(itself included); our sliding_window_width w lets it see w + 1, so W = w + 1.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from megatron.checkpoint_conversion.common import (
    common_problems,
    refuse_unrepresentable,
    rope_parameters,
    rope_settings,
    take,
    transformers_module,
)
from megatron.checkpoint_conversion.errors import ConversionError
from megatron.model_config import ModelConfig

ARCHITECTURES = ("llama", "mistral")


def llama_problems(config: ModelConfig, architecture: str) -> list:
    """What Llama/Mistral cannot represent about the model ``config``."""
    problems = common_problems(config)
    if config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r}: {architecture} needs rmsnorm (layernorm models: "
                        f"--architecture neox)")
    if config.use_bias_in_norms:
        problems.append("use_bias_in_norms=true: Llama's RMSNorm has no bias")
    if config.activation != "swiglu":
        problems.append(f"activation={config.activation!r}: {architecture} needs swiglu")
    if config.gpt_j_residual:
        problems.append(f"gpt_j_residual=true: {architecture} has no parallel residual")
    if float(config.rotary_pct) != 1.0:
        problems.append(f"rotary_pct={config.rotary_pct}: {architecture} rotates whole heads (rotary_pct 1)")
    if architecture == "mistral":
        for flag in ("use_bias_in_attn_linear", "use_bias_in_mlp"):
            if getattr(config, flag):
                problems.append(f"{flag}=true: Mistral has no linear biases (use --architecture llama)")
    elif config.sliding_window_width is not None:
        problems.append("sliding_window_width: Llama has no sliding window (use --architecture mistral)")
    return problems


def _split_qkv(qkv: torch.Tensor, config: ModelConfig) -> Tuple[torch.Tensor, ...]:
    heads, kv, d = config.num_attention_heads, config.kv_heads, config.head_dim
    rest = tuple(qkv.shape[1:])
    if kv == heads:  # per head [q | k | v]
        view = qkv.reshape(heads, 3, d, *rest)
        return tuple(view[:, i].reshape(heads * d, *rest) for i in range(3))
    return tuple(qkv.split([heads * d, kv * d, kv * d]))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    heads, kv, d = config.num_attention_heads, config.kv_heads, config.head_dim
    if kv == heads:
        rest = tuple(q.shape[1:])
        return torch.stack([t.reshape(heads, d, *rest) for t in (q, k, v)], dim=1).reshape(3 * heads * d, *rest)
    return torch.cat((q, k, v))


def to_hf(config: ModelConfig, state: Mapping[str, torch.Tensor],
          architecture: str = "llama") -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(LlamaConfig or MistralConfig, its state dict) of the model ``config`` with merged ``state``."""
    transformers = transformers_module()
    LlamaConfig, MistralConfig = transformers.LlamaConfig, transformers.MistralConfig

    refuse_unrepresentable(f"{architecture.capitalize()}ForCausalLM", llama_problems(config, architecture))
    src = "the checkpoint"
    hf: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": take(state, "embedding.word_embeddings.weight", src)}
    layers = config.num_layers
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            name = f"{ours}attention.query_key_value.{kind}"
            if name in state:
                q, k, v = _split_qkv(state[name], config)
                hf.update({f"{theirs}self_attn.q_proj.{kind}": q, f"{theirs}self_attn.k_proj.{kind}": k,
                           f"{theirs}self_attn.v_proj.{kind}": v})
            if f"{ours}attention.dense.{kind}" in state:
                hf[f"{theirs}self_attn.o_proj.{kind}"] = state[f"{ours}attention.dense.{kind}"]
            if f"{ours}mlp.linear1.{kind}" in state:
                up, gate = state[f"{ours}mlp.linear1.{kind}"].chunk(2, dim=0)
                hf[f"{theirs}mlp.up_proj.{kind}"], hf[f"{theirs}mlp.gate_proj.{kind}"] = up, gate
            if f"{ours}mlp.linear2.{kind}" in state:
                hf[f"{theirs}mlp.down_proj.{kind}"] = state[f"{ours}mlp.linear2.{kind}"]
        hf[f"{theirs}input_layernorm.weight"] = take(state, f"{ours}input_layernorm.scale", src)
        hf[f"{theirs}post_attention_layernorm.weight"] = take(state, f"{ours}post_attention_layernorm.scale", src)
    hf["model.norm.weight"] = take(state, "final_norm.norm.scale", src)
    if not config.tied_embeddings:
        hf["lm_head.weight"] = take(state, "head.final_linear.weight", src)
    vocab, hidden = hf["model.embed_tokens.weight"].shape
    common = dict(
        vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, hidden_act="silu",
        intermediate_size=int(take(state, "layers.0.mlp.linear2.weight", src).shape[1]),
        max_position_embeddings=config.positions, rms_norm_eps=float(config.rms_norm_epsilon),
        rope_parameters=rope_parameters(float(config.rotary_emb_base)), rope_theta=float(config.rotary_emb_base),
        tie_word_embeddings=config.tied_embeddings, initializer_range=float(config.init_method_std),
        attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
    if architecture == "mistral":
        window = config.sliding_window_width
        return MistralConfig(**common, sliding_window=None if window is None else int(window) + 1), hf
    return LlamaConfig(**common, attention_bias=config.use_bias_in_attn_linear, mlp_bias=config.use_bias_in_mlp), hf


def from_hf(hf_config: Any, hf: Mapping[str, torch.Tensor]) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """(our ModelConfig, our merged state dict) of a LlamaForCausalLM or MistralForCausalLM."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act={hf_config.hidden_act!r}: only silu (SwiGLU) converts")
    heads, hidden = int(hf_config.num_attention_heads), int(hf_config.hidden_size)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    d = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    if d * heads != hidden:
        raise ConversionError(f"config.json head_dim={d} x num_attention_heads={heads} != hidden_size={hidden}; "
                              f"this framework needs head_dim = hidden_size / num_attention_heads")
    theta, pct = rope_settings(hf_config)
    if pct != 1.0:
        raise ConversionError(f"config.json partial_rotary_factor={pct}: Llama conversion needs 1.0")
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta={theta} is not an integer (rotary_emb_base is an int here)")
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "model_type", "") == "mistral" else None
    positions = int(hf_config.max_position_embeddings)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    layers = int(hf_config.num_hidden_layers)
    src = "the Hugging Face weights"
    vocab = take(hf, "model.embed_tokens.weight", src)
    config = ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=positions,
        max_position_embeddings=positions, padded_vocab_size=int(vocab.shape[0]),
        num_kv_heads=kv_heads if kv_heads != heads else None, intermediate_size=3 * int(hf_config.intermediate_size),
        mlp_multiple_of=1, activation="swiglu", norm="rmsnorm", rms_norm_epsilon=float(hf_config.rms_norm_eps),
        pos_emb="rotary", rotary_pct=1.0, rotary_emb_base=int(theta), gpt_j_residual=False, no_weight_tying=not tied,
        use_bias_in_norms=False, use_bias_in_attn_linear=bool(getattr(hf_config, "attention_bias", False)),
        use_bias_in_mlp=bool(getattr(hf_config, "mlp_bias", False)),
        sliding_window_width=int(window) - 1 if window is not None and int(window) < positions else None)
    state: Dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": vocab}
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            if f"{theirs}q_proj.{kind}" in hf:
                q, k, v = (take(hf, f"{theirs}{p}_proj.{kind}", src) for p in "qkv")
                state[f"{ours}attention.query_key_value.{kind}"] = _fuse_qkv(q, k, v, config)
            if f"{theirs}o_proj.{kind}" in hf:
                state[f"{ours}attention.dense.{kind}"] = hf[f"{theirs}o_proj.{kind}"]
            mlp = f"model.layers.{i}.mlp."
            if f"{mlp}up_proj.{kind}" in hf:
                state[f"{ours}mlp.linear1.{kind}"] = torch.cat(
                    (hf[f"{mlp}up_proj.{kind}"], take(hf, f"{mlp}gate_proj.{kind}", src)), dim=0)
            if f"{mlp}down_proj.{kind}" in hf:
                state[f"{ours}mlp.linear2.{kind}"] = hf[f"{mlp}down_proj.{kind}"]
        state[f"{ours}input_layernorm.scale"] = take(hf, f"model.layers.{i}.input_layernorm.weight", src)
        state[f"{ours}post_attention_layernorm.scale"] = take(hf, f"model.layers.{i}.post_attention_layernorm.weight",
                                                              src)
    state["final_norm.norm.scale"] = take(hf, "model.norm.weight", src)
    if not tied:
        state["head.final_linear.weight"] = take(hf, "lm_head.weight", src)
    return config, state
