"""Our pure-Mamba GPT <-> Hugging Face MambaForCausalLM.

Both are the same function (megatron/model/mamba.py's docstring): pre-norm residual blocks around the
selective SSM mixer, RMSNorm (F.rms_norm's rsqrt(mean(x^2) + eps), Hugging Face's MambaRMSNorm), a final
RMSNorm and the output head, no position embeddings. The mixer's tensors have the same names, shapes and
layouts on both sides (in_proj's rows are [x | z], x_proj's [dt | B | C], conv1d [D, 1, K]); only the
prefixes differ (``layers.{i}.`` / ``backbone.layers.{i}.``, ``embedding.word_embeddings`` /
``backbone.embeddings``, ``final_norm.norm.scale`` / ``backbone.norm_f.weight``, ``head.final_linear`` /
``lm_head``) and our norms' ``scale`` is their ``weight``.

What each side cannot represent is refused: here the state size (16) and conv width (4) are fixed, and the
norm has no bias; Hugging Face's x_proj has no bias, so our mamba_use_bias_in_linears model converts only while
x_proj's bias is zero (which is what a Hugging Face model with use_bias=true becomes here). A Mamba model has
no context limit: the converted config gets seq_length = max_position_embeddings = ``SEQ_LENGTH``, which only
sets the training / generation length and can be changed freely.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import torch

from megatron.checkpoint_conversion.common import refuse_unrepresentable, take, transformers_module
from megatron.errors import ConversionError
from megatron.model.config import MAMBA_CONV_WIDTH, MAMBA_STATE_SIZE, ModelConfig

SEQ_LENGTH = 2048
"""seq_length of a model converted from Hugging Face (GPT-NeoX's Mamba configs' value; any length runs)."""
MIXER = ("A_log", "D", "in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias", "x_proj.weight",
         "dt_proj.weight", "dt_proj.bias", "out_proj.weight", "out_proj.bias")
"""The mixer tensors both sides have, by the same name (biases only where the settings add them)."""


def mamba_problems(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> List[str]:
    """What MambaForCausalLM cannot represent about the model ``config`` with merged ``state``."""
    problems = []
    if set(config.attention_types) != {"mamba"}:
        problems.append(f"attention_config {sorted(set(config.attention_types))}: MambaForCausalLM has only "
                        f"mamba layers")
    if config.norm != "rmsnorm":
        problems.append(f"norm={config.norm!r}: MambaForCausalLM needs rmsnorm")
    if config.use_bias_in_norms:
        problems.append("use_bias_in_norms=true: MambaForCausalLM's RMSNorm has no bias")
    if config.pos_emb != "none":
        problems.append(f"pos_emb={config.pos_emb!r}: MambaForCausalLM has no position embeddings (use 'none')")
    if config.soft_prompt_tokens is not None:
        problems.append("soft_prompt_tuning is enabled (the soft prompt has no Hugging Face equivalent)")
    for i in range(config.num_layers):
        bias = state.get(f"layers.{i}.mixer.x_proj.bias")
        if bias is not None and bool(bias.ne(0).any()):
            problems.append(f"layers.{i}.mixer.x_proj.bias is not zero: MambaForCausalLM's x_proj has no bias")
            break
    return problems


def to_hf(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> Tuple[Any, Dict[str, torch.Tensor]]:
    """(MambaConfig, its state dict) of the pure-Mamba model ``config`` with merged ``state``."""
    transformers = transformers_module()
    refuse_unrepresentable("MambaForCausalLM", mamba_problems(config, state))
    src = "the checkpoint"
    hf: Dict[str, torch.Tensor] = {"backbone.embeddings.weight": take(state, "embedding.word_embeddings.weight", src)}
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"backbone.layers.{i}."
        hf[f"{theirs}norm.weight"] = take(state, f"{ours}norm.scale", src)
        for name in MIXER:
            if f"{ours}mixer.{name}" in state:
                hf[f"{theirs}mixer.{name}"] = state[f"{ours}mixer.{name}"]
    hf["backbone.norm_f.weight"] = take(state, "final_norm.norm.scale", src)
    if not config.tied_embeddings:
        hf["lm_head.weight"] = take(state, "head.final_linear.weight", src)
    vocab, hidden = hf["backbone.embeddings.weight"].shape
    if config.mamba_inner % hidden:
        raise ConversionError(f"Mamba's inner width {config.mamba_inner} is not a multiple of hidden_size {hidden}: "
                              f"MambaConfig's expand is an integer")
    hf_config = transformers.MambaConfig(
        vocab_size=int(vocab), hidden_size=int(hidden), state_size=MAMBA_STATE_SIZE,
        num_hidden_layers=config.num_layers, layer_norm_epsilon=float(config.rms_norm_epsilon),
        expand=config.mamba_inner // hidden, conv_kernel=MAMBA_CONV_WIDTH, use_bias=config.mamba_use_bias_in_linears,
        use_conv_bias=config.mamba_use_bias_in_conv, hidden_act="silu", time_step_rank=config.mamba_dt_rank,
        initializer_range=float(config.init_method_std), tie_word_embeddings=config.tied_embeddings,
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return hf_config, hf


def from_hf(hf_config: Any, hf: Mapping[str, torch.Tensor]) -> Tuple[ModelConfig, Dict[str, torch.Tensor]]:
    """(our ModelConfig, our merged state dict) of a MambaForCausalLM."""
    hidden, layers = int(hf_config.hidden_size), int(hf_config.num_hidden_layers)
    inner = int(getattr(hf_config, "intermediate_size", None) or int(hf_config.expand * hidden))
    problems = []
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r}: only silu converts")
    if int(hf_config.state_size) != MAMBA_STATE_SIZE:
        problems.append(f"state_size={hf_config.state_size}: this framework's Mamba has {MAMBA_STATE_SIZE}")
    if int(hf_config.conv_kernel) != MAMBA_CONV_WIDTH:
        problems.append(f"conv_kernel={hf_config.conv_kernel}: this framework's Mamba has {MAMBA_CONV_WIDTH}")
    if int(hf_config.time_step_rank) != -(-hidden // 16):
        problems.append(f"time_step_rank={hf_config.time_step_rank}: this framework's Mamba has ceil(hidden / 16) "
                        f"= {-(-hidden // 16)}")
    if problems:
        raise ConversionError("config.json describes a Mamba model this framework cannot build:\n  "
                              + "\n  ".join(problems))
    tied = bool(getattr(hf_config, "tie_word_embeddings", True))
    src = "the Hugging Face weights"
    vocab = take(hf, "backbone.embeddings.weight", src)
    use_bias = bool(getattr(hf_config, "use_bias", False))
    config = ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=1, seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH, padded_vocab_size=int(vocab.shape[0]), intermediate_size=inner,
        norm="rmsnorm", rms_norm_epsilon=float(hf_config.layer_norm_epsilon), use_bias_in_norms=False,
        pos_emb="none", no_weight_tying=not tied, attention_config=[[["mamba"], layers]],
        mamba_use_bias_in_conv=bool(getattr(hf_config, "use_conv_bias", True)), mamba_use_bias_in_linears=use_bias)
    state: Dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": vocab}
    for i in range(layers):
        ours, theirs = f"layers.{i}.", f"backbone.layers.{i}."
        state[f"{ours}norm.scale"] = take(hf, f"{theirs}norm.weight", src)
        for name in MIXER:
            if f"{theirs}mixer.{name}" in hf:
                state[f"{ours}mixer.{name}"] = hf[f"{theirs}mixer.{name}"]
        if use_bias:  # ours has an x_proj bias with the linear biases; Hugging Face's x_proj has none
            x_proj = take(hf, f"{theirs}mixer.x_proj.weight", src)
            state[f"{ours}mixer.x_proj.bias"] = torch.zeros(x_proj.shape[0], dtype=x_proj.dtype)
    state["final_norm.norm.scale"] = take(hf, "backbone.norm_f.weight", src)
    if not tied:
        state["head.final_linear.weight"] = take(hf, "lm_head.weight", src)
    return config, state
