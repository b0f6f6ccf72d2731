"""Megatron-LM's non-persistent checkpoints (non_persistent_ckpt_type 'global'): frequent saves that only
protect against losing work, kept apart from the persistent checkpoints.

Every non_persistent_save_interval iterations (that are not a persistent save) the run saves a checkpoint
into non_persistent_global_ckpt_dir (default `{save}/non_persistent`) exactly as a persistent one
(megatron.checkpoint.engine.save_checkpoint: checksums, COMPLETE, then `latest` moves, also with async_save),
and once it is complete every other checkpoint in that directory is removed: it holds only the newest.
On resume (load set, no explicit `iteration`) the newest complete non-persistent checkpoint wins when it is
newer than the one the persistent directory would resume from.

Megatron-LM's other types, 'local' (per-rank files on node-local storage) and 'in_memory', are marked TBD
there and are refused here (megatron.neox_arguments.validation).

Since the directory keeps only its newest checkpoint, it must never be another run's save directory: that run's
checkpoints would be resumed from and then deleted (issue 32). The first non-persistent save writes MARKER into
the directory; a directory set by non_persistent_global_ckpt_dir that holds checkpoints without it, or a run's lock
(megatron.checkpoint.run_lock), is refused (non_persistent_problem) before launch, on resume and on saving, and
keep_only deletes nothing without it. The default, `{save}/non_persistent`, is the run's own: its older
checkpoints (saved before the marker existed) are this run's to replace."""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional, Tuple

from megatron.checkpoint.format import LATEST_FILE, complete_tags, tag_iteration
from megatron.checkpoint.run_lock import LOCK_FILE, lock_problem
from megatron.errors import CheckpointError

NON_PERSISTENT_SUBDIR = "non_persistent"

MARKER = ".non_persistent_checkpoints"
"""Written into a non-persistent directory by its first save: its checkpoints are non-persistent ones, which
keep_only may delete."""


def directory_problem(directory: Optional[str]) -> Optional[str]:
    """Why ``directory`` cannot be a non-persistent checkpoint directory (which keeps only its newest checkpoint),
    or None: it is a training run's save directory (it holds that run's lock file, held now or not), or it holds
    checkpoints (or a `latest`) without MARKER, e.g. another run's or GPT-NeoX's."""
    if not directory or not os.path.isdir(directory):
        return None
    where = f"non_persistent_global_ckpt_dir='{directory}'"
    fix = ("; it keeps only its newest checkpoint and deletes the others, so give it a directory of its own "
           "(default: {save}/non_persistent)")
    if os.path.exists(os.path.join(directory, LOCK_FILE)):
        held = lock_problem(directory)
        return (f"{where} is the save directory of a training run (it holds {LOCK_FILE}"
                f"{': ' + held if held else ''}){fix}")
    names = os.listdir(directory)
    checkpoints = sorted(name for name in names if name.startswith("global_step") or name == LATEST_FILE)
    if checkpoints and MARKER not in names:
        return (f"{where} holds checkpoints ({', '.join(checkpoints[:4])}{', ...' if len(checkpoints) > 4 else ''}) "
                f"that no non-persistent save wrote (no {MARKER} file){fix}. If it is this run's non-persistent "
                f"directory from before that file existed, create {os.path.join(directory, MARKER)}")
    return None


def non_persistent_problem(neox_args) -> Optional[str]:
    """directory_problem of the run's non-persistent directory when non_persistent_global_ckpt_dir sets it (the
    default, inside the run's own save directory, is the run's)."""
    if not neox_args.non_persistent_global_ckpt_dir:
        return None
    return directory_problem(non_persistent_dir(neox_args))


def claim_directory(neox_args) -> str:
    """Rank 0, before a non-persistent save: refuse the directory (CheckpointError) when non_persistent_problem
    says so, else create it with its MARKER; returns it."""
    problem = non_persistent_problem(neox_args)
    if problem:
        raise CheckpointError(problem)
    directory = os.path.normpath(non_persistent_dir(neox_args))
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, MARKER), "a", encoding="utf-8").close()
    return directory


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
    non-persistent checkpoint is ever resumed from); nothing in a directory without MARKER (claim_directory)."""
    if not os.path.isfile(os.path.join(save_dir, MARKER)):
        return
    for name in os.listdir(save_dir):
        if name.startswith("global_step") and name != tag:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)


def newer_checkpoint(neox_args, load_dir: str, tag: Optional[str]) -> Tuple[str, Optional[str], Optional[str]]:
    """(directory, tag, note): the non-persistent checkpoint when it is newer than ``tag`` of ``load_dir``
    (the persistent one the run would resume from), else ``load_dir`` and ``tag`` unchanged."""
    directory = non_persistent_dir(neox_args)
    if directory is None or os.path.abspath(directory) == os.path.abspath(load_dir):
        return load_dir, tag, None
    problem = non_persistent_problem(neox_args)
    if problem:
        raise CheckpointError(problem)
    complete = complete_tags(directory)
    if not complete or (tag is not None and tag_iteration(complete[-1]) <= tag_iteration(tag)):
        return load_dir, tag, None
    newest = complete[-1]
    return directory, newest, (f"resuming from the non-persistent checkpoint {os.path.join(directory, newest)}, "
                               f"newer than {'the persistent ' + tag if tag else 'any persistent checkpoint'} in "
                               f"{load_dir}")
