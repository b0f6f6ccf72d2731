"""Our GPT <-> Hugging Face LlamaForCausalLM / MistralForCausalLM / MixtralForCausalLM / Qwen2ForCausalLM (RMSNorm,
SwiGLU, rotary, no parallel residual; Qwen2: biases on q, k and v only, our use_bias_in_qkv) and OlmoForCausalLM
(the same with LayerNorms without weight or bias: our norm non_parametric_layernorm, epsilon 1e-5).

Attention: our fused QKV rows (GPT-NeoX's, megatron/model/attention.py) are [Q | K | V] with grouped-query
attention and per head [q | k | v] with multi-head attention; Llama keeps separate q/k/v projections whose
query head g * G + j uses kv head g — the same grouping, so q, k and v are the blocks (or per-head slices)
of the fused rows. MLP: our fused first projection is [up | gate] with act(gate) * up (GPT-NeoX's); Llama
has gate_proj, up_proj and down_proj. RMSNorm weights are GPT-NeoX's ``scale``. The
width rule of gated MLPs (megatron/model/mlp.py) gives Llama's intermediate_size I back from
intermediate_size = 3 * I with mlp_multiple_of = 1. Mistral's sliding_window W lets a query see W keys
(itself included); our sliding_window_width w lets it see w + 1, so W = w + 1.

Mixtral: a dropless mixture of experts (moe_type megablocks) in every layer, routed by softmax, top-k and the
k weights renormalised (our topk router with moe_top_k >= 2; top-1 Mixtral weights a token's expert by 1, ours
by its probability, so top-1 is refused). ``block_sparse_moe.gate`` is our ``mlp.router.layer``; expert e's
``w1`` / ``w3`` are rows e*F .. (e+1)*F of our stacked ``experts.mlp.w1`` / ``w3`` and its ``w2`` the transpose
of those rows of ``w2`` (the names save_pretrained writes; transformers 5 fuses them when loading). Training
differs in two details the weights do not carry: Mixtral's jitter also scales the experts' input (ours the
router's only) and its auxiliary loss sums over the k choices; router_aux_loss_coef and router_jitter_noise are
carried as moe_loss_coeff and moe_jitter_eps as they are.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from megatron.checkpoint_conversion.common import (common_problems, moe_refusal, refuse_unrepresentable,
                                                   rope_parameters, rope_scaling_from_hf, rope_settings, take,
                                                   transformers_module)
from megatron.errors import ConversionError
from megatron.model.config import ModelConfig

ARCHITECTURES = ("llama", "mistral", "mixtral", "qwen2", "olmo")
OLMO_EPSILON = 1e-5
"""OlmoLayerNorm's epsilon (fixed in transformers, not a config value)."""


def llama_problems(config: ModelConfig, architecture: str) -> list:
    """What Llama/Mistral/Mixtral cannot represent about the model ``config``."""
    problems = common_problems(config)
    if architecture == "mixtral":
        problems += mixtral_problems(config)
    else:
        problems += moe_refusal(config)
    if architecture == "olmo":
        problems += olmo_norm_problems(config)
    elif config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r}: {architecture} needs rmsnorm (layernorm models: --architecture "
                        f"neox; non_parametric_layernorm: --architecture olmo)")
    elif config.use_bias_in_norms:
        problems.append("use_bias_in_norms=true: Llama's RMSNorm has no bias")
    if config.activation != "swiglu" and not (architecture == "mixtral" and config.expert_activation == "swiglu"):
        problems.append(f"activation={config.activation!r}: {architecture} needs swiglu")
    if config.gpt_j_residual:
        problems.append(f"gpt_j_residual=true: {architecture} has no parallel residual")
    if float(config.rotary_pct) != 1.0:
        problems.append(f"rotary_pct={config.rotary_pct}: {architecture} rotates whole heads (rotary_pct 1)")
    if architecture in ("mistral", "mixtral"):
        for flag in ("use_bias_in_attn_linear", "use_bias_in_mlp"):
            if getattr(config, flag):
                problems.append(f"{flag}=true: {architecture.capitalize()} has no linear biases")
        if config.qkv_bias and not config.use_bias_in_attn_linear:
            problems.append(f"use_bias_in_qkv=true: {architecture.capitalize()} has no linear biases (q/k/v biases: "
                            f"--architecture qwen2)")
    elif architecture == "qwen2":
        problems += qwen2_problems(config)
    else:  # llama, olmo: attention_bias sets q, k, v and o together
        if architecture == "olmo" and config.use_bias_in_mlp:
            problems.append("use_bias_in_mlp=true: OLMo's MLP has no biases")
        if config.qkv_bias != config.use_bias_in_attn_linear:
            problems.append(f"use_bias_in_qkv={str(config.qkv_bias).lower()} with use_bias_in_attn_linear="
                            f"{str(config.use_bias_in_attn_linear).lower()}: Llama's attention_bias sets q, k, v and "
                            f"o together (q/k/v biases only: --architecture qwen2)")
        if config.sliding_window_width is not None:
            problems.append(f"sliding_window_width: {architecture.capitalize()} has no sliding window (use "
                            f"--architecture mistral)")
    return problems


def olmo_norm_problems(config: ModelConfig) -> list:
    """OLMo's norms are LayerNorms without weight or bias, epsilon 1e-5 (GPT-NeoX's non_parametric_layernorm)."""
    if config.norm != "non_parametric_layernorm":
        return [f"norm={config.norm!r}: OLMo's LayerNorms have no weight or bias (norm: non_parametric_layernorm)"]
    if float(config.layernorm_epsilon) != OLMO_EPSILON:
        return [f"layernorm_epsilon={config.layernorm_epsilon}: OLMo's LayerNorm epsilon is fixed at {OLMO_EPSILON}"]
    return []


def qwen2_problems(config: ModelConfig) -> list:
    """What Qwen2ForCausalLM cannot represent: it has biases on q, k and v and nowhere else, and (as converted
    here) no sliding window."""
    problems = []
    if not config.qkv_bias:
        problems.append("use_bias_in_qkv=false: Qwen2 has biases on q, k and v (bias-free models: --architecture "
                        "llama)")
    for flag in ("use_bias_in_attn_linear", "use_bias_in_mlp"):
        if getattr(config, flag):
            problems.append(f"{flag}=true: Qwen2's output projection and MLP have no biases (set {flag}: false; "
                            f"q/k/v biases: use_bias_in_qkv: true)")
    if config.sliding_window_width is not None:
        problems.append("sliding_window_width: Qwen2's sliding window (use_sliding_window, max_window_layers) is "
                        "not converted here")
    return problems


def mixtral_problems(config: ModelConfig) -> list:
    """What MixtralForCausalLM cannot represent about the model's experts."""
    if config.moe_num_experts <= 1:
        return ["moe_num_experts=1: Mixtral is a mixture of experts (dense models: --architecture llama / mistral)"]
    problems = []
    if config.moe_layers != tuple(range(config.num_layers)):
        problems.append(f"expert_interval={config.expert_interval}: every Mixtral layer is a mixture of experts "
                        f"(expert_interval 1)")
    if config.moe_type != "megablocks":
        problems.append(f"moe_type={config.moe_type!r}: Mixtral's experts are dropless (moe_type megablocks)")
    if config.moe_router_type != "topk":
        problems.append(f"moe_router_type={config.moe_router_type!r}: Mixtral routes by softmax top-k (topk)")
    if config.moe_top_k < 2:
        problems.append("moe_top_k=1: Mixtral renormalises the top-k weights (a top-1 token gets weight 1), this "
                        "model weights it by its probability")
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
    LlamaConfig, MistralConfig, MixtralConfig = (transformers.LlamaConfig, transformers.MistralConfig,
                                                 transformers.MixtralConfig)
    name = {"qwen2": "Qwen2"}.get(architecture, architecture.capitalize())
    olmo = architecture == "olmo"

    refuse_unrepresentable(f"{name}ForCausalLM", llama_problems(config, architecture))
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
        if architecture == "mixtral":
            hf.update(_experts_to_hf(state, ours, theirs, config, src))
        if not olmo:  # OLMo's norms have no parameters
            hf[f"{theirs}input_layernorm.weight"] = take(state, f"{ours}input_layernorm.scale", src)
            hf[f"{theirs}post_attention_layernorm.weight"] = take(state, f"{ours}post_attention_layernorm.scale",
                                                                  src)
    if not olmo:
        hf["model.norm.weight"] = take(state, "final_norm.norm.scale", src)
    if config.value_head:
        hf["score.weight"] = take(state, "head.value_head.weight", src)
    elif not config.tied_embeddings:
        hf["lm_head.weight"] = take(state, "head.final_linear.weight", src)
    vocab, hidden = hf["model.embed_tokens.weight"].shape
    common = dict(
        vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, hidden_act="silu",
        intermediate_size=int(config.expert_ffn_width if architecture == "mixtral"
                              else take(state, "layers.0.mlp.linear2.weight", src).shape[1]),
        max_position_embeddings=config.positions, rms_norm_eps=float(config.rms_norm_epsilon),
        rope_parameters=rope_parameters(float(config.rotary_emb_base), scaling=config.rope_scaling_dict),
        rope_theta=float(config.rotary_emb_base),
        tie_word_embeddings=config.tied_embeddings, initializer_range=float(config.init_method_std),
        attention_dropout=0.0, bos_token_id=None, eos_token_id=None, **({"num_labels": 1} if config.value_head else {}))
    window = config.sliding_window_width
    if architecture == "mistral":
        return MistralConfig(**common, sliding_window=None if window is None else int(window) + 1), hf
    if architecture == "mixtral":
        return MixtralConfig(**common, sliding_window=None if window is None else int(window) + 1,
                             num_local_experts=config.moe_num_experts, num_experts_per_tok=config.moe_top_k,
                             router_aux_loss_coef=float(config.moe_loss_coeff),
                             router_jitter_noise=float(config.moe_jitter_eps or 0.0)), hf
    if architecture == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False), hf
    if olmo:
        del common["rms_norm_eps"]
        return transformers.OlmoConfig(**common, attention_bias=config.use_bias_in_attn_linear, clip_qkv=None), hf
    return LlamaConfig(**common, attention_bias=config.use_bias_in_attn_linear, mlp_bias=config.use_bias_in_mlp), hf


def from_hf(hf_config: Any, hf: Mapping[str, torch.Tensor]) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """(our ModelConfig, our merged state dict) of a LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM,
    Qwen2ForCausalLM or OlmoForCausalLM."""
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
    mixtral = getattr(hf_config, "model_type", "") == "mixtral"
    qwen2 = getattr(hf_config, "model_type", "") == "qwen2"
    olmo = getattr(hf_config, "model_type", "") == "olmo"
    if olmo and getattr(hf_config, "clip_qkv", None) is not None:
        raise ConversionError(f"config.json clip_qkv={hf_config.clip_qkv}: this model does not clamp q, k and v; "
                              f"only OLMo models without clip_qkv convert")
    norm = dict(norm="non_parametric_layernorm", layernorm_epsilon=OLMO_EPSILON) if olmo else dict(
        norm="rmsnorm", rms_norm_epsilon=float(hf_config.rms_norm_eps))
    if qwen2 and (getattr(hf_config, "use_sliding_window", False)
                  or "sliding_attention" in (getattr(hf_config, "layer_types", None) or ())):
        raise ConversionError("config.json use_sliding_window=true (Qwen2's sliding window on the layers from "
                              "max_window_layers on) is not converted here; only Qwen2 models with full attention")
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "model_type", "") in (
        "mistral", "mixtral") else None
    moe = {}
    if mixtral:
        moe = dict(moe_num_experts=int(hf_config.num_local_experts), moe_top_k=int(hf_config.num_experts_per_tok),
                   moe_type="megablocks", moe_router_type="topk", expert_interval=1,
                   moe_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0)),
                   moe_jitter_eps=float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0) or None)
        if moe["moe_top_k"] < 2:
            raise ConversionError("config.json num_experts_per_tok=1: Mixtral renormalises the top-k weights (weight "
                                  "1 for top-1); this framework's top-1 router weights by the probability")
    positions = int(hf_config.max_position_embeddings)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    layers = int(hf_config.num_hidden_layers)
    src = "the Hugging Face weights"
    vocab = take(hf, "model.embed_tokens.weight", src)
    config = ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=positions,
        max_position_embeddings=positions, padded_vocab_size=int(vocab.shape[0]),
        num_kv_heads=kv_heads if kv_heads != heads else None,
        intermediate_size=int(hf_config.intermediate_size) * (1 if mixtral else 3),
        mlp_multiple_of=1, activation="swiglu", **norm,
        pos_emb="rotary", rotary_pct=1.0, rotary_emb_base=int(theta), gpt_j_residual=False, no_weight_tying=not tied,
        use_bias_in_norms=False,
        use_bias_in_attn_linear=bool(getattr(hf_config, "attention_bias", False)) and not qwen2,
        use_bias_in_qkv=True if qwen2 else None, use_bias_in_mlp=bool(getattr(hf_config, "mlp_bias", False)),
        sliding_window_width=int(window) - 1 if window is not None and int(window) < positions else None,
        rope_scaling=rope_scaling_from_hf(hf_config), **moe)
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
        if mixtral:
            state.update(_experts_from_hf(hf, ours, f"model.layers.{i}.", config, src))
        if not olmo:
            state[f"{ours}input_layernorm.scale"] = take(hf, f"model.layers.{i}.input_layernorm.weight", src)
            state[f"{ours}post_attention_layernorm.scale"] = take(
                hf, f"model.layers.{i}.post_attention_layernorm.weight", src)
    if not olmo:
        state["final_norm.norm.scale"] = take(hf, "model.norm.weight", src)
    if not tied:
        state["head.final_linear.weight"] = take(hf, "lm_head.weight", src)
    return config, state


def _experts_to_hf(state: Mapping[str, torch.Tensor], ours: str, theirs: str, config: ModelConfig, src: str
                   ) -> Dict[str, torch.Tensor]:
    """One layer's router and experts under Mixtral's names (module docstring)."""
    width, moe = config.expert_ffn_width, f"{theirs}block_sparse_moe."
    out = {f"{moe}gate.weight": take(state, f"{ours}mlp.router.layer.weight", src)}
    stacked = {name: take(state, f"{ours}mlp.experts.mlp.{name}", src) for name in ("w1", "w2", "w3")}
    for e in range(config.moe_num_experts):
        rows = slice(e * width, (e + 1) * width)
        out[f"{moe}experts.{e}.w1.weight"] = stacked["w1"][rows]
        out[f"{moe}experts.{e}.w3.weight"] = stacked["w3"][rows]
        out[f"{moe}experts.{e}.w2.weight"] = stacked["w2"][rows].t().contiguous()
    return out


def _experts_from_hf(hf: Mapping[str, torch.Tensor], ours: str, theirs: str, config: ModelConfig, src: str
                     ) -> Dict[str, torch.Tensor]:
    """One Mixtral layer's gate and experts as our router and stacked experts."""
    moe = f"{theirs}block_sparse_moe."
    experts = range(config.moe_num_experts)
    return {f"{ours}mlp.router.layer.weight": take(hf, f"{moe}gate.weight", src),
            f"{ours}mlp.experts.mlp.w1": torch.cat([take(hf, f"{moe}experts.{e}.w1.weight", src) for e in experts]),
            f"{ours}mlp.experts.mlp.w3": torch.cat([take(hf, f"{moe}experts.{e}.w3.weight", src) for e in experts]),
            f"{ours}mlp.experts.mlp.w2": torch.cat([take(hf, f"{moe}experts.{e}.w2.weight", src).t()
                                                    for e in experts])}
