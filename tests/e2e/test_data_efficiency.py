"""DeepSpeed's data_efficiency section through deepy.py: random layerwise token dropping (data_routing.random_ltd)
trains with the tokens per layer DeepSpeed's RandomLTDScheduler gives for each step, and resumes its schedule
exactly; curriculum sampling by analysed difficulty (data_sampling) draws samples within the scheduled difficulty
(tests/data/test_difficulty.py tests the sampler against the analysed metric in process)."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.launch import REPO, deepy_environment
from tests.e2e.training_run import TrainingRun, build_tiny_corpus, falls

pytestmark = pytest.mark.slow

RANDOM_LTD = {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
              "random_ltd_schedule": {"min_value": 8, "max_value": 32, "schedule_type": "fixed_linear",
                                      "schedule_config": {"require_steps": 9, "seq_per_step": 8}}}


def scheduled(steps: int, train_batch_size: int):
    """(kept tokens, consumed layer tokens) after each of ``steps`` steps, from DeepSpeed's own scheduler."""
    from deepspeed.runtime.data_pipeline.data_routing.scheduler import RandomLTDScheduler

    config = {**copy.deepcopy(RANDOM_LTD), "global_batch_size": train_batch_size,
              "layer_token_lr_schedule": {"enabled": False}}
    scheduler = RandomLTDScheduler(config)
    out = []
    for step in range(steps):  # global_steps at step k (1-based) is k - 1
        scheduler.update_seq(step)
        out.append((scheduler.get_current_seq(), scheduler.state["consumed_layer_tokens"]))
    return out


def sampling(analysis: Path, clusters: Path):
    return {"enabled": True, "num_epochs": 1, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(clusters), "curriculum_metrics": {"vocab_rarity": {
            "index_to_sample_path": str(analysis / "vocab_rarity" / "vocab_rarity_index_to_sample_percentile_merged"),
            "difficulty_type": "percentile", "clustering_type": "schedule_based", "min_difficulty": 10,
            "max_difficulty": 100, "schedule_type": "fixed_root",
            "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1, "root_degree": 2}}}}}


def test_random_ltd_and_difficulty_sampling_follow_their_schedules_learn_and_resume_exactly(tmp_path):
    """One run with both parts: the difficulty analysis by the tool over the run's own config first."""
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    data = build_tiny_corpus(tmp_path / "corpus")
    section = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": RANDOM_LTD},
               "data_sampling": sampling(tmp_path / "analysis", tmp_path / "clusters")}
    # pipe_parallel_size 1 (GPT-NeoX's default): the pipeline engine and module, whose layers the wrappers sit in;
    # rotary positions (most GPT-NeoX configs'): the kept tokens rotated at their places
    straight = TrainingRun(tmp_path / "straight", data, pos_emb="rotary", train_iters=12, checkpoint_factor=6,
                           pipe_parallel_size=1, data_efficiency=section)
    config = tmp_path / "analysis.yml"
    config.write_text(yaml.safe_dump(straight.config))
    analysis = subprocess.run([sys.executable, str(Path(REPO) / "tools" / "datasets" / "analyze_difficulty.py"),
                               str(config), "--metrics", "vocab_rarity", "--save-path", str(tmp_path / "analysis")],
                              capture_output=True, text=True, timeout=300, env=deepy_environment())
    assert analysis.returncode == 0 and "vocab_rarity_index_to_sample_percentile_merged" in analysis.stdout, \
        analysis.stdout[-3000:] + analysis.stderr[-3000:]
    straight.launch()
    straight.assert_ok()
    records = straight.records()
    expected = scheduled(12, 4)
    assert [(r["random_ltd_kept_tokens"], r["random_ltd_layer_tokens"]) for r in records] == expected
    assert expected[0][0] == 8 and expected[-1][0] == 32  # the schedule goes from dropping 3/4 to none
    schedule = CurriculumScheduler(copy.deepcopy(section["data_sampling"]["curriculum_learning"]
                                                 ["curriculum_metrics"]["vocab_rarity"]))
    bounds = [schedule.update_difficulty(step) for step in range(1, 13)]
    assert [r["data_efficiency_difficulty/vocab_rarity"] for r in records] == bounds and bounds[0] < 100
    losses = straight.losses()
    assert all(loss == loss and loss < 20 for loss in losses.values()) and falls(losses), losses
    resumed = straight.resumed_from(6, tmp_path / "resumed")
    resumed.launch()
    resumed.assert_ok()
    assert [(r["random_ltd_kept_tokens"], r["random_ltd_layer_tokens"]) for r in resumed.records()] == expected[6:]
    assert [r["data_efficiency_difficulty/vocab_rarity"] for r in resumed.records()] == bounds[6:]
    assert resumed.losses() == {i: losses[i] for i in range(7, 13)}  # the same batches, the same dropped tokens
