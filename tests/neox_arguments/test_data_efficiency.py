"""DeepSpeed's data_efficiency section: a good one reaches DeepSpeed's config (with this model's random-LTD keys
filled in); a bad one is one clear ConfigError naming the key (megatron.data.data_efficiency,
megatron.model.random_ltd_settings), missing analysis files a problem before launch naming the key."""
import copy

import numpy as np
import pytest
import yaml

from megatron.launch.prelaunch import data_problems
from tests.data.dataset_factory import write_dataset
from tests.e2e.launch import run_deepy
from tests.neox_arguments.helpers import TINY, problems_of, tiny

ROUTING = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
    "enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1, "random_ltd_layer_id": [1],
    "random_ltd_schedule": {"min_value": 8, "max_value": 32, "schedule_type": "fixed_linear",
                            "schedule_config": {"require_steps": 10, "seq_per_step": 8}}}}}
SAMPLING = {"enabled": True, "data_sampling": {"enabled": True, "num_epochs": 1, "curriculum_learning": {
    "enabled": True, "data_cluster_path": "clusters", "curriculum_metrics": {"vocab_rarity": {
        "index_to_sample_path": "analysis/vocab_rarity/vocab_rarity_index_to_sample",
        "index_to_metric_path": "analysis/vocab_rarity/vocab_rarity_index_to_metric",
        "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 100,
        "max_difficulty": 900, "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 1}}}}}}
LEARNED = {"pos_emb": "learned"}


def changed(section, path, value):
    out = copy.deepcopy(section)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return out


def test_random_ltd_reaches_deepspeed_with_this_models_keys():
    args = tiny(**LEARNED, data_efficiency=ROUTING)
    random_ltd = args.deepspeed_config["data_efficiency"]["data_routing"]["random_ltd"]
    assert random_ltd["random_ltd_layer_id"] == [1] and random_ltd["model_mask_name"] == "attention_mask"
    assert random_ltd["hidden_state_order"] == "batch_seq_dim" and random_ltd["model_type"] == "decoder"
    assert "data_efficiency" not in tiny().deepspeed_config
    off = tiny(**LEARNED, data_efficiency={**ROUTING, "enabled": False}).deepspeed_config
    assert "data_efficiency" not in off  # nothing of a switched-off section reaches DeepSpeed's engine
    # a switched-off part is off for DeepSpeed's engine too, which reads the innermost flag alone
    part_off = tiny(**LEARNED, data_efficiency=changed(ROUTING, "data_routing.enabled", False)).deepspeed_config
    assert part_off["data_efficiency"]["data_routing"]["random_ltd"]["enabled"] is False


KEY = "data_efficiency.data_routing.random_ltd"
CURRICULUM = "data_efficiency.data_sampling.curriculum_learning"


@pytest.mark.parametrize("section, overrides, needle", [
    (changed(ROUTING, "data_routing.random_ltd.random_ltd_layer_id", [1, 2]), LEARNED,
     f"{KEY}.random_ltd_layer_id: [2] out of range; the model's transformer layers are 0 .. 1"),
    (changed(ROUTING, "data_routing.random_ltd.total_layer_num", 24), LEARNED,
     f"{KEY}.total_layer_num=24 must be the model's num_layers=2"),
    (ROUTING, {"pos_emb": "alibi"}, f"{KEY} with pos_emb='alibi'"),
    (ROUTING, {**LEARNED, "pipe_parallel_size": 2, "num_gpus": 2}, f"{KEY} with pipe_parallel_size=2"),
    (changed(ROUTING, "data_routing.random_ltd.random_ltd_schedule.max_value", 64), LEARNED,
     f"{KEY}.random_ltd_schedule.max_value=64 must be seq_length=32"),
    (changed(ROUTING, "data_routing.random_ltd.hidden_state_order", "seq_batch_dim"), LEARNED,
     f"{KEY}.hidden_state_order='seq_batch_dim': this model's is 'batch_seq_dim'"),
    (changed(SAMPLING, "data_sampling.curriculum_learning.curriculum_metrics",
             {"perplexity": SAMPLING["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocab_rarity"]}),
     {}, f"{CURRICULUM}.curriculum_metrics.perplexity: unknown metric 'perplexity'; tools/datasets/"
         f"analyze_difficulty.py computes seqlen, vocab_rarity"),
    (changed(SAMPLING, "data_sampling.curriculum_learning.curriculum_metrics.vocab_rarity.index_to_metric_path",
             None), {}, f"{CURRICULUM}.curriculum_metrics.vocab_rarity.index_to_metric_path is missing"),
    (changed(SAMPLING, "data_sampling.curriculum_learning.curriculum_metrics",
             {"seqlen": SAMPLING["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["vocab_rarity"]}),
     {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                              "max_difficulty": 32, "schedule_type": "fixed_linear",
                              "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}},
     f"and {CURRICULUM}.curriculum_metrics.seqlen both schedule the sequence length"),
    (changed(SAMPLING, "data_sampling.bogus", 1), {}, "data_efficiency.data_sampling.bogus: unknown key"),
])
def test_a_bad_section_is_one_clear_error_naming_the_key(section, overrides, needle):
    message = problems_of(data_efficiency=section, **overrides)
    assert needle in message, message
    assert "not supported yet" not in message


def test_missing_analysis_files_are_named_before_launch(tmp_path):
    args = tiny(data_efficiency=SAMPLING, train_iters=2, data_path=str(tmp_path / "absent"))
    problems = [p for p in data_problems(args) if p.startswith("data_efficiency")]
    assert problems == [
        f"{CURRICULUM}.curriculum_metrics.vocab_rarity.{key}: 'analysis/vocab_rarity/vocab_rarity_{key[:-5]}' "
        f"(.bin/.idx) not found; write it with tools/datasets/analyze_difficulty.py over the same config (it "
        f"analyses the training split this config builds)" for key in ("index_to_sample_path", "index_to_metric_path")]


def test_deepy_refuses_a_run_whose_analysis_is_missing_with_one_message_naming_the_key(tmp_path):
    """Through deepy.py: refused before any worker starts, exit status 1-2, the key and the tool named once."""
    data = write_dataset(tmp_path / "data", [np.arange(1, 40) % 30 for _ in range(20)])
    config = {**TINY, "pos_emb": "learned", "train_iters": 2, "data_path": data,
              "tokenizer_type": "CharLevelTokenizer", "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "data_efficiency": changed(SAMPLING, "data_sampling.curriculum_learning.data_cluster_path",
                                         str(tmp_path / "clusters"))}
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(config))
    result = run_deepy(["train.py", str(path)], timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output
    assert output.count(f"{CURRICULUM}.curriculum_metrics.vocab_rarity.index_to_sample_path: 'analysis/") == 1, output
    assert "tools/datasets/analyze_difficulty.py" in output
