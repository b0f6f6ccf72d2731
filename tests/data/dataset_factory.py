"""Write tiny indexed datasets whose tokens say where they come from, so samples can be checked exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def make_docs(num_docs: int, seed: int = 0, min_len: int = 1, max_len: int = 40, base: int = 0) -> list[np.ndarray]:
    """Document d holds ids base + 1000*(d % 60) + position, so every token identifies its document."""
    rng = np.random.RandomState(seed)
    return [
        (base + 1000 * (d % 60) + np.arange(rng.randint(min_len, max_len + 1))).astype(np.int64)
        for d in range(num_docs)
    ]


def write_dataset(prefix: Path | str, docs: list[np.ndarray], dtype=np.int32) -> str:
    b = MMapIndexedDatasetBuilder(prefix, dtype)
    for d in docs:
        b.add_item(d)
        b.end_document()
    b.finalize()
    return str(prefix)
