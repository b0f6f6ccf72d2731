"""DeepSpeed config sections through deepy.py on two CPU ranks, in one run and its resumption: ZeRO-3 with the
optimizer and the parameters offloaded to CPU (under tensor parallelism), comms_logger with prof_interval,
csv_monitor and flops_profiler together. (Offload's losses against the same run without offload are compared in
tests/optim/test_zero_offload.py; the flops profiler's counts against megatron/observability/flops.py in tests/observability/test_flops.py.)"""

import csv

import pytest

from tests.e2e.training_run import TrainingRun, build_tiny_corpus

pytestmark = pytest.mark.slow


def test_offload_comms_logger_csv_monitor_and_flops_profiler_in_one_run_that_resumes_exactly(tmp_path):
    data = build_tiny_corpus(tmp_path / "corpus")
    run = TrainingRun(
        tmp_path / "run", data, num_gpus=2, model_parallel_size=2, train_iters=4, checkpoint_factor=2,
        zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        optimizer={"type": "CPU_Adam", "params": {"lr": 3.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}},
        comms_logger={"enabled": True, "prof_all": True, "prof_interval": 2},
        csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"},
        flops_profiler={"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 1,
                        "output_file": str(tmp_path / "flops.txt")})
    run.launch()
    run.assert_ok()
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4] and run.checkpoints() == ["global_step2", "global_step4"]

    comms = run.records("comms")
    assert [r["iteration"] for r in comms] == [2, 4]  # every prof_interval, the last one also the end of training
    ops = comms[-1]["ops"]
    assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"} <= set(ops)  # ours and ZeRO-3's
    for figures in ops["all_reduce"].values():
        assert figures["count"] >= 1 and figures["avg_latency_ms"] >= 0 and "busbw_avg_gbps" in figures
    assert sum(f["count"] for f in ops["all_reduce"].values()) > \
        sum(f["count"] for f in comms[0]["ops"]["all_reduce"].values())  # cumulative
    rank0_log = next((run.directory / "logs").glob("*_rank0_stdout.txt")).read_text()
    assert rank0_log.count("Comm. Op") == 2 and "Avg Latency(ms)" in rank0_log

    with open(tmp_path / "csv" / "tiny" / "Train_Samples_lm_loss.csv", newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0][1] == "lm_loss"
    assert [float(value) for _, value in rows[1:]] == pytest.approx([losses[i] for i in (1, 2, 3, 4)], rel=1e-6)
    assert (tmp_path / "csv" / "tiny" / "Train_Samples_lr.csv").is_file()  # the engine's own events too

    profile = (tmp_path / "flops.txt").read_text()
    assert "DeepSpeed Flops Profiler" in profile and "Profile Summary at step 2" in profile
    assert "model parallel size:" in profile and "fwd flops per GPU" in profile

    run.launch(iteration=2)  # resume the offloaded run from its step-2 checkpoint (GPT-NeoX's `iteration` key)
    run.assert_ok()
    resumed = run.records("train")[4:]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["lm_loss"] for r in resumed] == [losses[3], losses[4]]
