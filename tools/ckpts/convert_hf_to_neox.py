#!/usr/bin/env python
"""Convert a local Hugging Face GPTNeoX / Llama / Mistral / Mixtral / Qwen2 / OLMo / Mamba folder (RoPE scaling
linear, dynamic, yarn or llama3 included) to a checkpoint of this framework.

    python tools/ckpts/convert_hf_to_neox.py --hf_dir hf/pythia-70m --output_dir checkpoints/pythia-70m \\
        --config_out configs/pythia-70m-converted.yml --model_parallel_size 2 --pipe_parallel_size 1

Writes OUTPUT_DIR/global_step0 in GPT-NeoX's layout for the chosen tensor / pipeline split, with
``latest``, COMPLETE and neox_args.json, and a YAML config (architecture, parallel layout, tokenizer when
the folder has tokenizer.json or tokenizer.model, ``load``, ``finetune: true``). The checkpoint has no
optimizer state: train.py starts fine-tuning from it; generate.py and eval.py load it as is. Local folders
only; nothing is downloaded.
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
from megatron.checkpoint_conversion.from_hf import convert_hf_to_neox  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_dir", required=True, help="a local folder with config.json and safetensors weights")
    p.add_argument("--output_dir", required=True, help="checkpoint directory to write (becomes 'load')")
    p.add_argument("--config_out", required=True, help="YAML config to write")
    p.add_argument("--model_parallel_size", type=int, default=1)
    p.add_argument("--pipe_parallel_size", type=int, default=0,
                   help="0: sequential model (mp_rank_* files); >= 1: pipeline model (layer_* files)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = convert_hf_to_neox(args.hf_dir, args.output_dir, args.config_out, args.model_parallel_size,
                                  args.pipe_parallel_size)
    except (ConversionError, MissingOptionalDependency) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {args.config_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
