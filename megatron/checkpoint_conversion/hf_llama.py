"""Our GPT <-> Hugging Face LlamaForCausalLM / MistralForCausalLM (RMSNorm, SwiGLU, rotary, no parallel
residual).

Attention: our fused QKV rows are grouped per kv head, [K, G + 2, head_dim, hidden] (the G query heads of
the group, its key head, its value head); Llama keeps separate q/k/v projections whose query head
g * G + j uses kv head g — the same grouping, so q, k and v are slices of that view. MLP: our fused
first projection is [up | gate] with act(gate) * up; Llama has gate_proj, up_proj and down_proj. The
width rule of gated MLPs (megatron/model/mlp.py) gives Llama's intermediate_size I back from
intermediate_size = 3 * I with mlp_multiple_of = 1. Mistral's sliding_window W lets a query see W keys
(itself included); our sliding_window_width w lets it see w + 1, so W = w + 1.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from megatron.checkpoint_conversion.common import (
    common_problems,
    head_dim,
    refuse_unrepresentable,
    rope_parameters,
    rope_settings,
    take,
    transformers_module,
)
from megatron.checkpoint_conversion.errors import ConversionError

ARCHITECTURES = ("llama", "mistral")


def llama_problems(args: Mapping[str, Any], architecture: str) -> list:
    """What Llama/Mistral cannot represent about a model with NeoXArgs ``args``."""
    problems = common_problems(args)
    if (args.get("norm") or "layernorm") != "rmsnorm":
        problems.append(f"norm={args.get('norm')!r}: {architecture} needs rmsnorm (layernorm models: "
                        f"--architecture neox)")
    if args.get("use_bias_in_norms", True):
        problems.append("use_bias_in_norms=true: Llama's RMSNorm has no bias")
    if (args.get("activation") or "gelu") != "swiglu":
        problems.append(f"activation={args.get('activation')!r}: {architecture} needs swiglu")
    if args.get("gpt_j_residual"):
        problems.append(f"gpt_j_residual=true: {architecture} has no parallel residual")
    if float(args.get("rotary_pct", 1.0)) != 1.0:
        problems.append(f"rotary_pct={args.get('rotary_pct')}: {architecture} rotates whole heads (rotary_pct 1)")
    if architecture == "mistral":
        for flag in ("use_bias_in_attn_linear", "use_bias_in_mlp"):
            if args.get(flag, True):
                problems.append(f"{flag}=true: Mistral has no linear biases (use --architecture llama)")
    elif args.get("sliding_window_width") is not None:
        problems.append("sliding_window_width: Llama has no sliding window (use --architecture mistral)")
    return problems


def _split_qkv(qkv: torch.Tensor, kv_heads: int, group: int, d: int) -> Tuple[torch.Tensor, ...]:
    view = qkv.reshape(kv_heads, group + 2, d, *qkv.shape[1:])
    rest = tuple(qkv.shape[1:])
    return (view[:, :group].reshape(kv_heads * group * d, *rest), view[:, group].reshape(kv_heads * d, *rest),
            view[:, group + 1].reshape(kv_heads * d, *rest))


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, group: int, d: int) -> torch.Tensor:
    rest = tuple(q.shape[1:])
    parts = (q.reshape(kv_heads, group, d, *rest), k.reshape(kv_heads, 1, d, *rest), v.reshape(kv_heads, 1, d, *rest))
    return torch.cat(parts, dim=1).reshape(kv_heads * (group + 2) * d, *rest)


def to_hf(args: Mapping[str, Any], state: Mapping[str, torch.Tensor],
          architecture: str = "llama") -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(LlamaConfig or MistralConfig, its state dict) of our merged ``state``."""
    transformers = transformers_module()
    LlamaConfig, MistralConfig = transformers.LlamaConfig, transformers.MistralConfig

    refuse_unrepresentable(f"{architecture.capitalize()}ForCausalLM", llama_problems(args, architecture))
    heads = int(args["num_attention_heads"])
    kv_heads = int(args.get("num_kv_heads") or heads)
    group, d = heads // kv_heads, head_dim(args)
    tied = not args.get("no_weight_tying", False)
    src = "the checkpoint"
    hf: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": take(state, "embedding.word_embeddings.weight", src)}
    layers = int(args["num_layers"])
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            name = f"{ours}attention.query_key_value.{kind}"
            if name in state:
                q, k, v = _split_qkv(state[name], kv_heads, group, d)
                hf.update({f"{theirs}self_attn.q_proj.{kind}": q, f"{theirs}self_attn.k_proj.{kind}": k,
                           f"{theirs}self_attn.v_proj.{kind}": v})
            if f"{ours}attention.dense.{kind}" in state:
                hf[f"{theirs}self_attn.o_proj.{kind}"] = state[f"{ours}attention.dense.{kind}"]
            if f"{ours}mlp.linear1.{kind}" in state:
                up, gate = state[f"{ours}mlp.linear1.{kind}"].chunk(2, dim=0)
                hf[f"{theirs}mlp.up_proj.{kind}"], hf[f"{theirs}mlp.gate_proj.{kind}"] = up, gate
            if f"{ours}mlp.linear2.{kind}" in state:
                hf[f"{theirs}mlp.down_proj.{kind}"] = state[f"{ours}mlp.linear2.{kind}"]
        hf[f"{theirs}input_layernorm.weight"] = take(state, f"{ours}input_layernorm.weight", src)
        hf[f"{theirs}post_attention_layernorm.weight"] = take(state, f"{ours}post_attention_layernorm.weight", src)
    hf["model.norm.weight"] = take(state, "final_norm.norm.weight", src)
    if not tied:
        hf["lm_head.weight"] = take(state, "head.final_linear.weight", src)
    vocab, hidden = hf["model.embed_tokens.weight"].shape
    common = dict(
        vocab_size=int(vocab), hidden_size=int(hidden), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=d, hidden_act="silu",
        intermediate_size=int(take(state, "layers.0.mlp.linear2.weight", src).shape[1]),
        max_position_embeddings=int(args.get("max_position_embeddings") or args["seq_length"]),
        rms_norm_eps=float(args.get("rms_norm_epsilon", 1e-8)),
        rope_parameters=rope_parameters(float(args.get("rotary_emb_base", 10000))),
        rope_theta=float(args.get("rotary_emb_base", 10000)),
        tie_word_embeddings=tied, initializer_range=float(args.get("init_method_std", 0.02)),
        attention_dropout=0.0, bos_token_id=None, eos_token_id=None)
    if architecture == "mistral":
        window = args.get("sliding_window_width")
        return MistralConfig(**common, sliding_window=None if window is None else int(window) + 1), hf
    return LlamaConfig(**common, attention_bias=bool(args.get("use_bias_in_attn_linear", True)),
                       mlp_bias=bool(args.get("use_bias_in_mlp", True))), hf


def from_hf(config: Any, hf: Mapping[str, torch.Tensor]) -> Tuple[Dict[str, Any], Dict[str, torch.Tensor]]:
    """(our model arguments, our merged state dict) of a LlamaForCausalLM or MistralForCausalLM."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act={config.hidden_act!r}: only silu (SwiGLU) converts")
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    d = int(getattr(config, "head_dim", None) or hidden // heads)
    if d * heads != hidden:
        raise ConversionError(f"config.json head_dim={d} x num_attention_heads={heads} != hidden_size={hidden}; "
                              f"this framework needs head_dim = hidden_size / num_attention_heads")
    theta, pct = rope_settings(config)
    if pct != 1.0:
        raise ConversionError(f"config.json partial_rotary_factor={pct}: Llama conversion needs 1.0")
    if theta != int(theta):
        raise ConversionError(f"config.json rope_theta={theta} is not an integer (rotary_emb_base is an int here)")
    group = heads // kv_heads
    layers = int(config.num_hidden_layers)
    src = "the Hugging Face weights"
    state: Dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": take(hf, "model.embed_tokens.weight", src)}
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            if f"{theirs}q_proj.{kind}" in hf:
                q, k, v = (take(hf, f"{theirs}{p}_proj.{kind}", src) for p in "qkv")
                state[f"{ours}attention.query_key_value.{kind}"] = _fuse_qkv(q, k, v, kv_heads, group, d)
            if f"{theirs}o_proj.{kind}" in hf:
                state[f"{ours}attention.dense.{kind}"] = hf[f"{theirs}o_proj.{kind}"]
            mlp = f"model.layers.{i}.mlp."
            if f"{mlp}up_proj.{kind}" in hf:
                state[f"{ours}mlp.linear1.{kind}"] = torch.cat(
                    (hf[f"{mlp}up_proj.{kind}"], take(hf, f"{mlp}gate_proj.{kind}", src)), dim=0)
            if f"{mlp}down_proj.{kind}" in hf:
                state[f"{ours}mlp.linear2.{kind}"] = hf[f"{mlp}down_proj.{kind}"]
        state[f"{ours}input_layernorm.weight"] = take(hf, f"model.layers.{i}.input_layernorm.weight", src)
        state[f"{ours}post_attention_layernorm.weight"] = take(hf, f"model.layers.{i}.post_attention_layernorm.weight",
                                                               src)
    state["final_norm.norm.weight"] = take(hf, "model.norm.weight", src)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if not tied:
        state["head.final_linear.weight"] = take(hf, "lm_head.weight", src)
    args: Dict[str, Any] = {
        "num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "intermediate_size": 3 * int(config.intermediate_size), "mlp_multiple_of": 1, "activation": "swiglu",
        "norm": "rmsnorm", "rms_norm_epsilon": float(config.rms_norm_eps), "pos_emb": "rotary", "rotary_pct": 1.0,
        "rotary_emb_base": int(theta), "gpt_j_residual": False, "no_weight_tying": not tied,
        "use_bias_in_norms": False, "use_bias_in_attn_linear": bool(getattr(config, "attention_bias", False)),
        "use_bias_in_mlp": bool(getattr(config, "mlp_bias", False)),
        "max_position_embeddings": int(config.max_position_embeddings),
    }
    if kv_heads != heads:
        args["num_kv_heads"] = kv_heads
    window = getattr(config, "sliding_window", None) if getattr(config, "model_type", "") == "mistral" else None
    if window is not None and int(window) < int(config.max_position_embeddings):
        args["sliding_window_width"] = int(window) - 1
    return args, state
