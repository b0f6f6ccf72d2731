"""Index maps: packed samples are exact windows of the shuffled stream; epochs are permutations."""

from __future__ import annotations

import numpy as np
import pytest

from megatron.errors import DataError
from megatron.data.index_maps import build_index_maps
from tests.data.dataset_factory import make_docs


def _sizes(docs):
    return np.array([len(d) for d in docs], dtype=np.int32)


def test_packed_samples_are_windows_of_the_stream() -> None:
    docs = make_docs(30, min_len=0)
    documents = np.arange(5, 25)
    maps = build_index_maps(_sizes(docs), documents, num_samples=100, seq_length=16, seed=3)
    n_epochs = len(maps.doc_idx) // len(documents)
    assert len(maps.doc_idx) == n_epochs * len(documents) and n_epochs >= 2
    for e in range(n_epochs):
        assert sorted(maps.doc_idx[e * 20 : (e + 1) * 20].tolist()) == documents.tolist()
    stream = np.concatenate([docs[d] for d in maps.doc_idx])
    n = len(maps.sample_idx) - 1
    assert n >= 100 and n == (len(stream) - 1) // 16 and sorted(maps.shuffle_idx.tolist()) == list(range(n))
    for i in range(n):
        pos, off = maps.sample_idx[i]
        start = sum(len(docs[d]) for d in maps.doc_idx[:pos]) + off
        assert start == i * 16 and 0 <= off < max(len(docs[maps.doc_idx[pos]]), 1)


def test_the_last_partial_epoch_is_shuffled_apart_from_the_complete_ones() -> None:
    """GPT-NeoX's two-part shuffle: samples of the complete epochs are permuted among themselves and those of the
    last, partly used, epoch among themselves, so the first samples drawn never come from an epoch that training
    only reads in part (one permutation over all samples would mix them in)."""
    docs = make_docs(30, min_len=1)
    sizes = _sizes(docs)
    documents = np.arange(30)
    seq_length = 16
    tokens_per_epoch = int(sizes.sum())
    num_samples = (2 * tokens_per_epoch) // seq_length + 3  # just into a third epoch
    maps = build_index_maps(sizes, documents, num_samples=num_samples, seq_length=seq_length, seed=5)
    assert len(maps.doc_idx) == 3 * len(documents)
    complete = (2 * tokens_per_epoch - 1) // seq_length
    n = len(maps.shuffle_idx)
    assert 0 < complete < n
    assert sorted(maps.shuffle_idx[:complete].tolist()) == list(range(complete))
    assert sorted(maps.shuffle_idx[complete:].tolist()) == list(range(complete, n))
    assert maps.shuffle_idx[:complete].tolist() != list(range(complete))  # shuffled, not in order


def test_maps_are_deterministic_by_seed() -> None:
    sizes = _sizes(make_docs(50))
    a = build_index_maps(sizes, np.arange(50), 200, 8, seed=1)
    b = build_index_maps(sizes, np.arange(50), 200, 8, seed=1)
    c = build_index_maps(sizes, np.arange(50), 200, 8, seed=2)
    for m in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, m), getattr(b, m))
    assert not np.array_equal(a.doc_idx, c.doc_idx)


@pytest.mark.parametrize("pack_impl", ["unpacked", "pack_until_overflow"])
@pytest.mark.parametrize("allow_chopped", [True, False])
def test_document_aligned_maps(pack_impl: str, allow_chopped: bool) -> None:
    docs = make_docs(40, max_len=20, min_len=0)
    sizes = _sizes(docs)
    limit = 13
    maps = build_index_maps(
        sizes, np.arange(40), 60, limit - 1, seed=0, pack_impl=pack_impl, allow_chopped=allow_chopped
    )
    assert len(maps.sample_idx) >= 60
    used = []
    for start, stop in maps.sample_idx:
        members = [d for d in maps.doc_idx[start:stop] if sizes[d] > 0 and (allow_chopped or sizes[d] <= limit)]
        assert members
        assert sum(min(sizes[d], limit) for d in members) <= limit
        if pack_impl == "unpacked":
            assert stop - start == 1
        used += members
    assert all(sizes[d] > 0 for d in used)
    if not allow_chopped:
        assert all(sizes[d] <= limit for d in used)


def test_bad_inputs() -> None:
    with pytest.raises(DataError, match="pack_impl='zip'"):
        build_index_maps(np.array([3]), np.arange(1), 1, 2, 0, pack_impl="zip")
    with pytest.raises(DataError, match="no documents"):
        build_index_maps(np.array([3]), np.arange(0), 1, 2, 0)
    with pytest.raises(DataError, match="allow_chopped"):
        build_index_maps(np.array([30]), np.arange(1), 1, 2, 0, pack_impl="unpacked", allow_chopped=False)


@pytest.mark.parametrize(("num_samples", "seq_length"), [(1, 1), (7, 5), (100, 16), (333, 3)])
def test_packed_uses_the_fewest_epochs(num_samples: int, seq_length: int) -> None:
    sizes = np.array([5, 0, 9, 2], dtype=np.int32)
    maps = build_index_maps(sizes, np.arange(4), num_samples, seq_length, seed=0)
    epochs = len(maps.doc_idx) // 4
    tokens = int(sizes.sum())
    assert (epochs * tokens - 1) // seq_length >= num_samples
    assert epochs == 1 or ((epochs - 1) * tokens - 1) // seq_length < num_samples
    assert len(maps.shuffle_idx) == (epochs * tokens - 1) // seq_length
