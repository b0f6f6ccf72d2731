"""Curriculum sampling by analysed difficulty (megatron.data.difficulty): DeepSpeed's DataAnalyzer writes each
sample's metric, and DeepSpeed's sampler, on two data-parallel ranks, draws every global batch from samples whose
analysed metric is within the step's scheduled bound; its state resumes the same batches."""
import copy

import numpy as np
import pytest

from megatron.data.difficulty import analyze, difficulty_sampler, sample_metric
from megatron.errors import DataError
from tests.distributed_helpers import run_distributed

pytestmark = pytest.mark.slow  # two spawned ranks

SEQ = 16
STEPS = 10
MICRO, DP, ACCUMULATION = 2, 2, 2


def _samples(count: int):
    """Sample i: 1 + i * 7 % SEQ tokens, the rest padding (-100): its seqlen metric is known."""
    out = []
    for i in range(count):
        length = 1 + (i * 7) % SEQ
        out.append({"text": np.array([5] * length + [-100] * (SEQ + 1 - length), dtype=np.int64)})
    return out


def _config(paths, cluster_path: str, difficulty_type: str = "value"):
    metric = {"index_to_sample_path": paths["index_to_sample_path"] if difficulty_type == "value"
              else paths["percentile_index_to_sample_path"],
              "index_to_metric_path": paths["index_to_metric_path"], "difficulty_type": difficulty_type,
              "clustering_type": "schedule_based", "min_difficulty": 4 if difficulty_type == "value" else 20,
              "max_difficulty": SEQ if difficulty_type == "value" else 100, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 1}}
    # as DeepSpeed's engine parses the section (engine.data_efficiency_config())
    return {"enabled": True, "seed": 1234, "data_sampling": {
        "enabled": True, "num_epochs": 1, "num_workers": 0, "curriculum_learning": {
            "enabled": True, "data_cluster_path": cluster_path, "curriculum_metrics": {"seqlen": metric}}}}


def _draw(rank, world_size, config, num_samples, resume_at):
    """Each step's drawn indices and bound on this rank; then the same steps again from the state at resume_at."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")

    def sampler(state=None):
        return difficulty_sampler(config, num_samples, MICRO, rank, world_size, dist.group.WORLD, ACCUMULATION, rank,
                                  state)

    def steps(it, sampler_, count):
        out = []
        for _ in range(count):
            drawn = [i for _ in range(ACCUMULATION) for i in next(it)]
            out.append((drawn, sampler_.difficulties()["seqlen"]))
        return out

    first = sampler()
    it = iter(first)
    straight = steps(it, first, resume_at)
    state = copy.deepcopy(first.state_dict())
    straight += steps(it, first, STEPS - resume_at)
    again = sampler(state)
    resumed = steps(iter(again), again, STEPS - resume_at)
    return straight, resumed


def test_the_sampler_draws_within_the_scheduled_difficulty_and_resumes(tmp_path):
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    samples = _samples(400)
    paths = analyze(samples, ["seqlen"], str(tmp_path / "analysis"), vocab_size=8, batch_size=8)["seqlen"]
    metric = sample_metric(paths["index_to_sample_path"])
    assert list(metric) == [1 + (i * 7) % SEQ for i in range(400)]  # the analysis read each sample's length

    with pytest.raises(DataError, match="seqlen.index_to_sample_path: the analysis holds 400 samples but this "
                                        "config's training split has 500"):
        difficulty_sampler(_config(paths, str(tmp_path / "clusters")), 500, MICRO, 0, 1, None, 1, 0)
    for difficulty_type in ("value", "percentile"):
        config = _config(paths, str(tmp_path / f"clusters_{difficulty_type}"), difficulty_type)
        ranks = run_distributed(_draw, world_size=DP, args=(config, len(samples), 4), timeout_s=120)
        schedule = CurriculumScheduler(copy.deepcopy(config["data_sampling"]["curriculum_learning"]
                                                     ["curriculum_metrics"]["seqlen"]))
        bounds = [schedule.update_difficulty(step) for step in range(1, STEPS + 1)]
        ordered = np.sort(metric)
        for straight, resumed in ranks:
            assert [bound for _, bound in straight] == bounds
            assert resumed == straight[4:]  # the state continues the same batches and bounds
            for (drawn, bound), step in zip(straight, range(1, STEPS + 1)):
                # a value bound is a length; a percentile bound the length at that share of the sorted samples
                limit = bound if difficulty_type == "value" else ordered[len(ordered) // 100 * bound - 1] \
                    if bound < 100 else ordered[-1]
                assert len(drawn) == MICRO * ACCUMULATION and max(metric[drawn]) <= limit, (step, bound, drawn)
        assert ranks[0][0] != ranks[1][0]  # each rank reads its own part of the global batch
        assert bounds[0] < bounds[-1]
