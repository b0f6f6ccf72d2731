"""`python deepy.py train.py tiny.yml` with autotuning_run: run — DeepSpeed's autotuner explores ZeRO stage x micro
batch (here stages 0 and 1 at micro batch 1) on one CPU rank, writes its results and the optimal config, and then trains with that config (one launch)."""

import json

import pytest

from tests.e2e.training_run import TrainingRun, build_tiny_corpus

END_PROFILE_STEP = 2
TRAIN_ITERS = 4


@pytest.mark.slow
def test_autotuning_run_tunes_stage_and_micro_batch_then_trains_with_the_optimal_config(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    run = TrainingRun(tmp_path / "run", data, num_gpus=1, pipe_parallel_size=0, train_iters=TRAIN_ITERS,
                      train_micro_batch_size_per_gpu=1, zero_optimization={"stage": [0, 1]}, autotuning_run="run",
                      autotuning={"enabled": True, "fast": True, "start_profile_step": 1,
                                  "end_profile_step": END_PROFILE_STEP, "max_train_micro_batch_size_per_gpu": 1,
                                  "results_dir": str(results), "exps_dir": str(exps)})
    run.launch(timeout=900)
    run.assert_ok()

    # the profile run and one experiment per (stage, micro batch, accumulation), each with DeepSpeed's metrics
    assert json.loads((results / "profile_model_info" / "model_info.json").read_text())["num_params"] > 0
    measured = {folder.name: json.loads((folder / "metrics.json").read_text())
                for folder in results.iterdir() if (folder / "metrics.json").is_file()}
    assert {name[:2] for name in measured} == {"z0", "z1"}, sorted(measured)
    # one micro batch per stage keeps the test to four launches (profile, two experiments, training); the micro-batch
    # search itself is DeepSpeed's, its arguments tests/neox_arguments/test_autotuning.py's
    assert {name.rsplit("tmbspg", 1)[1] for name in measured} == {"1"}, sorted(measured)
    assert all(m["throughput"] > 0 and m["latency"] > 0 for m in measured.values())
    for name in measured:  # each experiment trained its own batch, without checkpoints, logging in its folder
        config = json.loads((results / name / "ds_config.json").read_text())
        rows = [json.loads(line) for line in (results / name / "logs" / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in rows if r["type"] == "train"] == list(range(1, END_PROFILE_STEP + 1))
        assert all(r["batch_size"] == config["train_batch_size"] for r in rows if r["type"] == "train")

    # the summary names the best experiment, whose config (less its autotuning section) is the optimal one
    best = max(measured, key=lambda name: measured[name]["throughput"])
    summary = (results / "summary.txt").read_text()
    assert "| global" in summary and best in summary, summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    best_config = json.loads((results / best / "ds_config.json").read_text())
    best_config.pop("autotuning")
    assert optimal == best_config and "autotuning" not in optimal
    assert (results / "cmd_optimal.txt").is_file()

    # `run`: a normal training run with the optimal batch and ZeRO stage, saved where the config says (only there:
    # the experiments neither saved nor logged here)
    train = run.records("train")
    assert [r["iteration"] for r in train] == list(range(1, TRAIN_ITERS + 1))
    assert {r["batch_size"] for r in train} == {optimal["train_batch_size"]}
    checkpoint = tmp_path / "run" / "ckpt"
    assert sorted(p.name for p in checkpoint.glob("global_step*")) == [f"global_step{TRAIN_ITERS}"]
    saved = json.loads((checkpoint / f"global_step{TRAIN_ITERS}" / "neox_args.json").read_text())
    assert saved["zero_stage"] == optimal["zero_optimization"]["stage"] and saved["autotuning_run"] is None
    assert saved["gradient_accumulation_steps"] == optimal["gradient_accumulation_steps"]
    zero_files = list((checkpoint / f"global_step{TRAIN_ITERS}").glob("*zero_pp_rank_*optim_states.pt"))
    assert bool(zero_files) == (optimal["zero_optimization"]["stage"] > 0)
