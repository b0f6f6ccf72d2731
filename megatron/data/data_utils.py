"""Build the train/valid/test datasets from neox_args and the per-rank DataLoaders the training loop uses.

Entry points:
    build_train_valid_test_datasets(neox_args, num_samples) -> (train, valid, test), None for unused splits
    build_data_loader(dataset, micro_batch_size, dp_rank, dp_size, consumed_samples, num_workers)
    make_data_loader(dataset, neox_args, dp_rank, dp_size, consumed_samples)
    build_online_datasets(neox_args, num_samples, dp_rank) -> dataset_impl 'online': rollouts from a server
    repeating_iterator(loader)                           -> endless batches without caching an epoch

Batches are {"text": LongTensor[micro_batch, seq_length + 1]} plus "label" (same shape) when label
datasets are given; -100 marks padding (unpacked / pack_until_overflow) and masked label positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset, normalize_weights, weights_by_num_documents
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset, make_dataset
from megatron.data.online_dataset import OnlineDataset
from megatron.data.online_protocol import server_address
from megatron.data.pairwise_dataset import PairwiseDataset
from megatron.data.samplers import DistributedBatchSampler
from megatron.data.splits import SPLIT_NAMES, split_document_ranges
from megatron.errors import DataError

BLEND_MARGIN = 1.005  # each blended dataset gets a little more than its share, as GPT-NeoX does


def _open(prefix: str, neox_args: Any):
    warm = bool(neox_args.mmap_warmup)
    return make_dataset(prefix, neox_args.data_impl, skip_warmup=not warm)


def _gpt2_dataset(
    name: str,
    prefix: str,
    documents: np.ndarray,
    num_samples: int,
    neox_args: Any,
    indexed: MMapIndexedDataset | None = None,
    label_prefix: str | None = None,
    group: Any = None,
    reward_prefix: str | None = None,
) -> GPT2Dataset:
    indexed = indexed if indexed is not None else _open(prefix, neox_args)
    labels = _open(label_prefix, neox_args) if label_prefix else None
    rewards = _open(reward_prefix, neox_args) if reward_prefix else None
    model_name = neox_args.precompute_model_name if neox_args.train_impl == "kto" else None
    reference = _open(f"{prefix}_{model_name}", neox_args) if model_name else None  # KTO's precomputed log-probs
    return GPT2Dataset(
        name,
        prefix,
        documents,
        indexed,
        num_samples,
        neox_args.seq_length,
        neox_args.seed,
        pack_impl=neox_args.pack_impl,
        allow_chopped=neox_args.allow_chopped,
        label_dataset=labels,
        use_shared_fs=neox_args.use_shared_fs,
        group=group,
        reward_dataset=rewards,
        reference_dataset=reference,
        cache_dir=neox_args.data_cache_path,
    )


def _split_blend(
    name: str,
    paths: Sequence[str],
    label_paths: Sequence[str] | None,
    weights: Sequence[float] | None,
    num_samples: int,
    neox_args: Any,
    group: Any = None,
    reward_paths: Sequence[str] | None = None,
) -> torch.utils.data.Dataset | None:
    """One split from its own list of data paths, blended by weight when there are several."""
    if not paths or num_samples <= 0:
        return None
    indexed = [_open(p, neox_args) for p in paths]
    if neox_args.weight_by_num_documents:
        w = weights_by_num_documents([len(d) for d in indexed], neox_args.weighted_sampler_alpha)
    elif weights:
        w = normalize_weights(weights)
    else:
        w = np.full(len(paths), 1.0 / len(paths))
    if len(paths) == 1:
        return _gpt2_dataset(
            name,
            paths[0],
            np.arange(len(indexed[0])),
            num_samples,
            neox_args,
            indexed[0],
            label_paths[0] if label_paths else None,
            group,
            reward_paths[0] if reward_paths else None,
        )
    parts = [
        _gpt2_dataset(
            name,
            p,
            np.arange(len(d)),
            max(1, int(math.ceil(num_samples * wk * BLEND_MARGIN)) + 1),
            neox_args,
            d,
            label_paths[k] if label_paths else None,
            group,
            reward_paths[k] if reward_paths else None,
        )
        for k, (p, d, wk) in enumerate(zip(paths, indexed, w))
    ]
    return BlendableDataset(parts, w, num_samples)


def _pairwise_split(name: str, num_samples: int, neox_args: Any) -> torch.utils.data.Dataset | None:
    """One split of dataset_impl 'pairwise' from pos_/neg_{split}_data_paths (+ label paths, + the precomputed
    reference log-probabilities `{path}_{precompute_model_name}` under DPO), blended by {split}_data_weights when
    there are several."""
    def paths(kind: str, label: str = "") -> list[str]:
        value = getattr(neox_args, f"{kind}_{name}_{label}data_paths") or []
        return [value] if isinstance(value, str) else list(value)

    pos, neg, pos_label, neg_label = paths("pos"), paths("neg"), paths("pos", "label_"), paths("neg", "label_")
    if not pos or num_samples <= 0:
        return None
    model_name = neox_args.precompute_model_name if neox_args.train_impl == "dpo" else None
    opened = [(_open(p, neox_args), _open(n, neox_args),
               _open(pos_label[k], neox_args) if pos_label else None,
               _open(neg_label[k], neox_args) if neg_label else None,
               _open(f"{p}_{model_name}", neox_args) if model_name else None,
               _open(f"{n}_{model_name}", neox_args) if model_name else None)
              for k, (p, n) in enumerate(zip(pos, neg))]
    weights = getattr(neox_args, f"{name}_data_weights")
    w = normalize_weights(weights) if weights else np.full(len(pos), 1.0 / len(pos))

    def one(parts, n: int) -> PairwiseDataset:
        p, q, pl, ql, pr, qr = parts
        return PairwiseDataset(name, np.arange(len(p)), p, q, n, neox_args.seq_length, neox_args.seed,
                               neox_args.allow_chopped, pl, ql, pos_ref=pr, neg_ref=qr)

    if len(opened) == 1:
        return one(opened[0], num_samples)
    return BlendableDataset([one(parts, max(1, int(math.ceil(num_samples * wk * BLEND_MARGIN)) + 1))
                             for parts, wk in zip(opened, w)], w, num_samples)


def build_train_valid_test_datasets(
    neox_args: Any, num_samples: tuple[int, int, int], group: Any = None
) -> tuple[torch.utils.data.Dataset | None, torch.utils.data.Dataset | None, torch.utils.data.Dataset | None]:
    """Datasets from `data_path` + `split`, or from train/valid/test_data_paths (+ weights, labels).

    `num_samples`: what each split must provide (TrainingSchedule.split_samples). Splits that are empty or
    need no samples are None. Every rank of `group` (a torch.distributed process group: the ranks that load
    data; default all ranks, or none needed without torch.distributed) calls this; its first rank builds
    the cached index maps while the others wait.
    """
    counts = num_samples
    data_path = neox_args.data_path
    if neox_args.dataset_impl == "pairwise":
        return tuple(_pairwise_split(name, n, neox_args) for name, n in zip(SPLIT_NAMES, counts))
    if neox_args.train_data_paths:
        out = []
        for name, n in zip(SPLIT_NAMES, counts):
            paths = getattr(neox_args, f"{name}_data_paths") or []
            paths = [paths] if isinstance(paths, str) else list(paths)
            out.append(
                _split_blend(
                    name,
                    paths,
                    getattr(neox_args, f"{name}_label_data_paths"),
                    getattr(neox_args, f"{name}_data_weights"),
                    n,
                    neox_args,
                    group,
                    getattr(neox_args, f"{name}_reward_data_paths"),
                )
            )
        return out[0], out[1], out[2]
    if not data_path:
        raise DataError("no data: set data_path (with split) or train_data_paths / valid_data_paths / test_data_paths.")
    indexed = _open(data_path, neox_args)
    ranges = split_document_ranges(len(indexed), neox_args.split)
    out = []
    for name, (start, end), n in zip(SPLIT_NAMES, ranges, counts):
        if end <= start or n <= 0:
            out.append(None)
            continue
        out.append(_gpt2_dataset(name, data_path, np.arange(start, end), n, neox_args, indexed, group=group))
    return out[0], out[1], out[2]


def build_online_datasets(
    neox_args: Any, num_samples: tuple[int, int, int], data_parallel_rank: int
) -> tuple[OnlineDataset | None, OnlineDataset | None, OnlineDataset | None]:
    """dataset_impl 'online': each split that needs samples reads them from the rollout server of this
    data-parallel rank (online_dataserver_ips / online_dataserver_ports), asking for the split by name."""
    address = server_address(neox_args.online_dataserver_ips, neox_args.online_dataserver_ports, data_parallel_rank)
    return tuple(
        OnlineDataset(n, neox_args.seq_length, address, name, neox_args.reinforce_leave_one_out) if n > 0 else None
        for name, n in zip(SPLIT_NAMES, num_samples)
    )


def build_data_loader(
    dataset: torch.utils.data.Dataset | None,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    consumed_samples: int = 0,
    num_workers: int = 0,
    drop_last: bool = True,
) -> torch.utils.data.DataLoader | None:
    """DataLoader for one data-parallel rank, resuming after `consumed_samples` (iteration * train_batch_size)."""
    if dataset is None:
        return None
    sampler = DistributedBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, drop_last)
    return loader_over(dataset, sampler, num_workers)


def loader_over(dataset: torch.utils.data.Dataset, batch_sampler: Any, num_workers: int = 0
                ) -> torch.utils.data.DataLoader:
    """The DataLoader of ``dataset`` in the index lists ``batch_sampler`` yields."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
        # its own generator: starting an iterator draws the workers' base seed from it, not from the global RNG
        # (which the model's dropout and MoE router jitter use, and which a checkpoint restores)
        generator=torch.Generator().manual_seed(0),
    )


def make_data_loader(
    dataset: torch.utils.data.Dataset | None, neox_args: Any, dp_rank: int, dp_size: int, consumed_samples: int = 0
) -> torch.utils.data.DataLoader | None:
    """build_data_loader with micro batch size and num_workers from neox_args."""
    micro = neox_args.train_micro_batch_size_per_gpu
    if micro is None:
        raise DataError("train_micro_batch_size_per_gpu must be set to build a data loader.")
    # rollouts are fetched, and their baseline kept, in the process that trains (megatron.data.online_dataset)
    workers = 0 if isinstance(dataset, OnlineDataset) else neox_args.num_workers
    return build_data_loader(dataset, micro, dp_rank, dp_size, consumed_samples, workers)


def repeating_iterator(loader: torch.utils.data.DataLoader) -> Iterator[Any]:
    """Endless batches: when the loader runs out, start again from the dataset's first sample.

    Unlike itertools.cycle it keeps no batches in memory.
    """
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise DataError("the data loader yields no batches (dataset smaller than one global batch?).")
        sampler = loader.batch_sampler
        if isinstance(sampler, DistributedBatchSampler):
            sampler.consumed_samples = 0
