#!/usr/bin/env python
"""Rewrite a checkpoint of this project's older layout into GPT-NeoX's layout, which train.py loads.

    python tools/ckpts/upgrade_checkpoint.py --input_dir checkpoints/old/global_step1000 --output_dir checkpoints/new

Older layouts (checkpoints whose neox_args.json has no ``checkpoint_layout: gpt-neox``): flat module names
(embedding.*, layers.N.*, final_norm.*, head.*) and pipeline files layer_00 .. layer_{L+2}, or GPT-NeoX's
slots with this project's earlier tensor names. generate.py, eval.py and convert_neox_to_hf.py read them as
they are; training refuses them and names this command.

Writes OUTPUT_DIR/global_stepN for the same tensor / pipeline split with the weights, neox_args.json,
configs/, the iteration, the data position, the learning-rate schedule's state, the RNG files, COMPLETE and
``latest``. The optimizer state is not carried (its parameter order and grouped-query QKV layout changed):
resume with ``load: OUTPUT_DIR`` and ``no_load_optim: true``, or fine-tune with ``finetune: true``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.errors import ConversionError  # noqa: E402
from megatron.checkpoint_conversion.upgrade import upgrade_checkpoint  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_dir", required=True, help="an old-layout global_stepN directory (or its save directory)")
    p.add_argument("--output_dir", required=True, help="a new save directory (becomes 'load')")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        path = upgrade_checkpoint(args.input_dir, args.output_dir)
    except ConversionError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}; train from it with load: {args.output_dir} and no_load_optim: true (the optimizer state "
          f"is not carried) or finetune: true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
