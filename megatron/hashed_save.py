"""``torch.save`` into a file, hashing the bytes as they are written (one pass), without torch's CRC32.

async_save's writer thread shares the cores with training (CPU training) and every CPU second it spends slows the
steps it overlaps. Checksumming a checkpoint used to cost two more passes over its bytes: torch.save's CRC32 of
every record, then reading each file back to compute the SHA-256 that checksums.sha256 records
(megatron.checkpoint_integrity). Here the SHA-256 is computed from the very bytes handed to the file, as they are
handed, and the file is never read back; the digest is of what the save meant to write, so a byte damaged on its
way to the disk or later is caught when the checkpoint is verified before a load.

torch.load does not check the CRC32 fields (a file with a flipped byte loads silently with or without them), so
the SHA-256 is what protects the checkpoint and the CRC32 is skipped. torch's switch for it
(``torch.serialization.set_crc32_options``) is process-wide: flipping it on the writer thread would change the
files that the training thread's own torch.save writes at the same time. So the writer builds torch's zip writer
itself with the CRC32 off for this one file (``torch._C.PyTorchFileWriter`` and ``torch.serialization._save``,
which torch.save calls with the global setting) and leaves the setting alone. Where that internal interface is
not the one this was written against, it falls back to torch.save (CRC32 computed: correct, a little slower)."""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, BinaryIO

import torch
import torch.serialization as serialization

WRITE_BUFFER_BYTES = 1 << 20
"""The file's buffer: torch's zip writer hands over each tensor in one call, the small headers go through it."""


class HashingFile:
    """A write-only, forward-only file: each write goes to the file and into the SHA-256."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)  # hashlib releases the GIL for large buffers, as the file write does
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _crc32_free_save(obj: Any, file: HashingFile) -> None:
    """torch.save(obj, file), its zip writer built with the CRC32 off for this file only."""
    writer = torch._C.PyTorchFileWriter(file, False, serialization._get_storage_alignment())
    serialization._save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _crc32_free_save_available() -> bool:
    """Whether torch's internals are the ones _crc32_free_save calls (checked once on a tiny object)."""
    try:
        import io

        probe = HashingFile(io.BytesIO())
        _crc32_free_save({"probe": torch.zeros(1)}, probe)
        return torch.load(io.BytesIO(probe.handle.getvalue()), weights_only=True)["probe"].shape == (1,)
    except Exception:  # another torch version: torch.save with its CRC32
        return False


SKIPS_CRC32 = _crc32_free_save_available()


def save_hashed(obj: Any, path: str) -> str:
    """Write ``obj`` to ``path`` as torch.save does (torch.load reads it), flushed to disk (fsync); returns the
    SHA-256 (hex) of the bytes written."""
    with open(path, "wb", buffering=WRITE_BUFFER_BYTES) as handle:
        file = HashingFile(handle)
        if SKIPS_CRC32:
            _crc32_free_save(obj, file)
        else:
            torch.save(obj, file)
        file.flush()
        os.fsync(handle.fileno())
    return file.sha256.hexdigest()
