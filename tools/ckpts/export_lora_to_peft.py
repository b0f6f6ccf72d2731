#!/usr/bin/env python
"""Write a LoRA run's adapter checkpoint as a Hugging Face peft adapter (adapter_config.json and
adapter_model.safetensors) for its base converted with tools/ckpts/convert_neox_to_hf.py:

    python tools/ckpts/convert_neox_to_hf.py --input_dir checkpoints/base --output_dir hf/base --architecture llama
    python tools/ckpts/export_lora_to_peft.py --input_dir checkpoints/lora-run --output_dir hf/adapter \\
        --architecture llama

then ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("hf/base"), "hf/adapter")`` computes what
the LoRA model computes here. --architecture is convert_neox_to_hf.py's: neox (GPTNeoX), llama, mistral, qwen2,
olmo. The base is the one the adapter checkpoint points at; --base_dir names it where it has moved.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only: never ask the Hub

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.checkpoint_conversion.lora import PEFT_FAMILIES, add_adapter_arguments, export_peft_adapter  # noqa: E402
from megatron.errors import CheckpointError, ConversionError  # noqa: E402
from megatron.utils.optional_deps import MissingOptionalDependency  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_adapter_arguments(p, "the peft adapter folder to write")
    p.add_argument("--architecture", choices=tuple(PEFT_FAMILIES), default="neox",
                   help="as the base was converted with tools/ckpts/convert_neox_to_hf.py")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        modules = export_peft_adapter(args.input_dir, args.output_dir, args.architecture, args.base_dir)
    except (ConversionError, CheckpointError, MissingOptionalDependency) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote a peft LoRA adapter of {len(modules)} modules to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
