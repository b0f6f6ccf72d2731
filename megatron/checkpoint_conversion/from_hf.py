"""A Hugging Face folder -> our checkpoint and YAML config (the library side of
tools/ckpts/convert_hf_to_neox.py).

The Hugging Face mappings give the model's ModelConfig and its full tensors; the checkpoint is written as
``output_dir/global_step0`` in GPT-NeoX's layout for the chosen tensor / pipeline split (neox_checkpoint), with
``latest``, COMPLETE, neox_args.json (a validated NeoXArgs, as megatron.checkpoint.engine writes it) and the YAML
config under configs/. The YAML holds the architecture, the parallel layout, the
tokenizer (when the folder has one) and ``load`` / ``finetune: true``: combine it with a data and
training config (which must not set those keys again). The converted checkpoint carries no optimizer
state, so train.py loads it with finetune (or no_load_optim); generate.py and eval.py load weights only.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

import yaml

from megatron.checkpoint.neox_checkpoint import new_checkpoint_problem, write_checkpoint
from megatron.checkpoint_conversion import hf_gptneox, hf_llama, hf_mamba
from megatron.checkpoint_conversion.common import check_output_dir
from megatron.checkpoint_conversion.hf_folder import load_hf_folder
from megatron.checkpoint_conversion.tokenizer_files import copy_hf_tokenizer
from megatron.errors import ConfigError, ConversionError
from megatron.model.config import ModelConfig
from megatron.neox_arguments import NeoXArgs

MODEL_TYPES = {"gpt_neox": hf_gptneox.from_hf, "llama": hf_llama.from_hf, "mistral": hf_llama.from_hf,
               "mixtral": hf_llama.from_hf, "qwen2": hf_llama.from_hf, "olmo": hf_llama.from_hf,
               "mamba": hf_mamba.from_hf}
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "intermediate_size",
              "mlp_multiple_of", "activation", "norm", "pos_emb", "rotary_pct", "rotary_emb_base", "gpt_j_residual",
              "gpt_j_tied", "no_weight_tying", "use_bias_in_norms", "use_bias_in_mlp", "use_bias_in_attn_linear",
              "use_bias_in_qkv",
              "sliding_window_width", "max_position_embeddings", "seq_length")
"""The GPT-NeoX config keys of a converted model's YAML (with its norm's epsilon; unset ones are left out)."""
MOE_KEYS = ("moe_num_experts", "moe_top_k", "moe_type", "moe_router_type", "moe_loss_coeff", "moe_jitter_eps")
"""And those of a mixture of experts (Mixtral), with moe_expert_interval."""
MAMBA_KEYS = ("attention_config", "mamba_use_bias_in_conv", "mamba_use_bias_in_linears")
"""... and those of a model with Mamba layers."""


def model_yaml_values(config: ModelConfig) -> Dict[str, Any]:
    """The GPT-NeoX config values describing ``config``'s architecture."""
    keys = MODEL_KEYS + (MAMBA_KEYS if "mamba" in config.attention_types else ())
    values = {key: getattr(config, key) for key in keys if getattr(config, key) is not None}
    if config.moe_num_experts > 1:
        values.update({key: getattr(config, key) for key in MOE_KEYS if getattr(config, key) is not None})
        values["moe_expert_interval"] = config.expert_interval
    if config.rope_scaling_dict:
        values["rope_scaling"] = config.rope_scaling_dict
    epsilon = {"rmsnorm": "rms_norm_epsilon", "scalenorm": "scalenorm_epsilon"}.get(config.norm, "layernorm_epsilon")
    values[epsilon] = config.norm_epsilon
    return values


def convert_hf_to_neox(hf_dir: str, output_dir: str, config_out: str, model_parallel_size: int = 1,
                       pipe_parallel_size: int = 0) -> str:
    """Convert ``hf_dir``; returns the checkpoint directory written."""
    if model_parallel_size < 1 or pipe_parallel_size < 0:
        raise ConversionError("--model_parallel_size must be >= 1 and --pipe_parallel_size >= 0")
    check_output_dir(output_dir)
    problem = new_checkpoint_problem(output_dir, 0) or _config_out_problem(config_out)
    if problem:  # before anything is written
        raise ConversionError(problem)
    config, hf_state = load_hf_folder(hf_dir)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ConversionError(f"{os.path.join(hf_dir, 'config.json')}: model_type {model_type!r} is not supported; "
                              f"this converter reads {', '.join(MODEL_TYPES)}")
    model, state = MODEL_TYPES[model_type](config, hf_state)
    output_dir = os.path.abspath(output_dir)
    vocab = model.padded_vocab_size
    if vocab % model_parallel_size:
        # Padding rows would give the extra tokens logit 0, which can win a greedy step: not the same model.
        raise ConversionError(f"vocab_size {vocab} is not divisible by --model_parallel_size {model_parallel_size}; "
                              f"choose a model_parallel_size that divides it")
    values: Dict[str, Any] = {
        "pipe_parallel_size": pipe_parallel_size, "model_parallel_size": model_parallel_size,
        **model_yaml_values(model), "padded_vocab_size": vocab, "make_vocab_size_divisible_by": 1,
    }
    tokenizer = copy_hf_tokenizer(hf_dir, output_dir)
    if tokenizer is not None:
        if tokenizer["vocab_size"] > vocab:
            raise ConversionError(f"the tokenizer in {hf_dir} has {tokenizer['vocab_size']} tokens but the model's "
                                  f"embedding only {vocab} rows")
        values.update(tokenizer_type=tokenizer["tokenizer_type"], vocab_file=tokenizer["vocab_file"])
    values.update(load=output_dir, finetune=True)
    text = _yaml_text(values, hf_dir)
    try:
        args = NeoXArgs.from_dict({**values, "num_gpus": model_parallel_size * max(pipe_parallel_size, 1),
                                   "config_files": {os.path.basename(config_out): text}})
    except ConfigError as exc:
        raise ConversionError(f"the converted configuration is not valid here: {exc}") from None
    os.makedirs(os.path.dirname(os.path.abspath(config_out)), exist_ok=True)
    with open(config_out, "w", encoding="utf-8") as handle:
        handle.write(text)
    model = model.replace(model_parallel_size=model_parallel_size, pipe_parallel_size=pipe_parallel_size)
    return write_checkpoint(output_dir, state, model, args.to_dict(), args.config_files)


CONFIG_HEADER = "# Converted from the Hugging Face model in "
"""How the YAML this tool writes begins: a --config_out file that begins otherwise is someone's input."""


def _config_out_problem(config_out: str) -> Optional[str]:
    """Why --config_out cannot be written, or None: it exists and is not a config this tool wrote (one of the
    user's configs would be overwritten)."""
    if not os.path.exists(config_out):
        return None
    try:
        with open(config_out, encoding="utf-8", errors="replace") as handle:
            ours = handle.read(len(CONFIG_HEADER)) == CONFIG_HEADER
    except OSError as exc:
        return f"--config_out {config_out!r} cannot be read ({exc.strerror or exc}); choose another path"
    if ours:
        return None
    return (f"--config_out {config_out!r} exists and is not a config this tool wrote; it is not overwritten: "
            f"choose another path, or remove it first")


def _yaml_text(values: Dict[str, Any], hf_dir: str) -> str:
    header = (f"{CONFIG_HEADER}{os.path.abspath(hf_dir)}\n"
              "# by tools/ckpts/convert_hf_to_neox.py.\n"
              "# Architecture, parallel layout, tokenizer and where the converted checkpoint is (load, finetune: the\n"
              "# checkpoint has no optimizer state). Combine with data / training / text-generation configs, e.g.\n"
              "#   python deepy.py generate.py THIS.yml configs/text_generation.yml\n")
    return header + yaml.safe_dump(values, sort_keys=False)
