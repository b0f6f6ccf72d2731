"""Curriculum sampling by offline-analysed difficulty (DeepSpeed's data_efficiency.data_sampling): the analysis,
with DeepSpeed's DataAnalyzer over the training split a config builds, and the sampler, DeepSpeed's
DeepSpeedDataSampler with a resumable state.

The analysis (tools/datasets/analyze_difficulty.py) writes, for each metric of megatron.data.data_efficiency.METRICS,
DeepSpeed's files under <save_path>/<metric>/: <metric>_sample_to_metric (the metric of every training sample),
<metric>_index_to_metric (the distinct values, ascending), <metric>_index_to_sample (the samples of each value) and
<metric>_index_to_sample_percentile_merged (the same, merged into about 100 groups for difficulty_type
percentile). Sample i is sample i of the training dataset the same config builds (GPT2Dataset's shuffled samples of
seq_length + 1 tokens), so a config whose data, split, seq_length, seed or training length changes needs a new
analysis.

During training DeepSpeed's sampler draws each global batch from the clusters of samples whose difficulty is within
the step's scheduled bound (DeepSpeed's CurriculumScheduler per metric; with several metrics, samples within every
bound), writing the clusters to data_cluster_path from global rank 0 and broadcasting each batch over the
data-parallel group.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from deepspeed.runtime.data_pipeline.constants import CURRICULUM_LEARNING_NP_RNG_STATE
from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

from megatron.data.data_efficiency import METRICS
from megatron.errors import DataError

STATE_KEY = "difficulty_sampler"
"""Where the sampler's state lives in a checkpoint's client state (DeepSpeed's engine keeps `data_sampler` for its
own dataloader's and takes it out of the client state it returns)."""
RARITY_SCALE = 1000
"""vocab_rarity is in thousandths of a nat (DeepSpeed stores integer metrics)."""


def _quiet():
    """DeepSpeed's MMapIndexedDataset prints each step of opening a file ("    reading sizes..."): not in the
    run's output."""
    return contextlib.redirect_stdout(io.StringIO())


def _tokens(samples: Sequence[Dict[str, Any]]) -> torch.Tensor:
    """DataAnalyzer's batches: the samples' tokens [batch, seq_length + 1] (a tensor, whose len is the batch: the
    analyzer counts the samples of a batch with len)."""
    return torch.stack([torch.as_tensor(np.asarray(sample["text"]), dtype=torch.long) for sample in samples])


def seqlen(tokens: torch.Tensor) -> np.ndarray:
    """Tokens of each sample before padding (-100, megatron.data.gpt2_dataset)."""
    return (tokens >= 0).sum(dim=1).numpy().astype(np.int64)


def vocab_frequencies(vocab_size: int) -> Callable[[torch.Tensor], np.ndarray]:
    def count(tokens: torch.Tensor) -> np.ndarray:
        kept = tokens[tokens >= 0]
        return torch.bincount(kept, minlength=vocab_size)[:vocab_size].numpy().astype(np.int64)
    return count


def vocab_rarity(frequencies: np.ndarray) -> Callable[[torch.Tensor], np.ndarray]:
    """Mean -log p(token) of each sample's tokens, p from ``frequencies``, in RARITY_SCALE units (an integer)."""
    total = max(int(frequencies.sum()), 1)
    surprise = torch.from_numpy(-np.log(np.maximum(frequencies, 1) / total))

    def rarity(tokens: torch.Tensor) -> np.ndarray:
        valid = tokens >= 0
        values = surprise[tokens.clamp(min=0)] * valid
        mean = values.sum(dim=1) / valid.sum(dim=1).clamp(min=1)
        return torch.round(mean * RARITY_SCALE).numpy().astype(np.int64)
    return rarity


def _analyzer(dataset, save_path: str, names: List[str], functions: List[Callable], kinds: List[str],
              batch_size: int) -> DataAnalyzer:
    return DataAnalyzer(dataset, num_workers=1, worker_id=0, num_threads=1, num_threads_reduce=1,
                        batch_size=batch_size, metric_names=names, metric_functions=functions, metric_types=kinds,
                        metric_dtypes=[np.int64] * len(names), save_path=save_path, collate_fn=_tokens)


def analyze(dataset, metrics: Sequence[str], save_path: str, vocab_size: int, batch_size: int = 64) -> \
        Dict[str, Dict[str, str]]:
    """Run DeepSpeed's DataAnalyzer (map, then reduce) for ``metrics`` over ``dataset`` (the training split);
    returns {metric: {index_to_sample_path, index_to_metric_path, percentile_index_to_sample_path}}, the paths
    to put in the config (the last one is index_to_sample_path with difficulty_type percentile)."""
    unknown = [name for name in metrics if name not in METRICS]
    if unknown:
        raise DataError(f"unknown metric(s) {unknown}; the metrics are {', '.join(METRICS)}")
    if dataset is None or len(dataset) == 0:
        raise DataError("the config builds no training samples to analyse (train_iters and the split's share)")
    os.makedirs(save_path, exist_ok=True)
    with _quiet():
        return _analyze(dataset, metrics, save_path, vocab_size, batch_size)


def _analyze(dataset, metrics: Sequence[str], save_path: str, vocab_size: int, batch_size: int) -> \
        Dict[str, Dict[str, str]]:
    functions: Dict[str, Callable] = {"seqlen": seqlen}
    if "vocab_rarity" in metrics:  # a first pass counts the tokens
        counting = _analyzer(dataset, save_path, ["vocab_frequency"], [vocab_frequencies(vocab_size)],
                             ["accumulate_value_over_samples"], batch_size)
        counting.run_map()
        counting.run_reduce()
        counts = MMapIndexedDataset(os.path.join(save_path, "vocab_frequency", "vocab_frequency_metric_value"),
                                    skip_warmup=True)
        # a copy: counts is a memory map
        functions["vocab_rarity"] = vocab_rarity(np.array(counts[0], dtype=np.int64))
    names = list(metrics)
    analyzer = _analyzer(dataset, save_path, names, [functions[name] for name in names],
                         ["single_value_per_sample"] * len(names), batch_size)
    analyzer.run_map()
    analyzer.run_reduce()
    return {name: {"index_to_sample_path": os.path.join(save_path, name, f"{name}_index_to_sample"),
                   "index_to_metric_path": os.path.join(save_path, name, f"{name}_index_to_metric"),
                   "percentile_index_to_sample_path":
                       os.path.join(save_path, name, f"{name}_index_to_sample_percentile_merged")}
            for name in names}


def sample_metric(index_to_sample_path: str) -> np.ndarray:
    """The metric of every analysed sample, from the <metric>_sample_to_metric file beside ``index_to_sample_path``."""
    directory, name = os.path.split(index_to_sample_path)
    metric = name.split("_index_to_sample")[0]
    with _quiet():
        values = MMapIndexedDataset(os.path.join(directory, f"{metric}_sample_to_metric"), skip_warmup=True)
    return np.concatenate([np.asarray(values[i]) for i in range(len(values))])


class DifficultySampler(DeepSpeedDataSampler):
    """DeepSpeed's DeepSpeedDataSampler whose state resumes it exactly: DeepSpeed's state_dict records the global
    numpy RNG (np.random.get_state()), which the sampler does not draw from; it draws its clusters and batches from
    its own generator (np_rng, seeded by data_efficiency.seed), whose state is kept instead. The state holds plain
    ints and lists only (a checkpoint's client state is read back without unpickling objects)."""

    def state_dict(self) -> Dict[str, Any]:
        state = {key: value for key, value in super().state_dict().items()
                 if key != CURRICULUM_LEARNING_NP_RNG_STATE}
        state["data_cluster_current_position"] = [int(p) for p in state["data_cluster_current_position"]]
        state["current_difficulties"] = {k: int(v) for k, v in state["current_difficulties"].items()}
        state["np_rng"] = copy.deepcopy(self.np_rng.bit_generator.state)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        rng = state.pop("np_rng")
        state[CURRICULUM_LEARNING_NP_RNG_STATE] = np.random.get_state()  # DeepSpeed sets it: leave it as it is
        with _quiet():
            super().load_state_dict(state)
        for metric, difficulty in self.current_difficulties.items():  # the schedulers continue from there
            self.curriculum_schedulers[metric].state["current_difficulty"] = difficulty
        self.np_rng.bit_generator.state = rng

    def sample_from_clusters(self):
        if not self.data_clusters:  # DeepSpeed's own error here is numpy's "a must be a positive integer"
            raise DataError(f"no training sample is within the first difficulty {self.current_difficulties} of "
                            f"data_efficiency.data_sampling.curriculum_learning.curriculum_metrics: raise "
                            f"min_difficulty (with difficulty_type percentile a percentile needs at least "
                            f"max_difficulty training samples)")
        return super().sample_from_clusters()

    def reshuffle_clusters(self, cidx: int) -> None:
        """DeepSpeed rewrites an exhausted cluster's file in place, reshuffled: a checkpoint taken before that would
        resume reading the new order. Write it under a new name instead (the state names the file it reads)."""
        stem, _, generation = self.data_cluster_paths[cidx].partition("_reshuffle")
        self.data_cluster_paths[cidx] = f"{stem}_reshuffle{int(generation or 0) + 1}"
        with _quiet():
            super().reshuffle_clusters(cidx)

    def get_new_cluster(self, previous_difficulties) -> None:
        with _quiet():
            super().get_new_cluster(previous_difficulties)

    def difficulties(self) -> Dict[str, int]:
        """The current bound of each metric (the last global batch's)."""
        return {metric: int(value) for metric, value in getattr(self, "current_difficulties", {}).items()}


def analysis_problems(config: Dict[str, Any], num_samples: int) -> None:
    """A DataError naming the key when an analysis counts other samples than the training split has (it was made
    for another config: other data, split, seq_length, seed or length), instead of an IndexError mid-run."""
    where = "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics"
    for name, metric in config["data_sampling"]["curriculum_learning"]["curriculum_metrics"].items():
        with _quiet():
            index = MMapIndexedDataset(metric["index_to_sample_path"], skip_warmup=True)  # alive while its sizes are
        analysed = int(np.sum(index.sizes, dtype=np.int64))  # read: they are a view of its memory map
        if analysed != num_samples:
            raise DataError(f"{where}.{name}.index_to_sample_path: the analysis holds {analysed} samples but this "
                            f"config's training split has {num_samples}: it was made for other settings (data, "
                            f"split, seq_length, seed or the run's length); run tools/datasets/analyze_difficulty.py "
                            f"again with this config")


def difficulty_sampler(config: Dict[str, Any], num_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                       dp_group, gradient_accumulation_steps: int, global_rank: int,
                       state: Optional[Dict[str, Any]] = None) -> DifficultySampler:
    """The sampler of the ``num_samples`` training samples for one data-parallel rank; ``config``: DeepSpeed's
    parsed data_efficiency section (engine.data_efficiency_config()); ``state``: a checkpoint's."""
    analysis_problems(config, num_samples)
    with _quiet():
        sampler = DifficultySampler(config, num_samples, micro_batch_size, dp_rank, dp_size, dp_group,
                                    gradient_accumulation_steps, global_rank, drop_last=True)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler

