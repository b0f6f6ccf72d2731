"""Asynchronous checkpoint saves (``async_save``): the step goes on while the files are written.

DeepSpeed's engine writes every checkpoint file through its ``checkpoint_engine``. ``BackgroundWriter`` takes
that place: its ``save`` copies the state (to CPU memory, into page-aligned blocks kept from one save to the next,
so the next optimizer step cannot change what is written) and hands it to one writer thread per rank, which
writes and fsyncs the files at a low CPU priority, hashing each file's bytes as it writes them
(megatron.checkpoint.hashed_save: past the page cache from the copies' own memory, XXH3-128, no torch CRC32, no reading back
for the checksums), its writes paced over most of the time to the next save (WritePacer) so that no one step
bears the disk's cost. ``AsyncCheckpoints`` keeps the save atomic as megatron.checkpoint.engine's synchronous one is:
the checkpoint is completed (checksums, ``COMPLETE``, ``latest``) only once every rank's writer has finished, so a
kill at any moment leaves either the previous checkpoint named by ``latest`` or a directory without ``COMPLETE``
that no resume loads. Completion is noticed without stalling: after each step the ranks agree (one tiny
all-reduce, only while a save is in flight) whether all writes are done, rank 0 gathers the digests every rank's
writer computed, and its writer thread then writes the checksums (reading back only the small files written
outside the writer) and the markers. A save that comes while the previous one is still writing, and the end of
the run, wait for it (unpaced).
"""
from __future__ import annotations

import collections
import copy
import mmap
import os
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from megatron.checkpoint.files import savable
from megatron.checkpoint.hashed_save import BLOCK, save_hashed
from megatron.errors import CheckpointError
from megatron.mpu.host_collectives import all_reduce, gather_object

WRITING, DONE, FAILED = 0, 1, -1
PACE_SHARE = 0.75
"""The share of the time until the next save over which a checkpoint's writes are spread (WritePacer): the rest
is margin for the final flush, a slower disk or slower steps, so that the next save rarely waits for this one."""
WRITER_NICENESS = 10
"""The background writer's niceness (lower_thread_priority)."""


class ArenaPool:
    """Page-aligned blocks of memory for snapshots, kept from one save to the next.

    A fresh block for every save cost the loop's pause the kernel's work of mapping and zeroing every page (845 MB
    on the 2-core machine: a pause of 0.41-0.66 s, against 0.13 s into a block used before); the next save of the
    same files needs blocks of the same sizes, so a block whose file is written is given back and taken again. The price is memory:
    one copy of the saved state stays allocated between saves (async_save needs it at every save anyway)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: List[mmap.mmap] = []

    def take(self, nbytes: int) -> mmap.mmap:
        """A block of at least ``nbytes`` (the smallest free one, or a new one)."""
        with self._lock:
            fitting = [arena for arena in self._free if len(arena) >= nbytes]
            if fitting:
                arena = min(fitting, key=len)
                self._free.remove(arena)
                return arena
        return mmap.mmap(-1, nbytes)

    def give_back(self, arena: mmap.mmap) -> None:
        """``arena``'s copies are written (or their save failed): nothing reads them any more."""
        with self._lock:
            self._free.append(arena)


def snapshot(state: Any, arenas: ArenaPool) -> Tuple[Any, Optional[mmap.mmap]]:
    """(A deep copy of ``state`` in CPU memory, the block of ``arenas`` it lies in, to give back once the copy is
    written). Each tensor is copied once (one tensor object met twice stays one in the copy) and on its own: a view
    is saved as its own elements, not with the whole buffer it views. The copies lie at page-aligned addresses of
    the block, each its own storage, so that the writer hands them to the disk without copying them again
    (megatron.checkpoint.hashed_save writes with O_DIRECT)."""
    tensors = _distinct_tensors(state)
    alignable = {key: tensor for key, tensor in tensors.items() if _alignable(tensor)}
    offsets, end = {}, 0
    for key, tensor in alignable.items():
        offsets[key] = end
        end += -(-tensor.numel() * tensor.element_size() // BLOCK) * BLOCK
    arena = arenas.take(end) if end else None
    memo: Dict[int, Any] = {}
    with torch.no_grad():
        for key, tensor in tensors.items():
            if key in alignable:
                copied = torch.frombuffer(arena, dtype=tensor.dtype, count=tensor.numel(), offset=offsets[key])
                memo[key] = copied.view(tensor.shape).copy_(tensor.detach())
            else:
                memo[key] = tensor.detach().to("cpu", copy=True)
        return copy.deepcopy(state, memo), arena


def _distinct_tensors(state: Any) -> Dict[int, torch.Tensor]:
    """{id: tensor} of the tensors in ``state``'s dicts, lists and tuples, each once, in the order met."""
    tensors: Dict[int, torch.Tensor] = {}

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensors.setdefault(id(obj), obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value)

    visit(state)
    return tensors


def _tensor_bytes(state: Any) -> int:
    """The bytes of the distinct tensors in ``state`` (about the size of its file)."""
    return sum(t.numel() * t.element_size() for t in _distinct_tensors(state).values())


def _alignable(tensor: torch.Tensor) -> bool:
    """Whether snapshot can place a copy of ``tensor`` in its aligned block (a plain dense tensor, not empty)."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and tensor.numel() > 0 and not tensor.is_quantized and not tensor.is_complex())


def lower_thread_priority() -> None:
    """Give the calling thread a low CPU priority (nice WRITER_NICENESS), where the system allows it.

    Linux schedules threads on their own. On a machine whose cores all train (CPU training), the first writer
    (buffered writes, SHA-256) at normal priority took a share of every core and the step it overlapped grew by
    15-20 %; at nice 19 it got next to no CPU and was still writing at the next save, which waited for it. The
    writer now needs little CPU (megatron.checkpoint.hashed_save) and its pace is set by WritePacer; nice 10 keeps what CPU it
    does need (pickling, hashing) from delaying the step's threads. Elsewhere (no per-thread priorities, or not
    permitted) the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
    except (AttributeError, OSError):
        pass


class WritePacer:
    """Spreads a checkpoint's disk writes over the steps before the next save.

    On the 2-core test machine the disk's own work (a virtual disk: the hypervisor's I/O runs on the cores the VM
    trains on, seen as steal time) cost ~1.1 s of the training's CPU per 845 MB however the writer wrote, and
    written at full speed it all landed on the step after the save (1.19x). Paced, the same cost spreads over
    several steps. ``spread(seconds)`` sets the rate that writes what is still queued in that time; ``hurry()``
    (a save waiting for this one, the end of the run) lifts it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hurry = threading.Event()
        self._queued = 0  # bytes queued and not yet handed to the disk (an estimate: the tensors' bytes)
        self._rate: Optional[float] = None  # bytes per second; None: as fast as the disk takes them
        self._start = 0.0
        self._sent = 0

    def queue(self, nbytes: int) -> None:
        with self._lock:
            self._queued += nbytes

    def spread(self, seconds: float) -> None:
        """Write what is queued in about ``seconds`` from now."""
        with self._lock:
            if self._queued <= 0 or seconds <= 0:
                return
            self._rate, self._start, self._sent = self._queued / seconds, time.monotonic(), 0
            self._hurry.clear()

    def hurry(self) -> None:
        with self._lock:
            self._rate = None
            self._hurry.set()

    def wrote(self, nbytes: int) -> None:
        """The writer thread handed ``nbytes`` to the disk: wait until the rate allows the next ones."""
        with self._lock:
            self._queued = max(0, self._queued - nbytes)
            if self._rate is None:
                return
            self._sent += nbytes
            delay = self._start + self._sent / self._rate - time.monotonic()
        if delay > 0:
            self._hurry.wait(delay)


class BackgroundWriter(CheckpointEngine):
    """DeepSpeed's checkpoint engine for one rank, writing in a thread; loading is the wrapped engine's."""

    def __init__(self, inner: CheckpointEngine) -> None:
        super().__init__()
        self.name = "BackgroundWriter"
        self.inner = inner
        self._jobs: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._digests: Dict[str, str] = {}  # {absolute path: XXH3-128} of the files written, until taken
        self._digests_lock = threading.Lock()  # a failed save takes them while another file may still be written
        self.pacer = WritePacer()
        self.arenas = ArenaPool()
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
        copied, arena = snapshot(savable(state_dict, path), self.arenas)
        self.pacer.queue(_tensor_bytes(copied))

        def write() -> None:
            try:
                digest = save_hashed(copied, path, pace=self.pacer.wrote)
            finally:
                if arena is not None:
                    self.arenas.give_back(arena)
            with self._digests_lock:
                self._digests[os.path.abspath(path)] = digest

        self.submit(write)

    def status(self) -> int:
        """FAILED, DONE (nothing queued or being written) or WRITING."""
        if self._error is not None:
            return FAILED
        return DONE if self._jobs.unfinished_tasks == 0 else WRITING

    def wait(self) -> None:
        self.pacer.hurry()
        self._jobs.join()

    def take_digests(self, directory: str) -> Dict[str, str]:
        """{file relative to ``directory``: XXH3-128} of the files written under it so far (forgotten here)."""
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

    def __init__(self, engine, complete: Callable[[str, int, Dict[str, str]], None],
                 failure: Callable[[str, BaseException], CheckpointError]) -> None:
        """``complete(path, iteration, digests)``: rank 0's completion (checksums, COMPLETE, latest, pruning),
        ``digests`` being {file relative to path: XXH3-128} of the files every rank's writer wrote;
        ``failure(path, exc)``: the error to raise when a write failed (and the partial directory is removed)."""
        self.writer = BackgroundWriter(engine.checkpoint_engine)
        engine.checkpoint_engine = self.writer
        self._complete, self._failure = complete, failure
        self.pending: Optional[tuple] = None  # (path, iteration) written but not yet complete
        self._step_ends: Deque[float] = collections.deque(maxlen=9)  # time.monotonic() at the last polls

    def step_seconds(self) -> Optional[float]:
        """The median time between the last steps (a step with an evaluation or a save is an outlier), None
        before two steps."""
        ends = list(self._step_ends)
        gaps = sorted(later - earlier for earlier, later in zip(ends, ends[1:]))
        return gaps[len(gaps) // 2] if gaps else None

    def started(self, path: str, iteration: int, steps_ahead: Optional[int] = None) -> None:
        """The engine has queued ``path``'s files (megatron.checkpoint.engine.save_checkpoint with complete=False).
        ``steps_ahead``: the steps until the next save (or the run's end): the writes are spread over PACE_SHARE
        of their time; None: written as fast as the disk takes them."""
        self.pending = (path, iteration)
        step = self.step_seconds()
        if steps_ahead and step:
            self.writer.pacer.spread(PACE_SHARE * steps_ahead * step)

    def _agreed(self, status: int) -> int:
        """The worst status over all ranks (FAILED < WRITING < DONE)."""
        return int(all_reduce([status], op="min", dtype=torch.int32).item())

    def poll(self) -> bool:
        """After a step: complete the checkpoint in flight if every rank has written its files (collective while
        a save is in flight, so every rank calls it at the same point). True when one was completed."""
        self._step_ends.append(time.monotonic())
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
        gathered = gather_object(self.writer.take_digests(path), dst=0)
        return gathered is not None, {name: digest for part in (gathered or []) for name, digest in part.items()}

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
