"""This project's older checkpoint layouts -> GPT-NeoX's layout (the library side of
tools/ckpts/upgrade_checkpoint.py).

The weights are read and translated by neox_checkpoint.read_checkpoint and written again for the same
tensor / pipeline split, with the run's neox_args.json (now marked ``checkpoint_layout: gpt-neox``), its
configs/, the iteration, the data position, the learning-rate schedule's state and each rank's RNG file.
The optimizer state is not carried: its parameters are in the old order (post_attention_layernorm now
follows the attention, as in GPT-NeoX) and the old grouped-query QKV row layout, so the upgraded checkpoint
resumes with ``no_load_optim: true`` (or is fine-tuned with ``finetune: true``).
"""
from __future__ import annotations

import glob
import os
import shutil

from megatron.checkpoint.files import load_lazily
from megatron.checkpoint.format import MP_FILE, OURS_OLD, model_files
from megatron.checkpoint.neox_checkpoint import read_checkpoint, write_checkpoint
from megatron.checkpoint_conversion.common import check_output_dir
from megatron.errors import ConversionError

CARRIED = ("consumed_train_samples", "consumed_valid_samples", "lr_scheduler")
"""Client-state entries of the old mp_rank files that the upgraded checkpoint keeps."""


def upgrade_checkpoint(input_dir: str, output_dir: str) -> str:
    """Rewrite the old-layout checkpoint ``input_dir`` (global_stepN, or a save directory with ``latest``) as
    ``output_dir/global_stepN``; returns that directory."""
    check_output_dir(output_dir)
    ckpt = read_checkpoint(input_dir)
    if ckpt.kind != OURS_OLD:
        raise ConversionError(f"{ckpt.path} is {ckpt.kind} checkpoint in GPT-NeoX's layout already: nothing to "
                              f"upgrade (load it as it is)")
    tag = os.path.basename(os.path.normpath(ckpt.path))
    if not tag.startswith("global_step") or not tag[len("global_step"):].isdigit():
        raise ConversionError(f"{ckpt.path} is not a global_stepN directory; pass one (or its save directory)")
    if os.path.abspath(output_dir) == os.path.abspath(os.path.dirname(ckpt.path)):
        raise ConversionError(f"--output_dir {output_dir} is the checkpoint's own save directory; write the "
                              f"upgraded checkpoint to a new directory")
    tp, pp = ckpt.layout
    first = sorted(f for f in model_files(ckpt.path) if MP_FILE.search(os.path.basename(f)))[0]
    old_client = load_lazily(first)
    client = {key: old_client[key] for key in CARRIED if old_client.get(key) is not None}
    config_files = {}
    for name in sorted(glob.glob(os.path.join(ckpt.path, "configs", "*"))):
        with open(name, encoding="utf-8") as handle:
            config_files[os.path.basename(name)] = handle.read()
    path = write_checkpoint(output_dir, ckpt.state, ckpt.config.replace(model_parallel_size=tp, pipe_parallel_size=pp),
                            ckpt.args, config_files, iteration=int(tag[len("global_step"):]), client_state=client)
    for rng in glob.glob(os.path.join(ckpt.path, "rng_state_rank*.pt")):
        shutil.copyfile(rng, os.path.join(path, os.path.basename(rng)))
    return path
