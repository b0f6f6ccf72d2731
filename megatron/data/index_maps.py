"""Pure numpy construction of the GPT-2 dataset index maps (doc_idx, sample_idx, shuffle_idx).

doc_idx     document ids in the order they are read: one shuffled permutation of the split's documents
            per epoch, epochs back to back.
sample_idx  packed: row i = (position in doc_idx, token offset) where sample i starts; sample i is the
            seq_length + 1 tokens of the concatenated stream from there (consecutive samples share one
            token, so inputs and shifted labels both have seq_length tokens).
            pack_until_overflow / unpacked: row i = [first, last) positions in doc_idx of its documents.
shuffle_idx a permutation of the samples, so batches mix documents and epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron.errors import DataError

PACK_IMPLS = ("packed", "pack_until_overflow", "unpacked")


@dataclass
class IndexMaps:
    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray


def _epoch_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    out = np.empty(len(documents) * num_epochs, dtype=np.int64)
    for e in range(num_epochs):
        out[e * len(documents) : (e + 1) * len(documents)] = rng.permutation(documents)
    return out


def _two_part_shuffle(num_samples: int, first_part: int, rng: np.random.RandomState) -> np.ndarray:
    """Shuffle samples of the complete epochs apart from those of the last, partly used, epoch."""
    first_part = min(max(first_part, 0), num_samples)
    return np.concatenate([rng.permutation(first_part), first_part + rng.permutation(num_samples - first_part)]).astype(
        np.int64
    )


def build_packed(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int) -> IndexMaps:
    """Maps for pack_impl='packed': enough epochs that at least num_samples samples exist."""
    tokens_per_epoch = int(sizes[documents].astype(np.int64).sum())
    if tokens_per_epoch < 2:
        raise DataError("the dataset split has fewer than 2 tokens; it cannot yield any sample.")
    # smallest E with (E * tokens_per_epoch - 1) // seq_length >= num_samples
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    rng = np.random.RandomState(seed)
    doc_idx = _epoch_doc_idx(documents, num_epochs, rng)
    doc_starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx].astype(np.int64), out=doc_starts[1:])
    total = int(doc_starts[-1])
    n = (total - 1) // seq_length
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(doc_starts, starts, side="right") - 1
    sample_idx = np.stack([pos, starts - doc_starts[pos]], axis=1)
    complete = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if num_epochs > 1 else 0
    shuffle_idx = _two_part_shuffle(n, complete, rng)
    return IndexMaps(doc_idx, sample_idx, shuffle_idx)


def build_document_aligned(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    pack_impl: str,
    allow_chopped: bool,
) -> IndexMaps:
    """Maps for 'unpacked' (one document per sample) and 'pack_until_overflow' (whole documents per
    sample until the next would overflow). Documents longer than seq_length + 1 are cut when
    allow_chopped, else left out; empty documents are left out."""
    limit = seq_length + 1
    doc_sizes = sizes[documents].astype(np.int64)
    usable = (doc_sizes > 0) & ((doc_sizes <= limit) | allow_chopped)
    if not usable.any():
        raise DataError(
            f"no document of the split fits pack_impl={pack_impl!r} with seq_length={seq_length} "
            f"(allow_chopped={allow_chopped}); enable allow_chopped or use pack_impl='packed'."
        )
    rng = np.random.RandomState(seed)
    doc_idx_parts: list[np.ndarray] = []
    bounds: list[tuple[int, int]] = []
    size_of = dict(zip(documents.tolist(), np.minimum(doc_sizes, limit).tolist()))
    ok = dict(zip(documents.tolist(), usable.tolist()))
    offset, cur_start, cur_len, epochs = 0, None, 0, 0
    while len(bounds) < num_samples:
        epoch = rng.permutation(documents)
        epochs += 1
        for j, d in enumerate(epoch.tolist()):
            p = offset + j
            if not ok[d]:
                continue
            if pack_impl == "unpacked":
                bounds.append((p, p + 1))
                continue
            if cur_start is not None and cur_len + size_of[d] > limit:
                bounds.append((cur_start, p))
                cur_start, cur_len = None, 0
            if cur_start is None:
                cur_start = p
            cur_len += size_of[d]
        offset += len(epoch)
        doc_idx_parts.append(epoch)
    if cur_start is not None:
        bounds.append((cur_start, offset))
    doc_idx = np.concatenate(doc_idx_parts).astype(np.int64)
    sample_idx = np.asarray(bounds, dtype=np.int64)
    shuffle_idx = rng.permutation(len(sample_idx)).astype(np.int64)
    return IndexMaps(doc_idx, sample_idx, shuffle_idx)


def build_index_maps(
    sizes: np.ndarray,
    documents: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
    pack_impl: str = "packed",
    allow_chopped: bool = True,
) -> IndexMaps:
    """Index maps for `num_samples` samples of seq_length + 1 tokens over `documents` (sequence ids)."""
    if pack_impl not in PACK_IMPLS:
        raise DataError(f"pack_impl={pack_impl!r} is not known; use one of {', '.join(PACK_IMPLS)}.")
    if seq_length < 1 or num_samples < 1:
        raise DataError(f"seq_length and num_samples must be >= 1, got {seq_length} and {num_samples}.")
    documents = np.asarray(documents, dtype=np.int64)
    if len(documents) == 0:
        raise DataError("the dataset split has no documents; check `split` or the data paths.")
    if pack_impl == "packed":
        return build_packed(sizes, documents, num_samples, seq_length, seed)
    return build_document_aligned(sizes, documents, num_samples, seq_length, seed, pack_impl, allow_chopped)
