"""Asynchronous checkpoint saves (``async_save``): the step goes on while the files are written.

DeepSpeed's engine writes every checkpoint file through its ``checkpoint_engine``. ``BackgroundWriter`` takes
that place: its ``save`` copies the state (to CPU memory, so the next optimizer step cannot change what is
written) and hands it to one writer thread per rank, which writes and fsyncs the files at a low CPU priority
(the step, which needs the cores, keeps most of them), hashing each file's bytes as it writes them
(megatron.hashed_save: no torch CRC32, no reading back for the checksums). ``AsyncCheckpoints`` keeps the save
atomic as megatron.checkpointing's synchronous one is: the checkpoint is completed (checksums, ``COMPLETE``,
``latest``) only once every rank's writer has finished, so a kill at any moment leaves either the previous
checkpoint named by ``latest`` or a directory without ``COMPLETE`` that no resume loads. Completion is noticed
without stalling: after each step the ranks agree (one tiny all-reduce, only while a save is in flight) whether
all writes are done, rank 0 gathers the digests every rank's writer computed, and its writer thread then writes
the checksums (reading back only the small files written outside the writer) and the markers. A save that comes
while the previous one is still writing, and the end of the run, wait for it.
"""
from __future__ import annotations

import copy
import os
import queue
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from megatron.checkpoint_files import CheckpointError
from megatron.hashed_save import save_hashed

WRITING, DONE, FAILED = 0, 1, -1
WRITER_NICENESS = 10
"""The background writer's niceness (lower_thread_priority)."""


def snapshot(state: Any) -> Any:
    """A deep copy of ``state`` in CPU memory. Each tensor is copied once (one tensor object met twice stays one
    in the copy) and on its own: a view is saved as its own elements, not with the whole buffer it views."""
    memo: Dict[int, Any] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().to("cpu", copy=True)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(state)
    with torch.no_grad():
        return copy.deepcopy(state, memo)


def lower_thread_priority() -> None:
    """Give the calling thread a low CPU priority (nice WRITER_NICENESS), where the system allows it.

    Linux schedules threads on their own. On a machine whose cores all train (CPU training), a writer at normal
    priority took a share of every core and the step it overlapped grew by 15-20 %; at nice 19 the step kept its
    speed but the writer got next to no CPU, so the write was still running at the next save, which waited for it
    (the loop's pause grew back to the synchronous save's). At nice 10 the write spreads over a few steps, each
    5-15 % slower on 2 CPU cores (bench/async_save.py); on a GPU the cores are mostly idle and the write costs the
    step little. Elsewhere (no per-thread priorities, or not permitted) the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):
        pass


class BackgroundWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine for one rank, writing in a thread; loading is the wrapped engine's."""

    def __init__(self, inner: CheckpointEngine) -> None:
        super().__init__()
        self.name = "BackgroundWriter"
        self.inner = inner
        self._jobs: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._digests: Dict[str, str] = {}  # {absolute path: sha256} of the files written, until taken
        self._digests_lock = threading.Lock()  # a failed save takes them while another file may still be written
        self._thread = threading.Thread(target=self._work, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        lower_thread_priority()
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # reported by status() / wait() on the training thread
                self._error = exc
            finally:
                self._jobs.task_done()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the writer thread after the files queued before it."""
        self._jobs.put(job)

    def save(self, state_dict: Any, path: str) -> None:
        copied = snapshot(state_dict)

        def write() -> None:
            digest = save_hashed(copied, path)
            with self._digests_lock:
                self._digests[os.path.abspath(path)] = digest

        self.submit(write)

    def status(self) -> int:
        """FAILED, DONE (nothing queued or being written) or WRITING."""
        if self._error is not None:
            return FAILED
        return DONE if self._jobs.unfinished_tasks == 0 else WRITING

    def wait(self) -> None:
        self._jobs.join()

    def take_digests(self, directory: str) -> Dict[str, str]:
        """{file relative to ``directory``: sha256} of the files written under it so far (forgotten here)."""
        root = os.path.abspath(directory)
        with self._digests_lock:
            taken = {name: digest for name, digest in self._digests.items()
                     if os.path.commonpath([root, name]) == root}
            for name in taken:
                del self._digests[name]
        return {os.path.relpath(name, root): digest for name, digest in taken.items()}

    def take_error(self) -> Optional[BaseException]:
        error, self._error = self._error, None
        return error

    def create(self, info: CheckpointCommitInfo) -> None:
        self.inner.create(info)

    def makedirs(self, path, exist_ok=False) -> None:
        self.inner.makedirs(path, exist_ok=exist_ok)

    def load(self, path: str, map_location=None):
        return self.inner.load(path, map_location=map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # AsyncCheckpoints completes the checkpoint once every rank's files are written

    def is_data_parallel_writer(self, dp_rank) -> bool:
        return self.inner.is_data_parallel_writer(dp_rank)

    def preserves_storage_sharing(self) -> bool:
        return True


class AsyncCheckpoints:
    """The checkpoint in flight (at most one) of a run with ``async_save``."""

    def __init__(self, engine, device: torch.device, complete: Callable[[str, int, Dict[str, str]], None],
                 failure: Callable[[str, BaseException], CheckpointError]) -> None:
        """``complete(path, iteration, digests)``: rank 0's completion (checksums, COMPLETE, latest, pruning),
        ``digests`` being {file relative to path: sha256} of the files every rank's writer wrote;
        ``failure(path, exc)``: the error to raise when a write failed (and the partial directory is removed)."""
        self.writer = BackgroundWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        self.device = device
        self._complete, self._failure = complete, failure
        self.pending: Optional[tuple] = None  # (path, iteration) written but not yet complete

    def started(self, path: str, iteration: int) -> None:
        """The engine has queued ``path``'s files (megatron.checkpointing.save_checkpoint with complete=False)."""
        self.pending = (path, iteration)

    def _agreed(self, status: int) -> int:
        """The worst status over all ranks (FAILED < WRITING < DONE)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return status
        value = torch.tensor([status], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value.item())

    def poll(self) -> bool:
        """After a step: complete the checkpoint in flight if every rank has written its files (collective while
        a save is in flight, so every rank calls it at the same point). True when one was completed."""
        if self.pending is None:
            return False
        status = self._agreed(self.writer.status())
        if status == WRITING:
            return False
        self._finish(status)
        return True

    def wait(self) -> None:
        """Block until the checkpoint in flight is written and complete (before a new save, at the end)."""
        if self.pending is not None:
            self.writer.wait()
            self._finish(self._agreed(self.writer.status()))
        self.writer.wait()  # rank 0: its completion job
        error = self.writer.take_error()
        if error is not None:
            raise CheckpointError(f"completing the last checkpoint failed: {type(error).__name__}: {error}")

    def _gathered_digests(self, path: str) -> Tuple[bool, Dict[str, str]]:
        """(whether this is rank 0, the digests of ``path``'s files that every rank's writer wrote): collective."""
        digests = self.writer.take_digests(path)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return True, digests
        rank0 = dist.get_rank() == 0
        gathered = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object(digests, gathered, dst=0)
        return rank0, {name: digest for part in (gathered or []) for name, digest in part.items()}

    def _finish(self, status: int) -> None:
        path, iteration = self.pending
        self.pending = None
        if status == FAILED:
            self.writer.take_digests(path)
            error = self.writer.take_error() or OSError("another rank could not write its checkpoint files")
            raise self._failure(path, error)
        rank0, digests = self._gathered_digests(path)
        if rank0:
            self.writer.submit(lambda: self._complete(path, iteration, digests))
