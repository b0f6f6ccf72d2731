"""When things happen in a training run, computed once: TrainingSchedule.

The validated NeoXArgs are never changed; everything about the run's length that is derived from them
(train_iters from train_epochs and the dataset, the learning-rate decay length, the warmup, the
iterations to save at, the samples each split needs) is computed here, once, by
``TrainingSchedule.from_neox_args``, and handed to the LR scheduler, the data pipeline, the loop and the
logger. Also here: the guard that stops fp16 runs stuck in loss-scale overflow.

Rules (as GPT-NeoX documents them):
* train_iters, or with train_samples: ceil(train_samples / train_batch_size), or with train_epochs:
  ceil(epochs x training samples / train_batch_size), where training samples = tokens of the training
  documents (the train part of `split`, or all of train_data_paths) // seq_length.
* decay iterations T = int(lr_decay_fraction x train_iters) if lr_decay_fraction is set (it "overrides
  lr_decay_iters"), else lr_decay_iters, else train_iters; at least 1. Warmup iterations W = lr_warmup_iters
  when set, else warmup x T. Megatron-LM's sample counts (with train_samples) give them as full batches:
  T = lr_decay_samples / train_batch_size, W = lr_warmup_samples / train_batch_size, and wsd's final decay
  D = lr_wsd_decay_samples / train_batch_size (else lr_wsd_decay_iters), possibly fractional; the schedule is
  then Megatron-LM's at every sample count (its formulas depend only on the ratios of these lengths).
* rampup_batch_size [start, increment, samples]: the global batch of each step from the samples consumed
  before it (BatchRampup); train_samples then counts the ramp's smaller steps.
* checkpoints at every checkpoint_factor iterations (checkpoint_scale linear) or at its powers (log),
  plus extra_save_iters.
* samples: train train_iters x B, valid (train_iters // eval_interval + 1) x eval_iters x B, test
  eval_iters x B (B = train_batch_size).

May import: megatron.errors, data."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Set, Tuple

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import TrainingDiverged
from megatron.data.splits import split_document_ranges

MAX_CONSECUTIVE_SKIPPED_STEPS = 50
"""fp16 steps skipped in a row (loss-scale overflow) after which training stops: dynamic loss scaling
recovers within a few steps when training is healthy; fifty in a row means the scale cannot shrink
far enough (min_loss_scale) or the loss is non-finite for another reason."""


def checkpoint_iterations(factor: Optional[int], scale: str, extra: Optional[Iterable[int]],
                          train_iters: int) -> Tuple[int, ...]:
    """Iterations at which a checkpoint is saved: every `factor` (linear) or at powers of `factor` (log),
    and the `extra` ones, up to train_iters."""
    iterations: Set[int] = set(int(i) for i in (extra or []) if 0 < int(i) <= train_iters)
    if factor:
        if scale == "linear":
            iterations.update(range(factor, train_iters + 1, factor))
        elif factor > 1:
            step = factor
            while step <= train_iters:
                iterations.add(step)
                step *= factor
    return tuple(sorted(iterations))


def epoch_tokens(prefixes: Sequence[str], split: Optional[str], use_split: bool) -> int:
    """Tokens in the training documents: the train part of `split` of one dataset, or whole datasets."""
    total = 0
    for prefix in prefixes:
        dataset = MMapIndexedDataset(prefix)
        doc_idx = dataset.doc_idx
        num_docs = len(doc_idx) - 1
        start, end = split_document_ranges(num_docs, split)[0] if use_split else (0, num_docs)
        total += int(dataset.sizes[doc_idx[start]:doc_idx[end]].sum())
    return total


def iterations_for_epochs(neox_args) -> int:
    """train_iters equivalent of train_epochs (rounded up, so the last partial batch is trained)."""
    if neox_args.train_data_paths:
        tokens = epoch_tokens(list(neox_args.train_data_paths), None, use_split=False)
    else:
        tokens = epoch_tokens([neox_args.data_path], neox_args.split, use_split=True)
    samples = tokens // neox_args.seq_length
    if samples == 0:
        raise ValueError(f"the training data holds {tokens} tokens, less than one sample of seq_length="
                         f"{neox_args.seq_length}")
    return math.ceil(neox_args.train_epochs * samples / neox_args.train_batch_size)


def decay_and_warmup_iters(neox_args, train_iters: int) -> Tuple[float, float]:
    """The learning-rate decay length T and warmup length W of a run of `train_iters` (module docstring);
    given in samples (lr_decay_samples, lr_warmup_samples) they are that many full batches, possibly fractional."""
    if neox_args.lr_decay_samples is not None:
        decay = neox_args.lr_decay_samples / neox_args.train_batch_size
    elif neox_args.lr_decay_fraction is not None:
        decay = max(1, int(neox_args.lr_decay_fraction * train_iters))
    elif neox_args.lr_decay_iters is not None:
        decay = max(1, int(neox_args.lr_decay_iters))
    else:
        decay = max(1, train_iters)
    if neox_args.lr_warmup_samples is not None:
        return decay, neox_args.lr_warmup_samples / neox_args.train_batch_size
    if neox_args.lr_warmup_iters is not None:
        return decay, float(neox_args.lr_warmup_iters)
    return decay, float(neox_args.warmup) * decay


def wsd_decay_iters(neox_args) -> Optional[float]:
    """The length D of lr_decay_style 'wsd''s final decay: lr_wsd_decay_iters, or lr_wsd_decay_samples full
    batches (possibly fractional); None when neither is set."""
    if neox_args.lr_wsd_decay_samples is not None:
        return neox_args.lr_wsd_decay_samples / neox_args.train_batch_size
    return None if neox_args.lr_wsd_decay_iters is None else int(neox_args.lr_wsd_decay_iters)


@dataclass(frozen=True)
class BatchRampup:
    """rampup_batch_size [start, increment, samples] toward the global batch (Megatron-LM's
    RampupBatchsizeNumMicroBatches): after c consumed samples the batch is
    min(start + increment x floor(c / (samples / n)), global) with n = (global - start) / increment."""

    start: int
    increment: int
    samples: int
    global_batch: int

    def batch_size(self, consumed_samples: int) -> int:
        increments = (self.global_batch - self.start) // self.increment
        if increments == 0:
            return self.global_batch
        steps = int(consumed_samples / (self.samples / increments)) if self.samples > 0 else increments
        return min(self.start + steps * self.increment, self.global_batch)

    def iterations_for(self, train_samples: int) -> int:
        """Steps until `train_samples` are consumed: the ramp step by step, then full batches."""
        consumed = iterations = 0
        while consumed < train_samples:
            batch = self.batch_size(consumed)
            if batch == self.global_batch:
                return iterations + math.ceil((train_samples - consumed) / batch)
            consumed += batch
            iterations += 1
        return iterations


def batch_rampup(neox_args) -> Optional[BatchRampup]:
    """The config's rampup_batch_size, None without one."""
    if neox_args.rampup_batch_size is None:
        return None
    start, increment, samples = (int(v) for v in neox_args.rampup_batch_size)
    return BatchRampup(start, increment, samples, int(neox_args.train_batch_size))


def training_iterations(neox_args, count_epochs: bool = True) -> Optional[int]:
    """The run's iterations: train_iters, or ceil(train_samples / train_batch_size) (with rampup_batch_size:
    the steps that consume train_samples), or those of train_epochs (counted over the training data's index;
    None when `count_epochs` is false)."""
    if neox_args.train_iters is not None:
        return int(neox_args.train_iters)
    if neox_args.train_samples is not None:
        rampup = batch_rampup(neox_args)
        if rampup is not None:
            return rampup.iterations_for(int(neox_args.train_samples))
        return math.ceil(neox_args.train_samples / neox_args.train_batch_size)
    if neox_args.train_epochs is None:
        raise ValueError("the training schedule needs train_iters, train_samples or train_epochs")
    return iterations_for_epochs(neox_args) if count_epochs else None


def schedule_length(neox_args, train_iters: int) -> int:
    """The full-batch iterations the learning-rate and weight-decay schedules span: train_iters, or with
    rampup_batch_size (progress counted in samples) ceil(train_samples / train_batch_size)."""
    if neox_args.rampup_batch_size is None or neox_args.train_samples is None:
        return train_iters
    return math.ceil(neox_args.train_samples / neox_args.train_batch_size)


@dataclass(frozen=True)
class TrainingSchedule:
    """The run's iteration counts and the steps at which things happen (see the module docstring)."""

    train_iters: int
    train_batch_size: int
    decay_iters: float
    warmup_iters: float
    save_iters: Tuple[int, ...] = ()
    eval_interval: int = 1000
    eval_iters: int = 100
    rampup: Optional[BatchRampup] = None
    length: Optional[int] = None
    """Full-batch iterations of the schedules (schedule_length); train_iters when None."""
    wsd_decay_iters: Optional[float] = None
    """Length of lr_decay_style 'wsd''s final decay in full-batch iterations (wsd_decay_iters)."""

    @classmethod
    def from_neox_args(cls, neox_args, train_iters: Optional[int] = None) -> "TrainingSchedule":
        """The schedule of a validated config; ``train_iters`` when already known, else the config's, else
        counted from train_epochs over the training data (reads the dataset's index)."""
        if train_iters is None:
            train_iters = training_iterations(neox_args)
        decay, warmup = decay_and_warmup_iters(neox_args, schedule_length(neox_args, int(train_iters)))
        return cls(train_iters=int(train_iters), train_batch_size=int(neox_args.train_batch_size),
                   decay_iters=decay, warmup_iters=warmup,
                   save_iters=checkpoint_iterations(neox_args.checkpoint_factor, neox_args.checkpoint_scale,
                                                    neox_args.extra_save_iters, int(train_iters)),
                   eval_interval=int(neox_args.eval_interval), eval_iters=int(neox_args.eval_iters),
                   rampup=batch_rampup(neox_args), length=schedule_length(neox_args, int(train_iters)),
                   wsd_decay_iters=wsd_decay_iters(neox_args))

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` (rampup_batch_size)."""
        return self.train_batch_size if self.rampup is None else self.rampup.batch_size(consumed_samples)

    def split_samples(self) -> Tuple[int, int, int]:
        """Samples the train, valid and test datasets must provide (GPT-NeoX's counts)."""
        batch = self.train_batch_size
        return (self.train_iters * batch, (self.train_iters // self.eval_interval + 1) * self.eval_iters * batch,
                self.eval_iters * batch)


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
            raise TrainingDiverged(
                f"iteration {iteration}: {self.in_a_row} optimizer steps in a row were skipped because the fp16 "
                f"loss scale overflowed; the run cannot make progress. Lower lr, raise min_loss_scale in the fp16 "
                f"dict, or train in bf16")

