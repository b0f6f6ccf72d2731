"""How long training runs: train_iters, or the number of iterations that train_epochs passes over the
training documents, and the guard that stops fp16 runs stuck in loss-scale overflow.

Kept apart from the loop so that both are unit-tested without launching anything."""

import math
from typing import List, Optional

MAX_CONSECUTIVE_SKIPPED_STEPS = 50
"""fp16 steps skipped in a row (loss-scale overflow) after which training stops: dynamic loss scaling
recovers within a few steps when training is healthy; fifty in a row means the scale cannot shrink
far enough (min_loss_scale) or the loss is non-finite for another reason."""


def epoch_tokens(prefixes: List[str], split: Optional[str], use_split: bool) -> int:
    """Tokens in the training documents: the train part of `split` of one dataset, or whole datasets."""
    from megatron.data.data_utils import split_document_ranges
    from megatron.data.indexed_dataset import MMapIndexedDataset

    total = 0
    for prefix in prefixes:
        dataset = MMapIndexedDataset(prefix)
        doc_idx = dataset.doc_idx
        num_docs = len(doc_idx) - 1
        start, end = split_document_ranges(num_docs, split)[0] if use_split else (0, num_docs)
        total += int(dataset.sizes[doc_idx[start]:doc_idx[end]].sum())
    return total


def iterations_for_epochs(neox_args) -> int:
    """train_iters equivalent of train_epochs: epochs x (training tokens / seq_length) samples, in global
    batches (rounded up, so the last partial batch is trained)."""
    if neox_args.train_data_paths:
        tokens = epoch_tokens(list(neox_args.train_data_paths), None, use_split=False)
    else:
        tokens = epoch_tokens([neox_args.data_path], neox_args.split, use_split=True)
    samples = tokens // neox_args.seq_length
    if samples == 0:
        raise ValueError(f"the training data holds {tokens} tokens, less than one sample of seq_length="
                         f"{neox_args.seq_length}")
    return math.ceil(neox_args.train_epochs * samples / neox_args.train_batch_size)


def resolve_train_iters(neox_args) -> int:
    """Fix train_iters (and what derives from it) when the config gave train_epochs."""
    from megatron.neox_arguments.derivation import checkpoint_iterations

    if neox_args.train_iters is not None:
        return neox_args.train_iters
    neox_args.train_iters = iterations_for_epochs(neox_args)
    if neox_args.lr_decay_fraction is not None:
        neox_args.lr_decay_iters = int(neox_args.lr_decay_fraction * neox_args.train_iters)
    neox_args.save_iters = checkpoint_iterations(neox_args.checkpoint_factor, neox_args.checkpoint_scale,
                                                 neox_args.extra_save_iters, neox_args.train_iters)
    return neox_args.train_iters


class OverflowGuard:
    """Counts skipped (overflowed) optimizer steps and stops a run that only overflows."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_SKIPPED_STEPS) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.total = 0

    def record(self, skipped: bool, iteration: int) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"iteration {iteration}: {self.in_a_row} optimizer steps in a row were skipped because the fp16 "
                f"loss scale overflowed; the run cannot make progress. Lower lr, raise min_loss_scale in the fp16 "
                f"dict, or train in bf16")
