"""Checksums of a checkpoint's files: written at save, verified before load.

A file damaged after its save (a bad disk, a truncated copy, a stray write) used to load silently when the
damage left it readable: training went on from weights that were never saved. Each checkpoint directory now
holds `checksums.xxh128`, the XXH3-128 of every file in it, in `xxh128sum`'s format (so
`cd global_step8 && xxh128sum -c checksums.xxh128` checks it by hand too; Debian's package `xxhash`). It is
written after every rank has finished and every file has been flushed to disk (fsync), and before the COMPLETE
marker; loading checks it first and refuses a checkpoint with a missing or changed file, naming the file. With
async_save the large files' digests are computed while they are written (megatron.checkpoint.hashed_save) and only the small
ones are read back.

XXH3-128 rather than a cryptographic hash: it guards against damage, not tampering, and at ~10 GB/s (SHA-256:
1.2 GB/s on the 2-core machine) hashing a checkpoint as it is written or verified costs next to nothing. Checkpoints
saved before it was adopted carry `checksums.sha256` (`sha256sum`'s format) and are verified with it; checkpoints
without either (GPT-NeoX's, this project's older layout before checksums) are loaded unverified. A checkpoint of the
current layout (COMPLETE, and a neox_args.json recording `checkpoint_layout`, or none at all) always had one: with
its manifest deleted it is refused, naming the file (missing_manifest_problem), not loaded unverified as if it
were GPT-NeoX's (issue 32)."""

import hashlib
import os
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from megatron.checkpoint.format import ARGS_FILE, COMPLETE_MARKER, LAYOUT, LAYOUT_KEY, read_saved_args
from megatron.checkpoint.hashed_save import new_digest
from megatron.errors import CheckpointError

MANIFEST = "checksums.xxh128"
LEGACY_MANIFEST = "checksums.sha256"
ALGORITHMS: Dict[str, Tuple[str, Callable, int]] = {  # manifest: (name, new hash object, hex digits)
    MANIFEST: ("XXH3-128", new_digest, 32), LEGACY_MANIFEST: ("SHA-256", hashlib.sha256, 64)}
UNLISTED = ("COMPLETE", MANIFEST, LEGACY_MANIFEST)
"""Written after the manifest (COMPLETE) or a manifest itself: not listed in it."""
READ_CHUNK_BYTES = 4 << 20


def checkpoint_files(path: str) -> List[str]:
    """The files under checkpoint directory ``path``, relative to it, sorted, the UNLISTED ones left out."""
    found = []
    for root, _dirs, names in os.walk(path):
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), path)
            if relative not in UNLISTED and ".tmp" not in name:
                found.append(relative)
    return sorted(found)


def _fsync(path: str, directory: bool = False) -> None:
    handle = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def fsync_tree(path: str, files: Iterable[str]) -> None:
    """Flush ``files`` (relative to ``path``) and the directories holding them to disk, so that a power loss after
    COMPLETE is written cannot leave a complete-looking checkpoint with unwritten data."""
    directories = {path}
    for relative in files:
        _fsync(os.path.join(path, relative))
        directories.add(os.path.dirname(os.path.join(path, relative)))
    for directory in sorted(directories, reverse=True):
        _fsync(directory, directory=True)


def file_digest(path: str, manifest: str = MANIFEST) -> str:
    """The hex digest of file ``path`` with the algorithm of ``manifest`` (the file name)."""
    digest = ALGORITHMS[manifest][1]()
    buffer = bytearray(READ_CHUNK_BYTES)
    with open(path, "rb", buffering=0) as handle, memoryview(buffer) as view:
        while True:
            count = handle.readinto(view)
            if not count:
                return digest.hexdigest()
            digest.update(view[:count])


def write_manifest(path: str, known: Optional[Mapping[str, str]] = None) -> None:
    """fsync every file of checkpoint ``path``, then write (atomically, flushed) their checksums.

    ``known``: {relative file: XXH3-128 hex digest} computed while those files were written (megatron.checkpoint.hashed_save, async_save's
    writer): recorded as they are, not read back. They are the digests of the bytes the save meant to write, so a
    file damaged since does not get its damage recorded as the truth; the other files are read and hashed."""
    known = known or {}
    files = checkpoint_files(path)
    fsync_tree(path, files)
    digests = {relative: known.get(relative) or file_digest(os.path.join(path, relative)) for relative in files}
    write_atomically(os.path.join(path, MANIFEST), "".join(f"{digests[relative]}  {relative}\n" for relative in files))
    if os.path.isfile(os.path.join(path, LEGACY_MANIFEST)):  # a directory written again: one manifest, the new one
        os.remove(os.path.join(path, LEGACY_MANIFEST))


def write_atomically(path: str, text: str) -> None:
    """``path`` holds ``text`` or what it held before, also after a crash or power loss: a flushed temporary
    file renamed over it, the rename flushed too."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync(os.path.dirname(path) or ".", directory=True)


def manifest_of(path: str) -> Optional[str]:
    """The checksum file checkpoint ``path`` holds (the current kind first), None when it has none."""
    for name in (MANIFEST, LEGACY_MANIFEST):
        if os.path.isfile(os.path.join(path, name)):
            return name
    return None


def read_manifest(path: str) -> Optional[Dict[str, str]]:
    """{relative file: hex digest} of checkpoint ``path`` (with manifest_of's algorithm), None when it has no
    manifest; ValueError when unreadable."""
    manifest = manifest_of(path)
    if manifest is None:
        return None
    target = os.path.join(path, manifest)
    name, _, width = ALGORITHMS[manifest]
    digests: Dict[str, str] = {}
    with open(target, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            digest, separator, relative = line.rstrip("\n").partition("  ")
            if not separator or len(digest) != width or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{target} line {number} is not '<{name} hex digest>  <file>'")
            digests[relative] = digest
    return digests


def missing_manifest_problem(path: str) -> Optional[str]:
    """Why checkpoint ``path``, which has no manifest, cannot be loaded unverified, or None. Every save of the
    current layout writes the manifest before COMPLETE: a directory with COMPLETE whose neox_args.json records
    `checkpoint_layout` (or is missing too) lost it. GPT-NeoX's checkpoints (no COMPLETE) and this project's older
    layout (a neox_args.json without `checkpoint_layout`) never had one."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return None
    args_file = os.path.join(path, ARGS_FILE)
    if os.path.isfile(args_file):
        try:
            if read_saved_args(args_file).get(LAYOUT_KEY) != LAYOUT:
                return None
        except CheckpointError as exc:
            return str(exc)
    return (f"its {MANIFEST} is missing, though it is a checkpoint of this project's current layout ({COMPLETE_MARKER}, "
            f"{ARGS_FILE} {'recording ' + LAYOUT_KEY if os.path.isfile(args_file) else 'missing too'}), whose saves "
            f"always write it: its files cannot be verified. Restore it; or, if you removed it knowingly and trust "
            f"the files, write it again: python -c \"from megatron.checkpoint.integrity import write_manifest; "
            f"write_manifest('{path}')\"")


def verification_problems(path: str) -> List[str]:
    """What is wrong with checkpoint ``path``'s files against its manifest (empty: intact, or a layout that never
    had a manifest: missing_manifest_problem)."""
    try:
        digests = read_manifest(path)
    except ValueError as exc:
        return [f"its {manifest_of(path)} is damaged ({exc})"]
    if digests is None:
        problem = missing_manifest_problem(path)
        return [problem] if problem else []
    manifest = manifest_of(path)
    problems = []
    for relative, digest in digests.items():
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            problems.append(f"{relative} is missing")
        elif file_digest(file, manifest) != digest:
            problems.append(f"{relative} is damaged (its {ALGORITHMS[manifest][0]} differs from the one recorded "
                            f"when it was saved)")
    return problems
