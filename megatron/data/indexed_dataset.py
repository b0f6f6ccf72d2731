"""Megatron / GPT-NeoX memory-mapped indexed datasets (`.bin` + `.idx`), readable and writable here.

Byte layout of `{prefix}.idx` (all little-endian), identical to Megatron-LM and GPT-NeoX:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    u64       version = 1
    u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64       number of sequences N
    u64       number of doc_idx entries D (= documents + 1)
    i32[N]    sizes: tokens per sequence
    i64[N]    pointers: byte offset of each sequence in the .bin
    i64[D]    doc_idx: index of the first sequence of each document, then N

`{prefix}.bin` is the sequences' tokens back to back in that dtype. Files written here load in
GPT-NeoX / Megatron-LM and theirs load here.
"""

from __future__ import annotations

import glob
import os
import struct
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from megatron.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
LEGACY_INDEX_MAGIC = b"TNTIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def index_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def data_file_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def best_fitting_dtype(vocab_size: int | None) -> type:
    """uint16 when every id fits comfortably (vocab < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def dataset_path_problem(prefix: str | os.PathLike, option: str) -> str | None:
    """Why `prefix` (a data path, given without .bin/.idx) cannot be opened, naming `option`; None if it can."""
    prefix = os.fspath(prefix)
    missing = [p for p in (index_file_path(prefix), data_file_path(prefix)) if not os.path.isfile(p)]
    if not missing:
        return None
    hint = "create the dataset with tools/datasets/preprocess_data.py"
    stem, suffix = os.path.splitext(prefix)
    written = written_datasets(prefix)
    if suffix in (".bin", ".idx") and dataset_exists(stem):
        hint = f"data paths are prefixes without .bin/.idx: write '{stem}'"
    elif written:
        hint = (f"preprocess_data.py names its output <output-prefix>_<json key>_document: write "
                f"{' or '.join(repr(p) for p in written)}")
    return f"{option}: {' and '.join(repr(p) for p in missing)} not found ({hint})"


def written_datasets(output_prefix: str) -> list[str]:
    """The datasets tools/datasets/preprocess_data.py wrote for ``output_prefix`` (one per JSON key:
    <output_prefix>_<key>_document), for the data path written as the --output-prefix it was given."""
    found = glob.glob(index_file_path(f"{glob.escape(output_prefix)}_*_document"))
    return sorted(p[:-len(".idx")] for p in found if dataset_exists(p[:-len(".idx")]))


def _read_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray, np.memmap]:
    """Parse and validate an .idx file; returns dtype, sizes, pointers, doc_idx and the backing memmap."""
    if not os.path.isfile(idx_path):
        raise DataError(
            f"index file not found: '{idx_path}'. Create it with tools/datasets/preprocess_data.py "
            f"(data path prefixes are given without the .bin/.idx suffix)."
        )
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as fh:
        header = fh.read(HEADER_SIZE)
    if header.startswith(LEGACY_INDEX_MAGIC):
        raise DataError(
            f"'{idx_path}' is a legacy (cached / lazy) indexed dataset; only the mmap format is supported. "
            f"Re-run tools/datasets/preprocess_data.py to convert it."
        )
    if len(header) < HEADER_SIZE or not header.startswith(INDEX_MAGIC):
        raise DataError(
            f"'{idx_path}' is not a Megatron mmap index (bad magic or truncated header); "
            f"regenerate it with tools/datasets/preprocess_data.py."
        )
    off = len(INDEX_MAGIC)
    (version,) = struct.unpack_from("<Q", header, off)
    (code,) = struct.unpack_from("<B", header, off + 8)
    n, d = struct.unpack_from("<QQ", header, off + 9)
    if version != INDEX_VERSION:
        raise DataError(f"'{idx_path}': index version {version} is not supported (expected {INDEX_VERSION}).")
    if code not in DTYPE_CODES:
        raise DataError(f"'{idx_path}': unknown dtype code {code} (known: {sorted(DTYPE_CODES)}).")
    expected = HEADER_SIZE + n * 4 + n * 8 + d * 8
    if file_size != expected:
        raise DataError(
            f"'{idx_path}' is {'truncated' if file_size < expected else 'too long'}: {file_size} bytes, "
            f"expected {expected} for {n} sequences and {d} doc_idx entries; regenerate the dataset."
        )
    buf = np.memmap(idx_path, mode="r", order="C")
    sizes = np.frombuffer(buf, dtype=np.int32, count=n, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype=np.int64, count=n, offset=HEADER_SIZE + n * 4)
    doc_idx = np.frombuffer(buf, dtype=np.int64, count=d, offset=HEADER_SIZE + n * 12)
    return np.dtype(DTYPE_CODES[code]), sizes, pointers, doc_idx, buf


class MMapIndexedDataset:
    """Read-only view of `{path_prefix}.bin/.idx`: `ds[i]` is sequence i as a numpy array.

    Slices return a list of arrays; `get(i, offset, length)` reads part of a sequence without
    touching the rest. Inconsistent or truncated files raise `DataError` naming the file.
    """

    def __init__(self, path_prefix: str | os.PathLike, skip_warmup: bool = True) -> None:
        self.path_prefix = os.fspath(path_prefix)
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        self.dtype, self.sizes, self.pointers, self.doc_idx, self._index_buf = _read_index(idx_path)
        self._validate_index(idx_path)
        if not os.path.isfile(bin_path):
            raise DataError(f"data file not found: '{bin_path}' (its index '{idx_path}' exists); regenerate both.")
        expected = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize if len(self.sizes) else 0
        actual = os.path.getsize(bin_path)
        if actual != expected:
            raise DataError(
                f"'{bin_path}' does not match its index '{idx_path}': {actual} bytes on disk, the index describes "
                f"{expected} ({'truncated' if actual < expected else 'extra bytes'}); regenerate the dataset."
            )
        self._bin_buf = np.memmap(bin_path, mode="r", order="C") if actual else np.zeros(0, np.uint8)
        if not skip_warmup:
            warmup_file(bin_path)

    def __getstate__(self) -> dict:
        """Pickle by path (e.g. for spawned DataLoader workers) instead of copying the mapped files."""
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])

    def _validate_index(self, idx_path: str) -> None:
        n = len(self.sizes)
        if n and (self.sizes < 0).any():
            raise DataError(f"'{idx_path}': negative sequence sizes; the index is corrupt, regenerate it.")
        starts = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(self.sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=starts[1:])
        if not np.array_equal(starts, self.pointers):
            raise DataError(f"'{idx_path}': pointers do not follow sizes; the index is corrupt, regenerate it.")
        d = self.doc_idx
        if len(d) == 0 or d[0] != 0 or d[-1] != n or (np.diff(d) < 0).any():
            raise DataError(
                f"'{idx_path}': doc_idx must start at 0, end at {n} and not decrease; the index is corrupt."
            )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            return [self[i] for i in range(start, stop, step)]
        i = int(idx)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sequence index {idx} out of range for {len(self)} sequences in {self.path_prefix}")
        return np.frombuffer(self._bin_buf, dtype=self.dtype, count=int(self.sizes[i]), offset=int(self.pointers[i]))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence `idx` (to its end when length is None)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"range [{offset}, {offset + length}) outside sequence {idx} of size {size}")
        ptr = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin_buf, dtype=self.dtype, count=length, offset=ptr)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences concatenated)."""
        a, b = int(self.doc_idx[doc]), int(self.doc_idx[doc + 1])
        if b - a == 1:
            return self[a]
        return np.concatenate([self[i] for i in range(a, b)]) if b > a else np.zeros(0, self.dtype)

    @property
    def supports_prefetch(self) -> bool:
        return False


def warmup_file(path: str, chunk: int = 1 << 24) -> None:
    """Read a file once so its pages are cached before training touches them (mmap_warmup)."""
    with open(path, "rb") as fh:
        while fh.read(chunk):
            pass


class MMapIndexedDatasetBuilder:
    """Append sequences and document boundaries, then `finalize()` writes the matching .idx.

    Usage: `b = MMapIndexedDatasetBuilder(prefix, np.uint16); b.add_item(ids); b.end_document(); b.finalize()`.
    Data goes to `.part` files that `finalize()` renames, so an interrupted run never leaves a
    .bin/.idx pair that looks complete; `discard()` removes them after a failure.
    """

    def __init__(self, path_prefix: str | os.PathLike, dtype: type | np.dtype = np.int32) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise DataError(
                f"dtype {self.dtype} has no code in the mmap index format; use one of {list(CODE_OF_DTYPE)}."
            )
        Path(self.path_prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_part = data_file_path(self.path_prefix) + ".part"
        self._bin: BinaryIO = open(self._bin_part, "wb")
        self._sizes = array("i")  # compact: one entry per sequence of a possibly huge corpus
        self._doc_idx = array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one sequence; ids that do not fit the dtype raise instead of wrapping around."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise DataError(f"add_item expects a 1-D sequence, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                lo, hi = int(arr.min()), int(arr.max())
                if lo < info.min or hi > info.max:
                    raise DataError(
                        f"{self.path_prefix}: token ids [{lo}, {hi}] do not fit {self.dtype}; use a wider dtype."
                    )
            arr = arr.astype(self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def add_document(self, sequences: Iterable[Sequence[int] | np.ndarray]) -> None:
        for seq in sequences:
            self.add_item(seq)
        self.end_document()

    def merge(self, other_prefix: str | os.PathLike) -> None:
        """Append every sequence and document of another dataset of the same dtype."""
        other = MMapIndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise DataError(f"cannot merge '{other_prefix}' ({other.dtype}) into a {self.dtype} dataset.")
        offset = len(self._sizes)
        self._sizes.frombytes(np.ascontiguousarray(other.sizes, dtype=np.int32).tobytes())
        self._doc_idx.frombytes((np.asarray(other.doc_idx[1:], dtype=np.int64) + offset).tobytes())
        with open(data_file_path(other_prefix), "rb") as fh:
            while chunk := fh.read(1 << 24):
                self._bin.write(chunk)

    def finalize(self) -> None:
        """Close the .bin and write the .idx; a trailing sequence without end_document ends a document."""
        self._bin.close()
        if self._doc_idx[-1] != len(self._sizes):
            self._doc_idx.append(len(self._sizes))
        idx_path = index_file_path(self.path_prefix)
        write_index(idx_path + ".part", self.dtype, np.frombuffer(self._sizes, np.int32), self._doc_idx)
        os.replace(self._bin_part, data_file_path(self.path_prefix))
        os.replace(idx_path + ".part", idx_path)

    def discard(self) -> None:
        """Close and delete the partial output (after an error)."""
        self._bin.close()
        for path in (self._bin_part, index_file_path(self.path_prefix) + ".part"):
            if os.path.exists(path):
                os.remove(path)


def write_index(idx_path: str, dtype: np.dtype, sizes: np.ndarray, doc_idx: Sequence[int] | array) -> None:
    """Write an .idx for sequences of `sizes` tokens laid out back to back in the .bin."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    doc = np.frombuffer(doc_idx, np.int64) if isinstance(doc_idx, array) else np.asarray(doc_idx, dtype=np.int64)
    with open(idx_path, "wb") as fh:
        fh.write(INDEX_MAGIC)
        fh.write(struct.pack("<Q", INDEX_VERSION))
        fh.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        fh.write(struct.pack("<Q", len(sizes)))
        fh.write(struct.pack("<Q", len(doc)))
        fh.write(sizes.tobytes(order="C"))
        fh.write(pointers.tobytes(order="C"))
        fh.write(doc.tobytes(order="C"))


def merge_indexed_datasets(prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike) -> None:
    """Concatenate several datasets (same dtype) into one, keeping document boundaries and order."""
    if not prefixes:
        raise DataError("merge_indexed_datasets needs at least one input prefix.")
    datasets = [MMapIndexedDataset(p) for p in prefixes]  # validate every input before writing anything
    dtypes = {str(d.dtype) for d in datasets}
    if len(dtypes) > 1:
        raise DataError(
            f"cannot merge datasets of different dtypes ({', '.join(sorted(dtypes))}): "
            + ", ".join(f"{p} ({d.dtype})" for p, d in zip(prefixes, datasets))
        )
    builder = MMapIndexedDatasetBuilder(output_prefix, datasets[0].dtype)
    try:
        for p in prefixes:
            builder.merge(p)
    except BaseException:
        builder.discard()
        raise
    builder.finalize()


DATA_IMPLS = ("infer", "mmap", "cached")


def make_dataset(
    path_prefix: str | os.PathLike, data_impl: str = "infer", skip_warmup: bool = True
) -> MMapIndexedDataset:
    """Open an indexed dataset by data_impl; 'cached' (the legacy format) is refused with a clear message."""
    if data_impl not in DATA_IMPLS:
        raise DataError(f"data_impl={data_impl!r} is not known; use one of {', '.join(DATA_IMPLS)}.")
    if data_impl == "cached":
        raise DataError(
            "data_impl='cached' (the legacy TNTIDX format) is not supported; use data_impl 'mmap' or 'infer' "
            "with datasets made by tools/datasets/preprocess_data.py."
        )
    return MMapIndexedDataset(path_prefix, skip_warmup=skip_warmup)
