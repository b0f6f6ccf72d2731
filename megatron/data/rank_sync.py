"""'One rank builds a file, the others wait and read it', with or without torch.distributed.

Used for the cached index maps: building them on every rank would race on the same files. With
model or pipeline parallelism only some ranks may load data; pass their process group so that the
wait involves exactly the ranks that call in.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from megatron.errors import DataError
from megatron.mpu.host_collectives import all_gather_object


def _distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def is_builder_rank(use_shared_fs: bool = True, group: Any = None) -> bool:
    """The first rank of `group` (default: all ranks) on a shared filesystem, else local rank 0 of each node."""
    dist = _distributed()
    if dist is None:
        return True
    if use_shared_fs:
        return dist.get_rank(group) == 0
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def build_once(
    build: Callable[[], None], exists: Callable[[], bool], use_shared_fs: bool = True, group: Any = None
) -> bool:
    """Run `build` on the builder rank(s) if `exists()` is false, then let every rank of `group` continue.

    Single process: just builds if needed. Distributed: a collective over `group` after the build makes
    the other ranks wait, and a failure on a builder rank is re-raised on every rank instead of hanging
    them. Every rank of `group` must call this. Returns whether this process built.
    """
    dist = _distributed()
    built, error = False, None
    if is_builder_rank(use_shared_fs, group) and not exists():
        try:
            build()
            built = True
        except Exception as exc:  # re-raised below on every rank
            error = exc
            if dist is None:
                raise
    if dist is not None:
        messages = all_gather_object(None if error is None else f"{type(error).__name__}: {error}", group=group)
        failures = [m for m in messages if m]
        if error is not None:
            raise error
        if failures:  # a DataError (e.g. a read-only data directory) reaches every rank as one, named the same way
            kind, _, message = failures[0].partition(": ")
            if kind == DataError.__name__:
                raise DataError(message)
            raise RuntimeError(f"building shared data files failed on another rank: {failures[0]}")
    if not exists():
        raise RuntimeError(
            "shared data files are missing after the build step; is the filesystem shared? "
            "Set use_shared_fs=False when every node has its own copy of the data."
        )
    return built
