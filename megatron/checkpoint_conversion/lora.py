"""A LoRA run's adapter checkpoint (megatron.checkpoint.lora) taken out: merged into its base as one full checkpoint
in the same layout (``merge_lora_checkpoint``), or written as a Hugging Face peft adapter for the base converted to
Hugging Face (``export_peft_adapter``).

Merging: each adapted weight becomes W + (alpha / r) B A (computed in fp32, stored in W's dtype), the full tensors
(merged over the tensor-parallel ranks, megatron.checkpoint.tensor_parallel's rules for the factors) then split as
the base checkpoint is. The merged model computes what the LoRA model computed (dropout aside).

peft export: adapter_config.json (peft's LoraConfig, its target_modules the adapted modules' full Hugging Face
names) and adapter_model.safetensors (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``). The
factors take the Hugging Face layout through the very conversion the base weights take
(megatron.checkpoint_conversion.hf_gptneox / hf_llama ``to_hf``): that conversion moves whole rows of a
column-parallel weight (fused QKV into q / k / v, [up | gate] into up / gate) and whole columns of a row-parallel one,
so B (the rows of a column-parallel update) and A (the columns of a row-parallel one) go through it in place of the
weight, zero-padded to its shape, and come out split and ordered as the Hugging Face modules' weights. A
column-parallel layer split into several modules (q, k, v) gives each the same A."""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from safetensors.torch import save_file

from megatron.checkpoint.files import read_client_state
from megatron.checkpoint.lora import (A_SUFFIX, B_SUFFIX, adapted_weights, merged_state, read_adapter_checkpoint,
                                      read_base_checkpoint)
from megatron.checkpoint.neox_checkpoint import NeoxCheckpoint, read_args_file, write_checkpoint
from megatron.checkpoint_conversion import hf_gptneox, hf_llama
from megatron.checkpoint_conversion.common import check_output_dir
from megatron.errors import ConversionError
from megatron.model.config import ModelConfig

COLUMN_TARGETS = ("query_key_value", "linear1")
"""The column-parallel targets (megatron.model.lora_settings.TARGET_MODULES); dense and linear2 are row-parallel."""
PEFT_FAMILIES = {"neox": ("gpt_neox.layers.{i}.", {"query_key_value": ["attention.query_key_value"],
                                                    "dense": ["attention.dense"], "linear1": ["mlp.dense_h_to_4h"],
                                                    "linear2": ["mlp.dense_4h_to_h"]}),
                 "llama": ("model.layers.{i}.", {"query_key_value": ["self_attn.q_proj", "self_attn.k_proj",
                                                                     "self_attn.v_proj"],
                                                 "dense": ["self_attn.o_proj"],
                                                 "linear1": ["mlp.up_proj", "mlp.gate_proj"],
                                                 "linear2": ["mlp.down_proj"]})}
"""--architecture -> (the Hugging Face layer prefix, our target -> its Hugging Face modules)."""
PEFT_FAMILIES.update({name: PEFT_FAMILIES["llama"] for name in ("mistral", "qwen2", "olmo")})


def add_adapter_arguments(parser: argparse.ArgumentParser, output_help: str) -> None:
    """The tools' (merge_lora.py, export_lora_to_peft.py) --input_dir, --output_dir and --base_dir."""
    parser.add_argument("--input_dir", required=True,
                        help="the adapter checkpoint (global_stepN, or a save dir with latest)")
    parser.add_argument("--output_dir", required=True, help=output_help)
    parser.add_argument("--base_dir", default=None,
                        help="the base checkpoint, when it is no longer where the adapters recorded it")


def merge_lora_checkpoint(adapter_dir: str, output_dir: str, base_dir: Optional[str] = None) -> str:
    """Write base + adapters as one full checkpoint into ``output_dir`` (a save directory), in the base's layout
    (tensor / pipeline split), at the adapter checkpoint's iteration; returns its global_stepN directory."""
    adapters, lora, pointer, path = read_adapter_checkpoint(adapter_dir)
    base = read_base_checkpoint(pointer, path, base_dir)
    iteration = int(read_client_state(path).get("iteration", 0))
    args = {key: value for key, value in read_args_file(path).items() if key != "lora"}
    args.update({"load": None, "finetune": False})
    tp, pp = base.layout
    config = base.config.replace(model_parallel_size=max(tp, 1), pipe_parallel_size=pp)
    configs = _config_files(base.path)  # the base's model; neox_args.json (the run's, without lora) is what readers use
    return write_checkpoint(output_dir, merged_state(base.state, adapters, lora), config, args, configs, iteration,
                            client_state={"merged_lora": {"adapters": os.path.abspath(path), "base": base.path}})


def _config_files(path: str) -> Dict[str, str]:
    directory = os.path.join(path, "configs")
    if not os.path.isdir(directory):
        return {}
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), encoding="utf-8") as handle:
            files[name] = handle.read()
    return files


def _padded(factor: torch.Tensor, shape: torch.Size, dim: int, name: str) -> torch.Tensor:
    """``factor`` in the top-left corner of a zero tensor of ``shape`` (its r along ``dim`` at most the weight's)."""
    if factor.shape[dim] > shape[dim]:
        raise ConversionError(f"{name}: rank {factor.shape[dim]} is larger than the weight's side {shape[dim]}; a "
                              f"peft adapter of this rank cannot be laid out through the weight's conversion")
    out = torch.zeros(shape, dtype=torch.float32)
    out[:factor.shape[0], :factor.shape[1]] = factor.float()
    return out


def peft_tensors(config: ModelConfig, base_state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor],
                 architecture: str) -> Dict[str, torch.Tensor]:
    """{``base_model.model.<hf module>.lora_A.weight`` / ``lora_B.weight``: tensor} of the adapters, for the base
    converted with ``--architecture architecture``."""
    if architecture not in PEFT_FAMILIES:
        raise ConversionError(f"--architecture {architecture!r}: peft export is implemented for "
                              f"{', '.join(PEFT_FAMILIES)}")
    prefix, modules = PEFT_FAMILIES[architecture]
    through = dict(base_state)
    column: Dict[str, bool] = {}
    for weight in adapted_weights(adapters):
        stem = weight[:-len(".weight")]
        is_column = stem.split(".")[-1] in COLUMN_TARGETS
        column[weight] = is_column
        factor = adapters[stem + (B_SUFFIX if is_column else A_SUFFIX)]
        through[weight] = _padded(factor, base_state[weight].shape, 1 if is_column else 0, weight)
    to_hf = hf_gptneox.to_hf if architecture == "neox" else \
        (lambda c, s: hf_llama.to_hf(c, s, architecture))
    _, hf = to_hf(config, through)
    out = {}
    for weight, is_column in column.items():
        stem = weight[:-len(".weight")]
        layer, target = stem.split(".", 2)[1], stem.split(".")[-1]
        rank = adapters[stem + A_SUFFIX].shape[0]
        for module in modules[target]:
            name = prefix.format(i=layer) + module
            converted = hf[name + ".weight"]
            if is_column:
                a, b = adapters[stem + A_SUFFIX], converted[:, :rank]
            else:
                a, b = converted[:rank, :], adapters[stem + B_SUFFIX]
            out[f"base_model.model.{name}.lora_A.weight"] = a.float().contiguous().clone()
            out[f"base_model.model.{name}.lora_B.weight"] = b.float().contiguous().clone()
    return out


def export_peft_adapter(adapter_dir: str, output_dir: str, architecture: str, base_dir: Optional[str] = None
                        ) -> List[str]:
    """Write adapter checkpoint ``adapter_dir`` as a peft LoRA adapter into ``output_dir`` for the base converted
    with tools/ckpts/convert_neox_to_hf.py --architecture ``architecture``; returns the adapted modules."""
    from peft import LoraConfig

    check_output_dir(output_dir)
    adapters, lora, pointer, path = read_adapter_checkpoint(adapter_dir)
    base: NeoxCheckpoint = read_base_checkpoint(pointer, path, base_dir)
    tensors = peft_tensors(base.config, base.state, adapters, architecture)
    modules = sorted({name[len("base_model.model."):-len(".lora_A.weight")] for name in tensors
                      if name.endswith(".lora_A.weight")})
    os.makedirs(output_dir, exist_ok=True)
    LoraConfig(r=int(lora["r"]), lora_alpha=lora["alpha"], lora_dropout=float(lora["dropout"]),
               target_modules=modules, bias="none", task_type="CAUSAL_LM").save_pretrained(output_dir)
    save_file(tensors, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    return modules
