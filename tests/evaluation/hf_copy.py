"""A Hugging Face GPTNeoXForCausalLM folder (weights + tokenizer) holding the weights of our sequential
model, so that lm-eval's own 'hf' model can score the same network. Written with the project's converter
(megatron/checkpoint_conversion), so the eval comparison also exercises it."""
from pathlib import Path
from typing import Dict

import torch

from megatron.checkpoint_conversion import hf_gptneox
from megatron.checkpoint_conversion.hf_folder import save_hf_folder
from megatron.checkpoint.neox_checkpoint import read_checkpoint
from megatron.checkpoint_conversion.tokenizer_files import run_tokenizer, special_token_ids, write_hf_tokenizer
from megatron.model.config import ModelConfig


def write_hf_copy(state: Dict[str, torch.Tensor], model_config: ModelConfig, tokenizer_file: str, eos_token: str,
                  out_dir: Path) -> Path:
    """``state``: full weights under the converter's flat names (``flat_state_dict`` of a GPT2ModelSequential
    state dict, or a merged checkpoint) of the model ``model_config``; the tokenizer (an HFTokenizer
    tokenizer.json whose end-of-document token is ``eos_token``) goes along."""
    args = {"tokenizer_type": "HFTokenizer", "vocab_file": tokenizer_file, "merge_file": None}
    config, hf_state = hf_gptneox.to_hf(model_config, {k: v.float() for k, v in state.items()})
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = run_tokenizer(args)
    assert write_hf_tokenizer(args, tokenizer, str(out_dir), config.max_position_embeddings), \
        "the tokenizer files were not written"
    special = special_token_ids(tokenizer)
    config.eos_token_id, config.bos_token_id = special["eos_token_id"], special["bos_token_id"]
    save_hf_folder(str(out_dir), config, hf_state, "fp32")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out_dir)).eos_token == eos_token
    return out_dir


def sequential_state(checkpoint: Path) -> Dict[str, torch.Tensor]:
    """Our sequential model's full state dict from a checkpoint folder (global_stepN), any layout."""
    return read_checkpoint(str(checkpoint)).state
