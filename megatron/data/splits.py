"""How `split` ('969, 30, 1') divides a dataset's documents into train, valid and test — without torch, because the
config's checks and the training schedule (train_epochs) read it before any process starts."""
from __future__ import annotations

from collections.abc import Sequence

from megatron.errors import DataError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str | Sequence[float]) -> list[float]:
    """'969, 30, 1' -> normalised [train, valid, test] proportions (missing ones are 0)."""
    if isinstance(split, str):
        parts = [p.strip() for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            values = [float(p) for p in parts]
        except ValueError as exc:
            raise DataError(f"split={split!r} must be comma-separated numbers such as '969, 30, 1'.") from exc
    else:
        values = [float(v) for v in split]
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise DataError(f"split={split!r} needs 1 to 3 non-negative proportions with a positive sum.")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_document_ranges(num_documents: int, split: str | Sequence[float]) -> list[tuple[int, int]]:
    """[start, end) document ranges of train, valid and test for the split proportions."""
    fractions = parse_split(split)
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * num_documents)))
    shift = bounds[-1] - num_documents
    bounds = [b - shift if i > 0 else b for i, b in enumerate(bounds)]
    bounds = [min(max(b, 0), num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]
