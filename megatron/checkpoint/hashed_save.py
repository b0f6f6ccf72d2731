"""``torch.save`` into a file written past the page cache (O_DIRECT), hashed (XXH3-128) as it is written.

async_save's writer thread shares the cores with training (CPU training), and every CPU second it spends slows the
steps it overlaps. Measured on a 2-core machine writing an 845 MB model-and-Adam file while training: the buffered
``write`` calls alone took 1.0-1.2 s of CPU (the kernel copying every byte into the page cache, then writing it back),
a SHA-256 of the bytes 0.7 s, torch's CRC32 of every record more; the step they overlapped grew by 20 %. Here:

- the file is opened with O_DIRECT, so the disk reads the bytes straight from the tensors' memory (0.02 s of CPU for
  800 MB). O_DIRECT needs the memory, the file offset and the length aligned to the disk's block: torch's zip writer
  is asked to start every record at a BLOCK-aligned offset, async_save's snapshot puts every tensor at a
  page-aligned address (megatron.checkpoint.async_save.snapshot), and the small pieces between (headers, padding, a
  record's last partial block) go through an aligned staging buffer. A piece that is not aligned is staged too (a
  copy, still correct), and where the file system refuses O_DIRECT the file is written the ordinary way;
- the checksum is XXH3-128 (xxhash: ~10 GB/s against SHA-256's 1.2 GB/s here), computed from the very bytes handed to
  the file, so the file is never read back; megatron.checkpoint.integrity records it in ``checksums.xxh128``;
- torch's CRC32 is skipped: torch.load never checks it (a file with a flipped byte loads silently with or without
  it), the XXH3-128 is what protects the checkpoint. torch's switch for it (``set_crc32_options``) is process-wide
  and flipping it here would change the files the training thread's own torch.save writes meanwhile, so the writer
  builds torch's zip writer itself (``torch._C.PyTorchFileWriter`` and ``torch.serialization._save``, which torch.save
  calls with the global settings). Where that internal interface is not the one this was written against, it falls
  back to torch.save (CRC32 computed, records at torch's own alignment: correct, a little slower)."""
from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.serialization as serialization
import xxhash

BLOCK = 4096
"""O_DIRECT's alignment (the largest logical block size of common disks; a page)."""
STAGING_BYTES = 1 << 20
"""The aligned buffer that gathers the pieces written between aligned records."""
CHUNK_BYTES = 8 << 20
"""The most one write call hands to the disk: the pace callback is called between chunks."""


def new_digest() -> "xxhash.xxh3_128":
    """The checksum of checkpoint files (megatron.checkpoint.integrity records its hexdigest)."""
    return xxhash.xxh3_128()


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _open_for_writing(path: str) -> tuple:
    """(file descriptor, whether it writes past the page cache): O_DIRECT where the system and file system allow."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o666), True
        except OSError as exc:  # e.g. a file system without O_DIRECT
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o666), False


class DirectFile:
    """A write-only, forward-only file for torch's zip writer: large aligned pieces go to the disk from where they
    lie, the rest through an aligned staging buffer; every byte goes into the digest as it is handed over."""

    def __init__(self, path: str, pace: Optional[Callable[[int], None]] = None) -> None:
        """``pace(n)`` is called after each n bytes handed to the disk (it may sleep: async_save's write pacing)."""
        self.pace = pace
        self.fd, self.direct = _open_for_writing(path)
        self.digest = new_digest()
        self.size = 0  # bytes handed over
        self._staging = mmap.mmap(-1, STAGING_BYTES)  # page-aligned
        self._staged = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        length = len(view)
        if not length:
            return 0
        self.digest.update(view)  # xxhash releases the GIL for large pieces, as os.write does
        self.size += length
        if length >= BLOCK and (not self.direct or (self._staged % BLOCK == 0 and _address(view) % BLOCK == 0)):
            self._drain()  # with O_DIRECT whole blocks only: the file offset stays aligned
            whole = length - length % BLOCK if self.direct else length
            self._write_out(view[:whole])
            view = view[whole:]
        while len(view):
            taken = min(len(view), STAGING_BYTES - self._staged)
            self._staging[self._staged:self._staged + taken] = view[:taken]
            self._staged += taken
            view = view[taken:]
            if self._staged == STAGING_BYTES:
                self._drain()
        return length

    def flush(self) -> None:
        """Nothing to do before close: the staged bytes are not a whole block yet."""
    def _drain(self) -> None:
        if self._staged:
            with memoryview(self._staging) as staged:
                self._write_out(staged[:self._staged])
            self._staged = 0

    def _write_out(self, view: memoryview) -> None:
        while len(view):
            try:
                written = os.write(self.fd, view[:CHUNK_BYTES])
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self._stop_direct()  # the file system took the open but not the write: the ordinary way
                continue
            view = view[written:]
            if self.pace is not None:
                self.pace(written)

    def _stop_direct(self) -> None:
        import fcntl  # only where O_DIRECT exists (Linux); not importable on every system

        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False

    def close(self) -> None:
        """Write the last partial block (padded to a whole one, the file then cut to its size), flush to disk."""
        try:
            if self._staged:
                if self.direct and self._staged % BLOCK:
                    tail = self._staged
                    self._staged += BLOCK - tail % BLOCK
                    self._drain()
                    os.ftruncate(self.fd, self.size)
                else:
                    self._drain()
            os.fsync(self.fd)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without writing what is staged (the save failed: the partial file is the caller's to remove)."""
        os.close(self.fd)
        try:
            self._staging.close()
        except BufferError:  # a view of it still held by the traceback of a failed write: freed along with it
            pass


def _crc32_free_save(obj: Any, file) -> None:
    """torch.save(obj, file), its zip writer built with the CRC32 off and the records BLOCK-aligned."""
    writer = torch._C.PyTorchFileWriter(file, False, max(BLOCK, serialization._get_storage_alignment()))
    try:
        serialization._save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        try:  # as torch.save does: ended here, or the writer's destructor ends it later and aborts if that fails
            writer.write_end_of_file()
        except Exception:
            pass  # the first error is the one to report
        raise
    writer.write_end_of_file()


def _crc32_free_save_available() -> bool:
    """Whether torch's internals are the ones _crc32_free_save calls (checked once on a tiny object)."""
    class Probe(io.BytesIO):
        pass

    try:
        probe = Probe()
        _crc32_free_save({"probe": torch.zeros(1)}, probe)
        return torch.load(io.BytesIO(probe.getvalue()), weights_only=True)["probe"].shape == (1,)
    except Exception:  # another torch version: torch.save with its CRC32
        return False


SKIPS_CRC32 = _crc32_free_save_available()


def save_hashed(obj: Any, path: str, pace: Optional[Callable[[int], None]] = None) -> str:
    """Write ``obj`` to ``path`` as torch.save does (torch.load reads it), flushed to disk (fsync); returns the
    XXH3-128 (hex) of the bytes written. ``pace``: DirectFile's."""
    file = DirectFile(path, pace)
    try:
        if SKIPS_CRC32:
            _crc32_free_save(obj, file)
        else:
            torch.save(obj, file)
    except BaseException:
        file.abandon()
        raise
    file.close()
    return file.digest.hexdigest()
