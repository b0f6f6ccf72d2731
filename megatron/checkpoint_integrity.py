"""Checksums of a checkpoint's files: written at save, verified before load.

A file damaged after its save (a bad disk, a truncated copy, a stray write) used to load silently when the
damage left it readable: training went on from weights that were never saved. Each checkpoint directory now
holds `checksums.sha256`, the SHA-256 of every file in it, in `sha256sum`'s format (so
`cd global_step8 && sha256sum -c checksums.sha256` checks it by hand too). It is written after every rank has
finished and every file has been flushed to disk (fsync), and before the COMPLETE marker; loading checks it
first and refuses a checkpoint with a missing or changed file, naming the file. With async_save the large files'
digests are computed while they are written (megatron.hashed_save) and only the small ones are read back.

Checkpoints without the file (GPT-NeoX's, and this project's before it was introduced) are loaded unverified."""

import hashlib
import os
from typing import Dict, Iterable, List, Mapping, Optional

MANIFEST = "checksums.sha256"
UNLISTED = ("COMPLETE", MANIFEST)
"""Written after the manifest (COMPLETE) or the manifest itself: not listed in it."""


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


def file_digest(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def write_manifest(path: str, known: Optional[Mapping[str, str]] = None) -> None:
    """fsync every file of checkpoint ``path``, then write (atomically, flushed) their checksums.

    ``known``: {relative file: sha256} computed while those files were written (megatron.hashed_save, async_save's
    writer): recorded as they are, not read back. They are the digests of the bytes the save meant to write, so a
    file damaged since does not get its damage recorded as the truth; the other files are read and hashed."""
    known = known or {}
    files = checkpoint_files(path)
    fsync_tree(path, files)
    digests = {relative: known.get(relative) or file_digest(os.path.join(path, relative)) for relative in files}
    write_atomically(os.path.join(path, MANIFEST), "".join(f"{digests[relative]}  {relative}\n" for relative in files))


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


def read_manifest(path: str) -> Optional[Dict[str, str]]:
    """{relative file: sha256} of checkpoint ``path``, None when it has no manifest; ValueError when unreadable."""
    target = os.path.join(path, MANIFEST)
    if not os.path.isfile(target):
        return None
    digests: Dict[str, str] = {}
    with open(target, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            digest, separator, relative = line.rstrip("\n").partition("  ")
            if not separator or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{target} line {number} is not '<sha256>  <file>'")
            digests[relative] = digest
    return digests


def verification_problems(path: str) -> List[str]:
    """What is wrong with checkpoint ``path``'s files against its manifest (empty: intact or no manifest)."""
    try:
        digests = read_manifest(path)
    except ValueError as exc:
        return [f"its {MANIFEST} is damaged ({exc})"]
    if digests is None:
        return []
    problems = []
    for relative, digest in digests.items():
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            problems.append(f"{relative} is missing")
        elif file_digest(file) != digest:
            problems.append(f"{relative} is damaged (its SHA-256 differs from the one recorded when it was saved)")
    return problems
