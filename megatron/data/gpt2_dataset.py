"""GPT2Dataset: samples of seq_length + 1 tokens over document-shuffled epochs of an indexed dataset.

The index maps are built once per (data prefix, split name, document range, num_samples, seq_length,
seed, pack_impl, allow_chopped) and cached as .npy files beside the data, or in data_cache_path when it is set
(a read-only data directory: the error says to set it); rank 0 builds them and the other ranks wait, then every
rank memory-maps them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch

from megatron.errors import DataError
from megatron.data.index_maps import IndexMaps, build_index_maps
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.rank_sync import build_once

PAD_TOKEN = -100  # fills unpacked / pack_until_overflow samples; training masks negative ids out of the loss
MAP_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def index_map_paths(
    data_prefix: str,
    name: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    pack_impl: str,
    allow_chopped: bool,
    cache_dir: str | None = None,
) -> dict[str, str]:
    """Cache file per map; every input that changes the maps is in the name, including a digest of the
    split's document sizes so that regenerated data never reuses stale maps. Beside the data, or in
    ``cache_dir`` under the data's file name and a digest of its full path (two data sets with one name in
    different directories do not share maps)."""
    first, last = (int(documents[0]), int(documents[-1])) if len(documents) else (0, -1)
    digest = hashlib.sha1(np.ascontiguousarray(sizes[documents], dtype=np.int32).tobytes()).hexdigest()[:10]
    chopped = "_ac" if allow_chopped and pack_impl != "packed" else ""
    base = data_prefix
    if cache_dir:
        where = hashlib.sha1(os.path.abspath(data_prefix).encode("utf-8")).hexdigest()[:8]
        base = os.path.join(cache_dir, f"{os.path.basename(data_prefix)}_{where}")
    stem = (
        f"{base}_{name}_indexmap_{first}-{last}d_{digest}_{num_samples}ns_{seq_length}sl_"
        f"{seed}s_{pack_impl}pi{chopped}"
    )
    return {m: f"{stem}_{m}.npy" for m in MAP_NAMES}


def _save_atomically(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def _save_maps(maps: IndexMaps, paths: dict[str, str], data_prefix: str, cache_dir: str | None) -> None:
    """Write the maps; a directory that cannot be written is a DataError naming data_cache_path, the way out."""
    folder = os.path.dirname(paths["doc_idx"]) or "."
    try:
        if cache_dir:
            os.makedirs(folder, exist_ok=True)
        for m in MAP_NAMES:
            _save_atomically(paths[m], getattr(maps, m))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if cache_dir:
            raise DataError(f"data_cache_path='{cache_dir}': the index maps of '{data_prefix}' cannot be written "
                            f"there ({reason}); set data_cache_path to a directory this user can write") from None
        raise DataError(f"the index maps of '{data_prefix}' are cached beside the data, and '{folder}' cannot be "
                        f"written ({reason}); set data_cache_path to a writable directory to cache them there "
                        f"instead") from None


def _load_maps(paths: dict[str, str]) -> IndexMaps:
    return IndexMaps(*(np.load(paths[m], mmap_mode="r", allow_pickle=False) for m in MAP_NAMES))


class GPT2Dataset(torch.utils.data.Dataset):
    """`ds[i]` is {"text": int64[seq_length + 1]} (and "label" when a label dataset is given; with a reward
    dataset, "reward": int64[1], the sign of its document's reward, for KTO; with a reference dataset, "ref":
    float32[seq_length + 1], the precomputed reference log-probabilities of the text's tokens, 0 on padding,
    megatron.post_training.precompute).

    Shorter unpacked / pack_until_overflow samples are padded with PAD_TOKEN (-100) in both.
    len(ds) is every sample the built epochs hold, at least `num_samples`.
    """

    def __init__(
        self,
        name: str,
        data_prefix: str,
        documents: np.ndarray,
        indexed_dataset: MMapIndexedDataset,
        num_samples: int,
        seq_length: int,
        seed: int,
        pack_impl: str = "packed",
        allow_chopped: bool = True,
        build_index_mappings: bool = True,
        label_dataset: MMapIndexedDataset | None = None,
        use_shared_fs: bool = True,
        group: Any = None,
        reward_dataset: MMapIndexedDataset | None = None,
        reference_dataset: MMapIndexedDataset | None = None,
        cache_dir: str | None = None,
    ) -> None:
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.label_dataset = label_dataset
        self.reward_dataset = reward_dataset
        self.reference_dataset = reference_dataset
        if reference_dataset is not None and (pack_impl != "unpacked" or len(reference_dataset) != len(
                indexed_dataset) or np.any(reference_dataset.sizes != np.minimum(indexed_dataset.sizes,
                                                                                  seq_length + 1))):
            raise DataError(f"precomputed reference log-probabilities '{reference_dataset.path_prefix}' do not match "
                            f"'{data_prefix}' at seq_length {seq_length} (pack_impl 'unpacked'); compute them again "
                            f"(generate.py with text_gen_type: precompute)")
        if reward_dataset is not None:
            if pack_impl != "unpacked":
                raise DataError(f"reward data ('{reward_dataset.path_prefix}') needs pack_impl 'unpacked' (one "
                                f"document, hence one reward, per sample)")
            if len(reward_dataset) != len(indexed_dataset) or np.any(reward_dataset.sizes < 1):
                raise DataError(f"reward dataset '{reward_dataset.path_prefix}' needs one reward per sequence of "
                                f"'{data_prefix}' ({len(indexed_dataset)}); it has {len(reward_dataset)}")
        self.seq_length = seq_length
        self.pack_impl = pack_impl
        self.allow_chopped = allow_chopped
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) and (documents.min() < 0 or documents.max() >= len(indexed_dataset)):
            raise DataError(f"{data_prefix}: document ids outside [0, {len(indexed_dataset)}).")
        if label_dataset is not None and not np.array_equal(label_dataset.sizes, indexed_dataset.sizes):
            raise DataError(
                f"label dataset '{label_dataset.path_prefix}' is not aligned with '{data_prefix}': their sequence "
                f"sizes differ; make both with the same preprocess_data_with_mask.py run."
            )
        paths = index_map_paths(
            data_prefix,
            name,
            documents,
            indexed_dataset.sizes,
            num_samples,
            seq_length,
            seed,
            pack_impl,
            allow_chopped,
            cache_dir,
        )
        self.index_map_files = paths

        def build() -> None:
            maps = build_index_maps(
                indexed_dataset.sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped
            )
            _save_maps(maps, paths, data_prefix, cache_dir)

        def exists() -> bool:
            return all(os.path.isfile(p) for p in paths.values())

        if build_index_mappings:
            self.built_index_maps = build_once(build, exists, use_shared_fs, group)
        elif not exists():
            raise DataError(f"index maps missing: {paths['doc_idx']} (build them with build_index_mappings=True).")
        else:
            self.built_index_maps = False
        self.maps = _load_maps(paths)
        if len(self.maps.shuffle_idx) < num_samples:
            raise DataError(
                f"cached index map {paths['shuffle_idx']} holds {len(self.maps.shuffle_idx)} samples, "
                f"fewer than the {num_samples} needed; delete it to rebuild."
            )

    def __getstate__(self) -> dict:
        """Pickle the cached maps by path, not by value (spawned DataLoader workers re-map them)."""
        state = dict(self.__dict__)
        del state["maps"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.maps = _load_maps(self.index_map_files)

    def __len__(self) -> int:
        return len(self.maps.shuffle_idx)

    def _packed(self, ds: MMapIndexedDataset, i: int) -> np.ndarray:
        doc_idx, sample_idx = self.maps.doc_idx, self.maps.sample_idx
        pos, offset = int(sample_idx[i, 0]), int(sample_idx[i, 1])
        need = self.seq_length + 1
        parts: list[np.ndarray] = []
        while need > 0:
            doc = int(doc_idx[pos])
            take = min(int(ds.sizes[doc]) - offset, need)
            if take > 0:
                parts.append(ds.get(doc, offset, take))
                need -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)

    def _document_aligned(self, ds: MMapIndexedDataset, i: int, pad: Any = PAD_TOKEN,
                          dtype: Any = np.int64) -> np.ndarray:
        """Sample `i`'s documents from `ds` (the text, or a dataset aligned with it), padded with `pad`; which
        documents were left out is decided by the text's sizes."""
        start, stop = int(self.maps.sample_idx[i, 0]), int(self.maps.sample_idx[i, 1])
        limit = self.seq_length + 1
        out = np.full(limit, pad, dtype=dtype)
        filled = 0
        for pos in range(start, stop):
            doc = int(self.maps.doc_idx[pos])
            size = int(self.indexed_dataset.sizes[doc])
            if size == 0 or (size > limit and not self.allow_chopped):
                continue  # left out when the maps were built
            take = min(size, limit - filled)
            out[filled : filled + take] = ds.get(doc, 0, take)
            filled += take
        return out

    def _sample(self, ds: MMapIndexedDataset, i: int) -> np.ndarray:
        return self._packed(ds, i) if self.pack_impl == "packed" else self._document_aligned(ds, i)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples ({self.name})")
        i = int(self.maps.shuffle_idx[idx])
        out = {"text": self._sample(self.indexed_dataset, i)}
        if self.label_dataset is not None:
            out["label"] = self._sample(self.label_dataset, i)
        if self.reward_dataset is not None:
            out["reward"] = np.asarray([np.sign(float(self.reward_dataset.get(self._document_of(i))[0]))],
                                       dtype=np.int64)
        if self.reference_dataset is not None:
            out["ref"] = self._document_aligned(self.reference_dataset, i, pad=0.0, dtype=np.float32)
        return out

    def _document_of(self, i: int) -> int:
        """The document of unpacked sample `i` (the first of its range that was not left out)."""
        limit = self.seq_length + 1
        for pos in range(int(self.maps.sample_idx[i, 0]), int(self.maps.sample_idx[i, 1])):
            doc = int(self.maps.doc_idx[pos])
            size = int(self.indexed_dataset.sizes[doc])
            if size and (size <= limit or self.allow_chopped):
                return doc
        raise DataError(f"sample {i} of {self.name} holds no document")
