"""Datasets from neox_args (split or path lists), blending proportions, per-rank loaders and resuming."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data.blendable_dataset import BlendableDataset, blending_indices, weights_by_num_documents
from megatron.data.data_utils import build_data_loader, build_train_valid_test_datasets, make_data_loader, repeating_iterator
from megatron.data.splits import split_document_ranges
from megatron.errors import ConfigError, DataError
from megatron.training_schedule import TrainingSchedule
from tests.data.dataset_factory import make_docs, write_dataset
from tests.neox_arguments.helpers import tiny


def datasets(**config):
    """The datasets of a (validated) config, sized by its training schedule."""
    args = tiny(**config)
    return build_train_valid_test_datasets(args, TrainingSchedule.from_neox_args(args).split_samples())


def test_split_ranges() -> None:
    assert split_document_ranges(1000, "969, 30, 1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_document_ranges(10, "8,1,1") == [(0, 8), (8, 9), (9, 10)]
    assert split_document_ranges(7, "100") == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(DataError, match="split='a,b'"):
        split_document_ranges(10, "a,b")


def test_datasets_from_data_path_and_split(tmp_path: Path) -> None:
    prefix = write_dataset(tmp_path / "corpus", make_docs(100))
    config = dict(data_path=prefix, split="80,10,10", seq_length=16, train_iters=10, train_batch_size=4, eval_iters=2,
                  eval_interval=5)
    train, valid, test = datasets(**config)
    assert len(train) >= 40 and len(valid) >= 24 and len(test) >= 8
    for ds, (lo, hi) in ((train, (0, 80)), (valid, (80, 90)), (test, (90, 100))):
        docs = set(np.asarray(ds.maps.doc_idx).tolist())
        assert docs == set(range(lo, hi))
        assert ds[0]["text"].shape == (17,)
    none_valid = datasets(**{**config, "split": "100,0,0"})
    assert none_valid[1] is None and none_valid[2] is None
    cached = datasets(**config, data_cache_path=str(tmp_path / "cache"))  # the index maps go there (issue 32)
    assert all(f.startswith(str(tmp_path / "cache" / "corpus_")) for ds in cached for f in ds.index_map_files.values())
    assert all(np.array_equal(a[0]["text"], b[0]["text"]) for a, b in zip(cached, (train, valid, test)))


def test_blending_prefixes_follow_weights() -> None:
    weights = [0.5, 0.3, 0.2]
    ids, local = blending_indices(weights, 10_000)
    for n in (100, 1000, 10_000):
        counts = np.bincount(ids[:n], minlength=3)
        assert np.abs(counts - np.array(weights) * n).max() <= 1.0
    for k in range(3):
        assert np.array_equal(local[ids == k], np.arange((ids == k).sum()))
    w = weights_by_num_documents([100, 400], alpha=0.5)
    assert np.allclose(w, [10 / 30, 20 / 30])
    assert np.allclose(weights_by_num_documents([100, 400], alpha=1.0), [0.2, 0.8])


@pytest.mark.parametrize("weights", [[2, 1, 1], [0.2, 0.1, 0.1]])
def test_blended_train_paths_realise_weights(tmp_path: Path, weights) -> None:
    """Weights summing above or below 1 are normalised before each dataset is sized for its share (raw weights
    summing to 0.4 sized every dataset at 40% of its share: issue 32's missed bug)."""
    paths = [write_dataset(tmp_path / f"p{k}", make_docs(30, seed=k, base=100_000 * k)) for k in range(3)]
    config = dict(train_data_paths=paths, train_data_weights=weights, valid_data_paths=paths[:1],
                  test_data_paths=paths[:1], seq_length=8, train_iters=10_000, train_batch_size=2,
                  train_micro_batch_size_per_gpu=2, eval_iters=0, eval_interval=10_000)
    train, valid, test = datasets(**config)
    assert isinstance(train, BlendableDataset) and len(train) == 20_000 and valid is None and test is None
    source = np.array([int(train[i]["text"][0]) // 100_000 for i in range(20_000)])
    fractions = np.bincount(source, minlength=3) / 20_000
    assert np.abs(fractions - [0.5, 0.25, 0.25]).max() < 0.01
    sized = [int(re.search(r"_(\d+)ns_", part.index_map_files["doc_idx"]).group(1)) for part in train.datasets]
    assert [s >= share * 20_000 for s, share in zip(sized, (0.5, 0.25, 0.25))] == [True] * 3, sized
    if weights[0] != 2:
        return
    by_docs = {**config, "weight_by_num_documents": True, "train_data_weights": None, "train_iters": 100}
    assert np.allclose(datasets(**by_docs)[0].weights, 1 / 3)
    with pytest.raises(ConfigError, match="train_data_weights has 2 entries but train_data_paths has 3"):
        datasets(**{**config, "train_data_weights": [1, 2]})


def test_label_paths_and_unsupported_options(tmp_path: Path) -> None:
    docs = make_docs(20)
    text = write_dataset(tmp_path / "t", docs)
    label = write_dataset(tmp_path / "l", [d + 7 for d in docs])
    config = dict(train_data_paths=[text], train_label_data_paths=[label], valid_data_paths=[text],
                  test_data_paths=[text], seq_length=8, train_iters=5, train_batch_size=2, eval_iters=0)
    train, valid, _ = datasets(**config)
    assert valid is None and np.array_equal(train[3]["label"], train[3]["text"] + 7)
    with pytest.raises(ConfigError, match="dataset_impl 'pairwise' is read by train_impl 'dpo' and 'rm' only"):
        datasets(**{**config, "dataset_impl": "pairwise"})
    with pytest.raises(DataError, match="no data"):
        datasets(seq_length=8, train_iters=5, train_batch_size=2)
    with pytest.raises(DataError, match="index file not found: '.*missing.idx'"):
        datasets(**{**config, "train_data_paths": [str(tmp_path / "missing")], "train_label_data_paths": None})


class _Range(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"text": np.array([i], dtype=np.int64)}


def _ids(loader) -> list[list[int]]:
    return [b["text"][:, 0].tolist() for b in loader]


def test_ranks_get_disjoint_slices_of_the_global_batch() -> None:
    ds, micro, dp = _Range(103), 3, 4
    per_rank = [_ids(build_data_loader(ds, micro, r, dp)) for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == 103 // 12
    for step in range(len(per_rank[0])):
        together = [i for r in range(dp) for i in per_rank[r][step]]
        assert together == list(range(step * 12, (step + 1) * 12))
    tail = [_ids(build_data_loader(ds, micro, r, dp, drop_last=False)) for r in range(dp)]
    assert sorted(i for p in tail for b in p for i in b) == list(range(103))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_at_iteration_k_matches_uninterrupted(tmp_path: Path, num_workers: int) -> None:
    prefix = write_dataset(tmp_path / "c", make_docs(50))
    config = dict(data_path=prefix, split="1", seq_length=8, train_iters=20, train_batch_size=8,
                  train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, eval_iters=0,
                  num_workers=num_workers, num_gpus=2)
    args = tiny(**config)
    train, _, _ = datasets(**config)
    dp, k = 2, 7
    for rank in range(dp):
        full = [b["text"] for b in make_data_loader(train, args, rank, dp)]
        resumed = [b["text"] for b in make_data_loader(train, args, rank, dp, consumed_samples=k * 8)]
        per_iter = 8 // (2 * dp)  # micro-batches per iteration on one rank
        assert len(resumed) == len(full) - k * per_iter
        assert all(torch.equal(a, b) for a, b in zip(full[k * per_iter :], resumed))


def test_repeating_iterator_restarts_without_caching() -> None:
    loader = build_data_loader(_Range(10), 2, 0, 1, consumed_samples=6)
    it = repeating_iterator(loader)
    got = [next(it)["text"][:, 0].tolist() for _ in range(5)]
    assert got == [[6, 7], [8, 9], [0, 1], [2, 3], [4, 5]]
