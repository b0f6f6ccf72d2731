"""PairwiseDataset (dataset_impl: pairwise): aligned chosen / rejected sequences for DPO and reward models.

`ds[i]` is {"pos": int64[seq_length + 1], "neg": ...} and, with label datasets, "pos_label" / "neg_label"
(with precomputed reference log-probabilities, float32 "pos_ref" / "neg_ref", megatron.post_training.precompute):
pair k of the chosen (pos_*) dataset goes with pair k of the rejected (neg_*) one, as
preprocess_data_with_chat_template.py writes them from one JSONL file. One pair per sample (never packed):
shorter sequences are padded with -100, which the batch masks out of every loss. A pair with a sequence
longer than seq_length + 1 is cut to fit with `allow_chopped`, else left out; how many were left out is
reported once. Epochs are seeded shuffles of the kept pairs, the same on every rank (no index files: a
permutation of the pairs is cheap).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset

PAD = -100


def check_aligned(pos: MMapIndexedDataset, neg: MMapIndexedDataset, pos_label: Optional[MMapIndexedDataset],
                  neg_label: Optional[MMapIndexedDataset], source: str) -> None:
    """One DataError naming the files when chosen / rejected (or their labels) do not pair up."""
    if len(pos) != len(neg):
        raise DataError(f"pairwise data {source}: the chosen (pos_*) dataset '{pos.path_prefix}' has {len(pos)} "
                        f"sequences but the rejected (neg_*) dataset '{neg.path_prefix}' has {len(neg)}; each "
                        f"chosen sequence needs its rejected one (make both from one JSONL file with "
                        f"preprocess_data_with_chat_template.py --jsonl-keys chosen rejected)")
    for data, label in ((pos, pos_label), (neg, neg_label)):
        if label is not None and not np.array_equal(data.sizes, label.sizes):
            raise DataError(f"label dataset '{label.path_prefix}' is not aligned with '{data.path_prefix}': their "
                            f"sequence sizes differ; make both with the same preprocessing run")


class PairwiseDataset(torch.utils.data.Dataset):
    """See the module docstring. `documents`: the pair ids this split uses."""

    def __init__(self, name: str, documents: np.ndarray, pos: MMapIndexedDataset, neg: MMapIndexedDataset,
                 num_samples: int, seq_length: int, seed: int, allow_chopped: bool = True,
                 pos_label: Optional[MMapIndexedDataset] = None, neg_label: Optional[MMapIndexedDataset] = None,
                 log: Callable[[str], None] = print, pos_ref: Optional[MMapIndexedDataset] = None,
                 neg_ref: Optional[MMapIndexedDataset] = None) -> None:
        if (pos_label is None) != (neg_label is None):
            raise DataError("pairwise data needs label datasets for both chosen and rejected sequences, or neither "
                            "(pos_*_label_data_paths and neg_*_label_data_paths)")
        check_aligned(pos, neg, pos_label, neg_label, f"'{pos.path_prefix}' / '{neg.path_prefix}'")
        self.name, self.seq_length = name, seq_length
        self.parts = {"pos": pos, "neg": neg, **({"pos_label": pos_label, "neg_label": neg_label}
                                                 if pos_label is not None else {}),
                      **({"pos_ref": pos_ref, "neg_ref": neg_ref} if pos_ref is not None else {})}
        for data, ref in ((pos, pos_ref), (neg, neg_ref)):
            if ref is not None and (len(ref) != len(data) or
                                    np.any(ref.sizes != np.minimum(data.sizes, seq_length + 1))):
                raise DataError(f"precomputed reference log-probabilities '{ref.path_prefix}' do not match "
                                f"'{data.path_prefix}' at seq_length {seq_length}; compute them again (generate.py "
                                f"with text_gen_type: precompute)")
        documents = np.asarray(documents, dtype=np.int64)
        limit = seq_length + 1
        too_long = (pos.sizes[documents] > limit) | (neg.sizes[documents] > limit)
        self.dropped = 0 if allow_chopped else int(too_long.sum())
        kept = documents if allow_chopped else documents[~too_long]
        if self.dropped:
            log(f"{name} pairwise data: left out {self.dropped} of {len(documents)} pairs longer than seq_length + 1 "
                f"= {limit} tokens (allow_chopped: false; set it true to cut them instead)")
        if num_samples > 0 and len(kept) == 0:
            raise DataError(f"{name} pairwise data '{pos.path_prefix}': no pair fits in seq_length + 1 = {limit} "
                            f"tokens; raise seq_length or set allow_chopped: true")
        rng = np.random.RandomState(seed)
        epochs = max(1, -(-num_samples // max(len(kept), 1)))
        self.order = np.concatenate([rng.permutation(kept) for _ in range(epochs)]) if len(kept) else kept

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples ({self.name})")
        pair = int(self.order[idx])
        out = {}
        for key, ds in self.parts.items():
            seq = ds.get(pair, 0, min(int(ds.sizes[pair]), self.seq_length + 1))
            sample = np.zeros(self.seq_length + 1, dtype=np.float32) if key.endswith("_ref") else \
                np.full(self.seq_length + 1, PAD, dtype=np.int64)
            sample[: len(seq)] = seq
            out[key] = sample
        return out


def as_text_and_labels(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of pairs as one batch of sequences: the chosen ones, then the rejected ones (rows b..2b-1 are
    the rejected answers of rows 0..b-1); labels are the label datasets' or, without them, the tokens."""
    text = torch.cat([data["pos"], data["neg"]])
    label = torch.cat([data["pos_label"], data["neg_label"]]) if "pos_label" in data else text
    out = {"text": text, "label": label}
    if "pos_ref" in data:
        out["ref"] = torch.cat([data["pos_ref"], data["neg_ref"]])
    return out
