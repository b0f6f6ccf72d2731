"""dataset_impl 'online': samples made of rollouts fetched from a rollout server (megatron.data.online_protocol) as
training asks for them, with the REINFORCE baseline subtracted from each reward (train_impl 'reinforce').

As GPT-NeoX's megatron/data/online_dataset.py: each sample is one completion of one prompt,

    text  = prompt + completion, padded with 0 to seq_length + 1 (cut to it when longer)
    label = -100 over the prompt and the padding, the completion's ids elsewhere
    reward = the reward minus the baseline; raw_reward = the reward as the server scored it

and the baseline is, with reinforce_leave_one_out, the mean reward of the prompt's other completions (RLOO,
arXiv 2402.14740), else the mean over the last 100 rollout groups (of this dataset) of each group's mean reward,
taken before the current group joins it (0 for the first group). The baseline's history is not checkpointed (as
in GPT-NeoX): a resumed run starts it afresh.

The index a DataLoader asks for is ignored: samples come in the order the server sent them. Read it with
num_workers 0 (megatron.data.data_utils.make_data_loader does), in the process that trains.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron.data.online_protocol import RolloutGroup, fetch_rollouts

BASELINE_GROUPS = 100
"""How many rollout groups the moving-average baseline remembers (GPT-NeoX's)."""


def leave_one_out_advantages(rewards: Sequence[float]) -> List[float]:
    """Each reward minus the mean of the others of its prompt (RLOO); a lone completion keeps its reward."""
    n = len(rewards)
    if n < 2:
        return [float(r) for r in rewards]
    total = float(sum(rewards))
    return [float(r) - (total - float(r)) / (n - 1) for r in rewards]


class MovingAverageBaseline:
    """The mean of the last ``size`` groups' mean rewards, 0 before the first (GPT-NeoX's baseline without RLOO)."""

    def __init__(self, size: int = BASELINE_GROUPS) -> None:
        self.means: Deque[float] = deque(maxlen=size)

    def advantages(self, rewards: Sequence[float]) -> List[float]:
        """``rewards`` minus the baseline as it stood before this group; then the group joins the history."""
        baseline = float(np.mean(self.means)) if self.means else 0.0
        self.means.append(float(np.mean(rewards)))
        return [float(r) - baseline for r in rewards]


def rollout_sample(prefix: Sequence[int], completion: Sequence[int], reward: float, raw_reward: float,
                   seq_length: int) -> Dict[str, np.ndarray]:
    """One completion as a training sample of seq_length + 1 tokens (see the module docstring)."""
    width = seq_length + 1
    text = (list(prefix) + list(completion))[:width]
    label = ([-100] * len(prefix) + list(completion))[:width]
    text += [0] * (width - len(text))
    label += [-100] * (width - len(label))
    return {"text": np.asarray(text, dtype=np.int64), "label": np.asarray(label, dtype=np.int64),
            "reward": np.asarray([reward], dtype=np.float32), "raw_reward": np.asarray([raw_reward], dtype=np.float32)}


class OnlineDataset(torch.utils.data.Dataset):
    """Rollouts of one split from the server at ``address`` ((ip, port)), one completion per sample."""

    def __init__(self, num_samples: int, seq_length: int, address: tuple, split: str = "train",
                 leave_one_out: bool = False, retry_seconds: float = 600.0,
                 fetch: Optional[Callable[[], List[RolloutGroup]]] = None) -> None:
        self.num_samples, self.seq_length, self.address, self.split = num_samples, seq_length, address, split
        self.leave_one_out, self.baseline = leave_one_out, MovingAverageBaseline()
        self.fetch = fetch or (lambda: fetch_rollouts(address, split, retry_seconds=retry_seconds))
        self.pending: Deque[Dict[str, np.ndarray]] = deque()

    def __len__(self) -> int:
        return self.num_samples  # how many the run asks for; the server decides what they are

    @property
    def source(self) -> str:
        return f"the {self.split} rollouts from the online data server {self.address[0]}:{self.address[1]}"

    def add(self, groups: Sequence[RolloutGroup]) -> None:
        """Queue the samples of ``groups`` with their advantages."""
        for group in groups:
            advantages = leave_one_out_advantages(group.rewards) if self.leave_one_out \
                else self.baseline.advantages(group.rewards)
            for completion, advantage, raw in zip(group.completions, advantages, group.rewards):
                self.pending.append(rollout_sample(group.prefix, completion, advantage, raw, self.seq_length))

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        while not self.pending:
            self.add(self.fetch())
        return self.pending.popleft()
