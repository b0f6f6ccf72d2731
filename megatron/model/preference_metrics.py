"""Preference metrics kept by a loss function between log steps (the pipeline engine calls the loss itself, so
its metrics cannot be returned beside the loss)."""

from __future__ import annotations

from typing import Dict

import torch


def preference_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Mean chosen / rejected reward, the fraction of pairs whose chosen reward is higher, and the mean margin."""
    margin = (chosen - rejected).detach()
    return {"chosen_rewards": chosen.detach().mean(), "rejected_rewards": rejected.detach().mean(),
            "reward_accuracy": (margin > 0).float().mean(), "reward_margin": margin.mean()}


class MetricSums:
    """Sums of each metric over the micro-batches since ``take_metrics`` last ran."""

    def __init__(self) -> None:
        self._sums: Dict[str, float] = {}
        self._count = 0

    def add(self, metrics: Dict[str, torch.Tensor]) -> None:
        for name, value in metrics.items():
            self._sums[name] = self._sums.get(name, 0.0) + float(value)
        self._count += 1

    def take_metrics(self) -> Dict[str, float]:
        """Mean of each metric over the micro-batches since the last call (this rank's), and start again."""
        out = {name: total / self._count for name, total in self._sums.items()} if self._count else {}
        self._sums, self._count = {}, 0
        return out
