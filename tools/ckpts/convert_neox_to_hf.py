#!/usr/bin/env python
"""Convert a checkpoint in GPT-NeoX's layout (this framework's or GPT-NeoX's; or this framework's older layout),
any tensor / pipeline split, to a Hugging Face folder.

    python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/global_step1000 \\
        --config_file configs/pythia/70M.yml configs/local_setup.yml --output_dir hf/pythia-70m
    python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints --output_dir hf/llama --architecture llama

Writes config.json, model.safetensors and, when the config names a tokenizer.json, tokenizer.json and
tokenizer_config.json. Without --config_file the checkpoint's own neox_args.json (a GPT-NeoX checkpoint: its
configs/*.yml) describes the model.
--architecture neox gives GPTNeoXForCausalLM; llama / mistral give LlamaForCausalLM / MistralForCausalLM
for rmsnorm + swiglu + rotary models; qwen2 gives Qwen2ForCausalLM for such models with biases on q, k and v only
(use_bias_in_qkv: true, use_bias_in_attn_linear / use_bias_in_mlp: false); olmo gives OlmoForCausalLM for such
models with norm non_parametric_layernorm (epsilon 1e-5); RoPE scaling (rope_scaling) goes into
config.json's rope_parameters; mixtral gives MixtralForCausalLM for such models with a dropless
mixture of experts in every layer (top-k routing, k >= 2); mamba gives MambaForCausalLM for pure-Mamba models
(rmsnorm without bias, pos_emb none). A reward model (train_impl rm) becomes GPTNeoX / Llama / Mistral's
*ForSequenceClassification (--pad-token-id: the id it skips to find the scored last token). What a target
cannot represent is refused with the reason.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never ask the Hub

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.errors import ConversionError  # noqa: E402
from megatron.utils.optional_deps import MissingOptionalDependency  # noqa: E402
from megatron.checkpoint_conversion.to_hf import ARCHITECTURES, convert_neox_to_hf  # noqa: E402
from megatron.checkpoint_conversion.hf_folder import DTYPES  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="a global_stepN directory (or a save dir with 'latest')")
    p.add_argument("--config_file", nargs="+", default=None,
                   help="the run's YAML file(s); default: the checkpoint's neox_args.json (GPT-NeoX's: configs/*.yml)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--architecture", choices=ARCHITECTURES, default="neox")
    p.add_argument("--precision", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--pad-token-id", "--pad_token_id", dest="pad_token_id", type=int, default=None,
                   help="pad_token_id of config.json; a reward model's *ForSequenceClassification scores the last "
                        "token that is not this one (GPT-NeoX's flag)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        kind = convert_neox_to_hf(args.input_dir, args.output_dir, args.config_file, args.architecture,
                                  args.precision, args.pad_token_id)
    except (ConversionError, MissingOptionalDependency) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {kind} to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
