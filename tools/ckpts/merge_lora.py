#!/usr/bin/env python
"""Merge a LoRA run's adapter checkpoint into its base: one full checkpoint, W + (alpha / r) B A for each adapted
weight, in the base's layout (tensor / pipeline split), at the adapter checkpoint's iteration.

    python tools/ckpts/merge_lora.py --input_dir checkpoints/lora-run/global_step100 --output_dir checkpoints/merged

The base is the one the adapter checkpoint points at (its directory and manifest digest, recorded when the run
started); --base_dir names it where it has moved. The merged checkpoint trains, generates and converts
(tools/ckpts/convert_neox_to_hf.py) as any full checkpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.checkpoint_conversion.lora import add_adapter_arguments, merge_lora_checkpoint  # noqa: E402
from megatron.errors import CheckpointError, ConversionError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_adapter_arguments(p, "the save directory the merged global_stepN is written into")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = merge_lora_checkpoint(args.input_dir, args.output_dir, args.base_dir)
    except (ConversionError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote the merged checkpoint {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
