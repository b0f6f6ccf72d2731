"""A checkpoint in GPT-NeoX's layout (this project's or GPT-NeoX's; or this project's older layout) -> a Hugging
Face folder (the library side of tools/ckpts/convert_neox_to_hf.py)."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

from megatron.checkpoint.neox_checkpoint import read_checkpoint
from megatron.checkpoint_conversion import hf_gptneox, hf_llama, hf_mamba
from megatron.checkpoint_conversion.common import check_output_dir
from megatron.checkpoint_conversion.hf_folder import save_hf_folder
from megatron.checkpoint_conversion.tokenizer_files import run_tokenizer, special_token_ids, write_hf_tokenizer
from megatron.errors import ConfigError, ConversionError
from megatron.neox_arguments import NeoXArgs

ARCHITECTURES = ("neox", "llama", "mistral", "mixtral", "qwen2", "olmo", "mamba")
HF_CLASSES = {"neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM", "olmo": "OlmoForCausalLM",
              "mamba": "MambaForCausalLM"}


def args_from_config_files(paths: Sequence[str]) -> Dict[str, Any]:
    """A NeoXArgs dict from the run's YAML files (validated as train.py would)."""
    try:
        return NeoXArgs.from_ymls(list(paths)).to_dict()
    except ConfigError as exc:
        raise ConversionError(f"--config_file: {exc}") from None


def convert_neox_to_hf(input_dir: str, output_dir: str, config_files: Optional[Sequence[str]] = None,
                       architecture: str = "neox", precision: str = "fp32", pad_token_id: Optional[int] = None) -> str:
    """Merge the shards of ``input_dir`` and write ``output_dir`` (config.json with the tokenizer's eos / bos
    ids, model.safetensors, and the tokenizer files when the config names a tokenizer.json). Returns the
    Hugging Face class name: *ForCausalLM, or *ForSequenceClassification for a reward model (train_impl 'rm'),
    which scores the last token that is not ``pad_token_id``."""
    if architecture not in ARCHITECTURES:
        raise ConversionError(f"--architecture {architecture!r}: choose one of {', '.join(ARCHITECTURES)}")
    check_output_dir(output_dir)
    args = args_from_config_files(config_files) if config_files else None
    ckpt = read_checkpoint(input_dir, args)
    reward_model = ckpt.config.value_head
    if reward_model and architecture in ("mamba", "mixtral"):
        raise ConversionError(f"a reward model (train_impl 'rm') converts to GPTNeoX / Llama / Mistral's "
                              f"*ForSequenceClassification; --architecture {architecture} has none here")
    if architecture == "neox":
        config, state = hf_gptneox.to_hf(ckpt.config, ckpt.state)
    elif architecture == "mamba":
        config, state = hf_mamba.to_hf(ckpt.config, ckpt.state)
    else:
        config, state = hf_llama.to_hf(ckpt.config, ckpt.state, architecture)
    hf_class = HF_CLASSES[architecture].replace("ForCausalLM", "ForSequenceClassification") if reward_model \
        else HF_CLASSES[architecture]
    config.architectures = [hf_class]
    tokenizer = run_tokenizer(ckpt.args)
    os.makedirs(output_dir, exist_ok=True)
    if tokenizer is not None:
        for name, value in special_token_ids(tokenizer).items():
            setattr(config, name, value)
        write_hf_tokenizer(ckpt.args, tokenizer, output_dir,
                           getattr(config, "max_position_embeddings", None) or ckpt.config.positions)
    if pad_token_id is not None:
        config.pad_token_id = int(pad_token_id)
    save_hf_folder(output_dir, config, state, precision)
    return hf_class
