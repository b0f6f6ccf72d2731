"""Processes that end with the process that started them.

`kill -9` of deepy.py used to leave DeepSpeed's launcher and every rank training, the rank 0 holding the save
directory's lock, until someone hunted them down (issue 32). SIGKILL cannot be caught, so deepy.py cannot pass it
on; Linux's PR_SET_PDEATHSIG (prctl(2)) instead asks the kernel to signal a process when its parent ends, by any
means. deepy.py starts the one child of DeepSpeed's runner (its local launcher, or pdsh / mpirun / srun) with it
set (children_end_with_this_process), and every worker sets it for itself against its launcher (end_with_parent,
called by NeoXArgs.consume_neox_args). The signal is SIGTERM, not SIGKILL: DeepSpeed's launcher then stops its
ranks, mpirun and srun pass it on to theirs, and a rank saves a checkpoint and exits as on any SIGTERM
(megatron.launch.signals), which releases the lock. Elsewhere than on Linux these do nothing."""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from typing import Callable, Iterator, Optional

PR_SET_PDEATHSIG = 1
"""prctl(2)'s option: the signal this process receives when its parent (the thread that started it) ends."""


def _prctl() -> Optional[Callable[..., int]]:
    """libc's prctl on Linux, else None (looked up before any fork: a forked child only calls it)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def end_with_parent(signum: int = signal.SIGTERM) -> None:
    """This process receives ``signum`` when its parent ends (also by SIGKILL); when the parent has already gone
    while it was being set, at once."""
    prctl = _prctl()
    if prctl is None:
        return
    parent = os.getppid()
    if prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0 and os.getppid() != parent:
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def children_end_with_this_process(signum: int = signal.SIGTERM) -> Iterator[None]:
    """While open, every process subprocess.Popen starts receives ``signum`` when the thread that started it ends,
    with this process or alone, SIGKILL included: DeepSpeed's runner starts its child with subprocess.Popen from the
    main thread, its autotuner each experiment from a thread that waits for it."""
    prctl = _prctl()
    if prctl is None:
        yield
        return
    original = subprocess.Popen

    class EndingWithParent(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args, preexec_fn: Optional[Callable[[], None]] = None, **kwargs) -> None:
            def prepare() -> None:  # in the child, between fork and exec: the setting survives exec
                prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
                if preexec_fn is not None:
                    preexec_fn()

            super().__init__(*args, preexec_fn=prepare, **kwargs)

    subprocess.Popen = EndingWithParent  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = original  # type: ignore[misc]
