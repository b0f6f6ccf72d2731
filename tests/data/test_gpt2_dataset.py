"""GPT2Dataset: samples equal the shuffled token stream, maps are cached and reused, labels stay aligned."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from megatron.errors import DataError
from megatron.data.gpt2_dataset import PAD_TOKEN, GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.data.dataset_factory import make_docs, write_dataset
from tests.immutable_dirs import immutable  # noqa: F401 (a fixture)


def _dataset(tmp_path: Path, docs, **kw) -> GPT2Dataset:
    prefix = write_dataset(tmp_path / "d", docs) if not (tmp_path / "d.idx").exists() else str(tmp_path / "d")
    args = dict(
        name="train",
        data_prefix=prefix,
        documents=np.arange(len(docs)),
        indexed_dataset=MMapIndexedDataset(prefix),
        num_samples=50,
        seq_length=10,
        seed=7,
    )
    args.update(kw)
    return GPT2Dataset(**args)


def test_packed_samples_match_stream_and_cache_is_reused(tmp_path: Path) -> None:
    docs = make_docs(20)
    ds = _dataset(tmp_path, docs)
    assert ds.built_index_maps and len(ds) >= 50
    stream = np.concatenate([docs[d] for d in ds.maps.doc_idx])
    for idx in range(len(ds)):
        i = int(ds.maps.shuffle_idx[idx])
        sample = ds[idx]["text"]
        assert sample.dtype == np.int64 and sample.shape == (11,)
        assert np.array_equal(sample, stream[i * 10 : i * 10 + 11])
    files = sorted(ds.index_map_files.values())
    assert all(os.path.isfile(f) and f.startswith(str(tmp_path)) for f in files)
    mtimes = [os.stat(f).st_mtime_ns for f in files]
    again = _dataset(tmp_path, docs)
    assert not again.built_index_maps
    assert [os.stat(f).st_mtime_ns for f in files] == mtimes
    assert all(np.array_equal(ds[i]["text"], again[i]["text"]) for i in range(len(ds)))
    other_seed = _dataset(tmp_path, docs, seed=8)
    assert other_seed.built_index_maps
    assert not all(np.array_equal(ds[i]["text"], other_seed[i]["text"]) for i in range(10))


def test_regenerated_data_does_not_reuse_stale_maps(tmp_path: Path) -> None:
    first = _dataset(tmp_path, make_docs(20, seed=1))
    assert first.built_index_maps
    docs = make_docs(20, seed=2)
    write_dataset(tmp_path / "d", docs)
    second = _dataset(tmp_path, docs)
    assert second.built_index_maps and second.index_map_files != first.index_map_files
    stream = np.concatenate([docs[d] for d in second.maps.doc_idx])
    i = int(second.maps.shuffle_idx[0])
    assert np.array_equal(second[0]["text"], stream[i * 10 : i * 10 + 11])


def test_unpacked_pads_and_labels_align(tmp_path: Path) -> None:
    docs = make_docs(15, max_len=25)
    labels = [d + 100_000 for d in docs]
    label_prefix = write_dataset(tmp_path / "labels", labels)
    ds = _dataset(tmp_path, docs, pack_impl="unpacked", num_samples=30, label_dataset=MMapIndexedDataset(label_prefix))
    for idx in range(len(ds)):
        item = ds[idx]
        text, label = item["text"], item["label"]
        real = text != PAD_TOKEN
        assert real[0] and np.array_equal(label[real], text[real] + 100_000)
        assert (label[~real] == PAD_TOKEN).all()
        doc = int(ds.maps.doc_idx[ds.maps.sample_idx[ds.maps.shuffle_idx[idx], 0]])
        assert np.array_equal(text[real], docs[doc][:11])


def test_pack_until_overflow_keeps_documents_whole(tmp_path: Path) -> None:
    docs = make_docs(30, max_len=6)
    ds = _dataset(tmp_path, docs, pack_impl="pack_until_overflow", allow_chopped=False)
    for idx in range(len(ds)):
        text = ds[idx]["text"]
        real = text[text != PAD_TOKEN]
        starts = np.flatnonzero(real % 1000 == 0)
        assert starts.size and starts[0] == 0
        pieces = np.split(real, starts[1:])
        assert all(np.array_equal(p, p[0] + np.arange(len(p))) for p in pieces)
        assert (text[len(real) :] == PAD_TOKEN).all()


def test_misaligned_labels_are_refused(tmp_path: Path) -> None:
    docs = make_docs(5)
    label_prefix = write_dataset(tmp_path / "labels", make_docs(5, seed=9))
    with pytest.raises(DataError, match="not aligned"):
        _dataset(tmp_path, docs, label_dataset=MMapIndexedDataset(label_prefix))


def test_pickles_by_path_for_spawned_workers(tmp_path: Path) -> None:
    import pickle

    ds = _dataset(tmp_path, make_docs(20))
    blob = pickle.dumps(ds)
    assert len(blob) < 4000  # paths, not the mapped arrays
    again = pickle.loads(blob)
    assert all(np.array_equal(ds[i]["text"], again[i]["text"]) for i in range(len(ds)))


@pytest.mark.attack("training data in a read-only directory: the index maps cannot be cached beside it")
def test_a_read_only_data_directory_names_data_cache_path_which_then_works(tmp_path: Path, immutable) -> None:
    data = tmp_path / "data"
    data.mkdir()
    docs = make_docs(20)
    prefix = write_dataset(data / "d", docs)
    immutable(data)
    kw = dict(name="train", data_prefix=prefix, documents=np.arange(len(docs)),
              indexed_dataset=MMapIndexedDataset(prefix), num_samples=50, seq_length=10, seed=7)
    with pytest.raises(DataError) as caught:
        GPT2Dataset(**kw)
    assert str(caught.value) == (f"the index maps of '{prefix}' are cached beside the data, and '{data}' cannot be "
                                 f"written (Operation not permitted); set data_cache_path to a writable directory "
                                 f"to cache them there instead")
    cache = tmp_path / "cache" / "maps"
    ds = GPT2Dataset(**kw, cache_dir=str(cache))
    assert ds.built_index_maps and all(f.startswith(f"{cache}/d_") for f in ds.index_map_files.values())
    assert not GPT2Dataset(**kw, cache_dir=str(cache)).built_index_maps  # reused from the cache
    beside = _dataset(tmp_path, docs)  # the same data elsewhere, maps beside it: the same samples
    assert all(np.array_equal(ds[i]["text"], beside[i]["text"]) for i in range(len(ds)))
    with pytest.raises(DataError, match=f"data_cache_path='{data}': the index maps of '{prefix}' cannot be written "
                                        f"there \\(Operation not permitted\\)"):
        GPT2Dataset(**kw, cache_dir=str(data))
