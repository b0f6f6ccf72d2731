"""Megatron-LM's non-persistent checkpoints (non_persistent_ckpt_type 'global'): frequent saves that only
protect against losing work, kept apart from the persistent checkpoints.

Every non_persistent_save_interval iterations (that are not a persistent save) the run saves a checkpoint
into non_persistent_global_ckpt_dir (default `{save}/non_persistent`) exactly as a persistent one
(megatron.checkpoint.engine.save_checkpoint: checksums, COMPLETE, then `latest` moves, also with async_save),
and once it is complete every other checkpoint in that directory is removed: it holds only the newest.
On resume (load set, no explicit `iteration`) the newest complete non-persistent checkpoint wins when it is
newer than the one the persistent directory would resume from.

Megatron-LM's other types, 'local' (per-rank files on node-local storage) and 'in_memory', are marked TBD
there and are refused here (megatron.neox_arguments.validation)."""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional, Tuple

from megatron.checkpoint.format import complete_tags, tag_iteration

NON_PERSISTENT_SUBDIR = "non_persistent"


def non_persistent_dir(neox_args) -> Optional[str]:
    """Where this run's non-persistent checkpoints live; None without non_persistent_ckpt_type 'global'."""
    if neox_args.non_persistent_ckpt_type != "global":
        return None
    if neox_args.non_persistent_global_ckpt_dir:
        return neox_args.non_persistent_global_ckpt_dir
    base = neox_args.save or neox_args.load
    return os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None


def non_persistent_due(neox_args, iteration: int, save_iters: Iterable[int]) -> bool:
    """Whether the step that just ended at ``iteration`` saves a non-persistent checkpoint (a persistent save
    at the same iteration takes precedence)."""
    interval = neox_args.non_persistent_save_interval
    return bool(interval) and iteration % interval == 0 and iteration not in save_iters \
        and non_persistent_dir(neox_args) is not None


def in_non_persistent_dir(neox_args, path: str) -> bool:
    """Whether checkpoint directory ``path`` is a non-persistent one (async_save completes it with keep_only)."""
    directory = non_persistent_dir(neox_args)
    return directory is not None and os.path.abspath(os.path.dirname(path)) == os.path.abspath(directory)


def keep_only(save_dir: str, tag: str) -> None:
    """Remove every checkpoint directory of ``save_dir`` but ``tag`` (complete or interrupted: only the newest
    non-persistent checkpoint is ever resumed from)."""
    for name in os.listdir(save_dir):
        if name.startswith("global_step") and name != tag:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def newer_checkpoint(neox_args, load_dir: str, tag: Optional[str]) -> Tuple[str, Optional[str], Optional[str]]:
    """(directory, tag, note): the non-persistent checkpoint when it is newer than ``tag`` of ``load_dir``
    (the persistent one the run would resume from), else ``load_dir`` and ``tag`` unchanged."""
    directory = non_persistent_dir(neox_args)
    if directory is None or os.path.abspath(directory) == os.path.abspath(load_dir):
        return load_dir, tag, None
    complete = complete_tags(directory)
    if not complete or (tag is not None and tag_iteration(complete[-1]) <= tag_iteration(tag)):
        return load_dir, tag, None
    newest = complete[-1]
    return directory, newest, (f"resuming from the non-persistent checkpoint {os.path.join(directory, newest)}, "
                               f"newer than {'the persistent ' + tag if tag else 'any persistent checkpoint'} in "
                               f"{load_dir}")
