"""Batch sampling for data parallelism: each rank reads its own slice of every global micro-batch,
starting after the samples already consumed, so a resumed run sees exactly the batches it would have."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megatron.errors import DataError


class DistributedBatchSampler(torch.utils.data.Sampler):
    """Yields index lists of `micro_batch_size` for rank `dp_rank` of `dp_size`.

    Global micro-batch g covers samples [consumed + g*M*D, consumed + (g+1)*M*D); rank r takes the
    r-th block of M. With drop_last=False the final partial global batch is divided the same way
    and ranks whose block is empty get no batch.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ) -> None:
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(
                f"bad sampler setup: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if total_samples < 1:
            raise DataError("the dataset is empty: no samples to load.")
        if consumed_samples < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        remaining = max(self.total_samples - self.consumed_samples, 0)
        full, rest = divmod(remaining, self.global_micro_batch)
        if self.drop_last or rest <= self.dp_rank * self.micro_batch_size:
            return full
        return full + 1

    def __iter__(self) -> Iterator[list[int]]:
        g = self.global_micro_batch
        lo = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples, g):
            if start + g > self.total_samples and self.drop_last:
                return
            idx = list(range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples)))
            if idx:
                yield idx
