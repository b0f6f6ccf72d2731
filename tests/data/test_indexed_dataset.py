"""The .bin/.idx format: byte layout checked against an independent writer/reader, builder, merge, errors."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from megatron.errors import DataError
from megatron.data.indexed_dataset import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    make_dataset,
    merge_indexed_datasets,
)

DOCS = [[[1, 2, 3], [4]], [[5, 6, 7, 8, 9]], [[]], [[65000, 0, 12]]]  # documents of sequences


def independent_write(prefix: Path, docs: list[list[list[int]]], dtype: np.dtype, code: int) -> None:
    """A minimal writer straight from the documented layout (no code shared with the package)."""
    seqs = [s for d in docs for s in d]
    sizes = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in sizes:
        pointers.append(pos)
        pos += n * np.dtype(dtype).itemsize
    doc_idx, count = [0], 0
    for d in docs:
        count += len(d)
        doc_idx.append(count)
    with open(f"{prefix}.bin", "wb") as fh:
        for s in seqs:
            fh.write(np.array(s, dtype=dtype).tobytes())
    with open(f"{prefix}.idx", "wb") as fh:
        fh.write(b"MMIDIDX\x00\x00")
        fh.write(struct.pack("<Q", 1))
        fh.write(struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(sizes)))
        fh.write(struct.pack("<Q", len(doc_idx)))
        fh.write(struct.pack(f"<{len(sizes)}i", *sizes))
        fh.write(struct.pack(f"<{len(pointers)}q", *pointers))
        fh.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def independent_read(prefix: Path) -> tuple[int, list[list[int]], list[int]]:
    """A minimal reader from the documented layout: (dtype code, sequences, doc_idx)."""
    raw = Path(f"{prefix}.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    assert version == 1
    (code,) = struct.unpack_from("<B", raw, 17)
    n, d = struct.unpack_from("<QQ", raw, 18)
    off = 34
    sizes = struct.unpack_from(f"<{n}i", raw, off)
    pointers = struct.unpack_from(f"<{n}q", raw, off + 4 * n)
    doc_idx = struct.unpack_from(f"<{d}q", raw, off + 12 * n)
    assert len(raw) == off + 12 * n + 8 * d
    dtype = {4: "<i4", 8: "<u2"}[code]
    data = Path(f"{prefix}.bin").read_bytes()
    itemsize = np.dtype(dtype).itemsize
    seqs = [np.frombuffer(data[p : p + s * itemsize], dtype=dtype).tolist() for p, s in zip(pointers, sizes)]
    return code, seqs, list(doc_idx)


@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 8), (np.int32, 4)])
def test_reads_files_from_independent_writer(tmp_path: Path, dtype: np.dtype, code: int) -> None:
    independent_write(tmp_path / "x", DOCS, dtype, code)
    ds = MMapIndexedDataset(tmp_path / "x")
    seqs = [s for d in DOCS for s in d]
    assert len(ds) == len(seqs) and ds.dtype == np.dtype(dtype)
    for i, s in enumerate(seqs):
        assert isinstance(ds[i], np.ndarray) and ds[i].tolist() == s
    assert [a.tolist() for a in ds[1:4]] == seqs[1:4]
    assert ds.sizes.tolist() == [len(s) for s in seqs]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4, 5]
    assert ds.document(0).tolist() == [1, 2, 3, 4]
    assert ds.get(2, offset=1, length=3).tolist() == [6, 7, 8]
    assert ds[-1].tolist() == [65000, 0, 12]
    # a range past the sequence's end would read the next sequence's tokens (or past the file): refused
    size = int(ds.sizes[2])
    assert ds.get(2, offset=size - 1, length=1).size == 1
    for offset, length in ((size - 1, 2), (-1, 2), (0, size + 1), (1, -1)):
        with pytest.raises(IndexError, match=f"outside sequence 2 of size {size}"):
            ds.get(2, offset=offset, length=length)


@pytest.mark.parametrize(("dtype", "code"), [(np.uint16, 8), (np.int32, 4)])
def test_builder_output_matches_independent_reader(tmp_path: Path, dtype: np.dtype, code: int) -> None:
    b = MMapIndexedDatasetBuilder(tmp_path / "y", dtype)
    for doc in DOCS:
        b.add_document(doc)
    b.finalize()
    got_code, seqs, doc_idx = independent_read(tmp_path / "y")
    assert got_code == code
    assert seqs == [s for d in DOCS for s in d]
    assert doc_idx == [0, 2, 3, 4, 5]
    independent_write(tmp_path / "z", DOCS, dtype, code)
    for suffix in (".bin", ".idx"):
        assert Path(f"{tmp_path / 'y'}{suffix}").read_bytes() == Path(f"{tmp_path / 'z'}{suffix}").read_bytes()


def test_best_fitting_dtype() -> None:
    assert best_fitting_dtype(50304) is np.uint16
    assert best_fitting_dtype(65499) is np.uint16
    assert best_fitting_dtype(65500) is np.int32
    assert best_fitting_dtype(128256) is np.int32


def test_builder_refuses_ids_that_do_not_fit(tmp_path: Path) -> None:
    b = MMapIndexedDatasetBuilder(tmp_path / "w", np.uint16)
    with pytest.raises(DataError, match="do not fit uint16"):
        b.add_item([1, 70000])


def test_merge_keeps_order_and_documents(tmp_path: Path) -> None:
    parts = []
    for k in range(3):
        b = MMapIndexedDatasetBuilder(tmp_path / f"p{k}", np.uint16)
        for doc in DOCS[k:]:
            b.add_document(doc)
        b.finalize()
        parts.append(tmp_path / f"p{k}")
    merge_indexed_datasets(parts, tmp_path / "merged")
    merged = MMapIndexedDataset(tmp_path / "merged")
    expected = [s for k in range(3) for d in DOCS[k:] for s in d]
    assert [a.tolist() for a in merged[:]] == expected
    assert merged.num_documents == sum(len(DOCS[k:]) for k in range(3))
    assert [merged.document(i).tolist() for i in range(merged.num_documents)] == [
        sum(d, []) for k in range(3) for d in DOCS[k:]
    ]


def _write(tmp_path: Path) -> Path:
    independent_write(tmp_path / "c", DOCS, np.uint16, 8)
    return tmp_path / "c"


def test_missing_files_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"index file not found: '.*nothere\.idx'.*preprocess_data"):
        MMapIndexedDataset(tmp_path / "nothere")
    prefix = _write(tmp_path)
    Path(f"{prefix}.bin").unlink()
    with pytest.raises(DataError, match=r"data file not found: '.*c\.bin'"):
        MMapIndexedDataset(prefix)


@pytest.mark.fault
def test_truncated_bin_is_named(tmp_path: Path) -> None:
    prefix = _write(tmp_path)
    data = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(data[:-2])
    with pytest.raises(DataError, match=r"'.*c\.bin' does not match its index.*truncated"):
        MMapIndexedDataset(prefix)


@pytest.mark.fault
def test_truncated_idx_is_named(tmp_path: Path) -> None:
    prefix = _write(tmp_path)
    data = Path(f"{prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(data[:-8])
    with pytest.raises(DataError, match=r"'.*c\.idx' is truncated"):
        MMapIndexedDataset(prefix)
    Path(f"{prefix}.idx").write_bytes(data[:20])
    with pytest.raises(DataError, match=r"'.*c\.idx' is not a Megatron mmap index"):
        MMapIndexedDataset(prefix)


@pytest.mark.fault
def test_bad_magic_and_corrupt_pointers(tmp_path: Path) -> None:
    prefix = _write(tmp_path)
    data = bytearray(Path(f"{prefix}.idx").read_bytes())
    Path(f"{prefix}.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(data[8:]))
    with pytest.raises(DataError, match="legacy"):
        MMapIndexedDataset(prefix)
    n = 5
    struct.pack_into("<q", data, 34 + 4 * n + 8, 999)  # second pointer
    Path(f"{prefix}.idx").write_bytes(bytes(data))
    with pytest.raises(DataError, match="pointers do not follow sizes"):
        MMapIndexedDataset(prefix)


def test_make_dataset_data_impl(tmp_path: Path) -> None:
    prefix = _write(tmp_path)
    assert len(make_dataset(prefix, "mmap")) == 5
    assert len(make_dataset(prefix, "infer", skip_warmup=False)) == 5
    with pytest.raises(DataError, match="data_impl='cached'"):
        make_dataset(prefix, "cached")
    with pytest.raises(DataError, match="data_impl='lazy' is not known"):
        make_dataset(prefix, "lazy")
