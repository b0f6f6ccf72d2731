"""Blend several datasets so that every prefix of the blend follows the weights as closely as possible."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron.errors import DataError


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or not np.isfinite(w).all() or w.sum() <= 0:
        raise DataError(f"data weights must be non-negative numbers with a positive sum, got {list(weights)}.")
    return w / w.sum()


def weights_by_num_documents(num_documents: Sequence[int], alpha: float) -> np.ndarray:
    """p(L) ∝ |L| ** alpha (weight_by_num_documents with weighted_sampler_alpha)."""
    n = np.asarray(num_documents, dtype=np.float64)
    if (n <= 0).any():
        raise DataError(f"weight_by_num_documents needs every dataset to have documents, got {list(num_documents)}.")
    return normalize_weights(n**alpha)


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` samples.

    Dataset k's j-th sample is placed at "time" (j + 0.5) / w_k and all datasets are merged in time
    order, so after any n samples dataset k has been used round(n * w_k) times, give or take one.
    """
    w = normalize_weights(weights)
    ids, times, local = [], [], []
    for k, wk in enumerate(w):
        if wk == 0:
            continue
        count = int(np.ceil(size * wk)) + 1
        j = np.arange(count, dtype=np.int64)
        ids.append(np.full(count, k, dtype=np.int64))
        times.append((j + 0.5) / wk)
        local.append(j)
    all_ids, all_times, all_local = np.concatenate(ids), np.concatenate(times), np.concatenate(local)
    order = np.lexsort((all_ids, all_times))[:size]
    return all_ids[order], all_local[order]


class BlendableDataset(torch.utils.data.Dataset):
    """Sample i comes from datasets[dataset_index[i]] at dataset_sample_index[i]."""

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise DataError(f"{len(datasets)} datasets but {len(weights)} weights; give one weight per data path.")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = size
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        for k, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == k]
            if used.size and int(used.max()) >= len(ds):
                raise DataError(f"blended dataset {k} has {len(ds)} samples but the blend needs {int(used.max()) + 1}.")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size}")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
