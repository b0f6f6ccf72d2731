"""TrainingLogger: metrics.jsonl values computed by hand, console line, TensorBoard read-back, W&B and Comet
offline runs, missing packages; and the debugging-value helpers."""

import glob
import io
import json
import math
import os
import sys

import pytest
import torch
from torch import nn

from megatron.observability.training_logger import (
    MemoryProfiler,
    TrainingLogger,
    debug_metrics,
    gradient_norms,
    gradient_pct_zeros,
    memory_stats,
    optimizer_state_norms,
    parameter_norms,
    total_norm,
)
from megatron.model.config import ModelConfig
from megatron.utils.optional_deps import MissingOptionalDependency
from tests.neox_arguments.helpers import tiny

ADAM = {"type": "Adam", "params": {"lr": 1.0e-3}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _args(**overrides):
    values = {"optimizer": ADAM, "train_iters": 4, "log_interval": 2, **overrides}
    return tiny(**values)  # train_batch_size 2, seq_length 32 -> 64 tokens per iteration


def _logger(args, **kwargs) -> TrainingLogger:
    """A logger for ``args``' model with the tokenizer's 100 tokens padded to 128."""
    return TrainingLogger(args, ModelConfig.from_neox_args(args, padded_vocab_size=128), **kwargs)


def _run(logger: TrainingLogger, clock: FakeClock, losses=(4.0, 2.0, 3.0, 1.0)):
    records = []
    for iteration, loss in enumerate(losses, start=1):
        clock.now += 0.5
        records.append(
            logger.log_train(
                iteration,
                torch.tensor(loss),
                lr=1e-3 * iteration,
                grad_norm=torch.tensor(0.5),
                extras={"loss_scale": 1.0},
            )
        )
    return records


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_metrics_jsonl_and_console(tmp_path, monkeypatch):
    monkeypatch.delenv("NEOX_PEAK_TFLOPS", raising=False)
    clock, console = FakeClock(), io.StringIO()
    logger = _logger(_args(log_dir=str(tmp_path)), console=console, clock=clock, peak=None)
    records = _run(logger, clock)
    assert records[0] is None and records[2] is None
    logger.log_eval(4, torch.tensor(2.0))
    logger.close()
    train2, train4, evaluation = _read_jsonl(tmp_path / "metrics.jsonl")
    # interval of 2 iterations in 1.0 s: 2 x 64 tokens / 1 s = 128 tokens/s, 2 x 2 samples / 1 s = 4 samples/s
    # tflops = 688128 FLOPs/token (tests/observability/test_flops.py) x 128 / 1 device / 1e12
    assert train2["iteration"] == 2 and train2["lm_loss"] == pytest.approx(3.0)  # mean of 4 and 2
    assert train2["lr"] == pytest.approx(2e-3) and train2["grad_norm"] == 0.5
    assert train2["tokens_per_sec"] == pytest.approx(128.0) and train2["samples_per_sec"] == pytest.approx(4.0)
    assert train2["tflops"] == pytest.approx(688128 * 128 / 1e12) and train2["mfu"] is None
    assert train2["eta_s"] == pytest.approx(1.0) and train2["loss_scale"] == 1.0
    assert train4["lm_loss"] == pytest.approx(2.0) and train4["eta_s"] == 0.0
    assert evaluation == {
        "type": "eval",
        "split": "validation",
        "iteration": 4,
        "lm_loss": 2.0,
        "lm_loss_ppl": pytest.approx(math.exp(2.0)),
    }
    note, *lines = console.getvalue().splitlines()
    assert note.startswith("MFU is not applicable")
    assert lines[0].startswith("iteration        2/       4 | lr 2.0000E-03 | lm_loss 3.000000E+00")
    assert "tokens/s 128.0" in lines[0] and "MFU n/a" in lines[0] and "ETA 0:00:01" in lines[0]
    assert lines[2].startswith("validation at iteration 4 | lm_loss 2.000000E+00")


def test_checkpoint_resume_and_summary_lines(tmp_path):
    """What the run did, in words, on the logging rank only: each save (seconds, size), the resume (iteration,
    samples), and the summary (iterations, wall time, tokens/s of the steps, the last losses, where things are)."""
    console = io.StringIO()
    args = _args(log_dir=str(tmp_path / "logs"), save=str(tmp_path / "ckpt"), log_interval=1)
    logger = _logger(args, console=console, clock=FakeClock())
    logger.log_resume(str(tmp_path / "ckpt" / "global_step2"), 2, 4, 8, finetune=False)
    for iteration in (3, 4):
        logger.log_train(iteration, 2.0 + iteration, lr=0.1, step_time=0.5)
    logger.log_save(str(tmp_path / "ckpt" / "global_step4"), 4, 0.25, 3 * 1024 ** 2)
    logger.log_save_started(str(tmp_path / "ckpt" / "global_step4"), 4)
    logger.log_save(str(tmp_path / "ckpt" / "global_step4"), 4, 12.5, 1536, background=True)
    summary = {"start_iteration": 2, "iteration": 4, "losses": [5.0, 6.0],
               "eval": [(4, "validation", 3.5), (4, "eval_tasks", {"acc": 0.5}), (4, "test", 3.25)]}
    logger.log_summary(summary, 75.0, str(tmp_path / "ckpt" / "global_step4"))
    logger.log_summary({**summary, "stopped_by": "SIGTERM", "eval": []}, 3.0, None)
    silent = io.StringIO()
    _logger(args, console=silent, clock=FakeClock(), is_logging_rank=False).log_summary(summary, 1.0, None)
    logger.close()
    lines = [line for line in console.getvalue().splitlines() if not line.startswith(("iteration", "MFU"))]
    ckpt = tmp_path / "ckpt"
    assert lines == [
        f"resumed from checkpoint {ckpt}/global_step2: iteration 2, 4 training samples consumed (8 validation)",
        f"saved checkpoint {ckpt}/global_step4 (iteration 4) in 0.25 s, 3.0 MiB",
        f"saving checkpoint {ckpt}/global_step4 (iteration 4) in the background",
        f"saved checkpoint {ckpt}/global_step4 (iteration 4) written in the background in 12.5 s, 1.5 KiB",
        # 2 steps of 2 x 32 tokens in 2 x 0.5 s
        "run summary: finished at iteration 4 (2 iterations run, from 2), wall time 0:01:15, 128 tokens/s over the "
        "training steps",
        "  last lm_loss: train 6.000000E+00 (iteration 4), validation 3.500000E+00 (iteration 4), test 3.250000E+00 "
        "(iteration 4)",
        f"  checkpoint {ckpt}/global_step4; metrics {tmp_path / 'logs' / 'metrics.jsonl'}",
        "run summary: stopped by SIGTERM at iteration 4 (2 iterations run, from 2), wall time 3.00 s, 128 tokens/s "
        "over the training steps",
        "  last lm_loss: train 6.000000E+00 (iteration 4)",
        f"  no checkpoint in {ckpt}; metrics {tmp_path / 'logs' / 'metrics.jsonl'}",
    ]
    assert silent.getvalue() == ""
    logger.log_summary({**summary, "exited_at_interval": True}, 3.0, None)
    assert console.getvalue().splitlines()[-3].startswith("run summary: stopped by exit_interval at iteration 4 ")


def test_mfu_iteration_times_and_skipped(tmp_path):
    clock = FakeClock()
    logger = _logger(
        _args(log_dir=str(tmp_path), log_interval=3, train_iters=100),
        console=io.StringIO(),
        clock=clock,
        peak=1e-6,
        flops_per_token=1e6,
    )
    logger.log_train(1, 2.0, lr=0.1, step_time=0.25)
    logger.log_train(2, float("nan"), lr=0.1, skipped=True, step_time=0.25)
    clock.now += 60.0  # evaluation time, left out because the loop reports iteration times
    record = logger.log_train(3, 4.0, lr=0.1, step_time=0.25)
    logger.close()
    # 3 iterations in 0.75 s: 3 x 64 / 0.75 = 256 tokens/s; 1e6 FLOPs/token -> 2.56e-4 TFLOP/s; peak 1e-6
    assert record["tokens_per_sec"] == pytest.approx(256.0)
    assert record["tflops"] == pytest.approx(2.56e-4) and record["mfu"] == pytest.approx(256.0)
    assert record["lm_loss"] == pytest.approx(3.0) and record["skipped_iterations"] == 1
    assert record["eta_s"] == pytest.approx(97 * 0.25)


def test_a_curriculum_steps_tokens_are_counted_at_its_length(tmp_path):
    console = io.StringIO()
    logger = _logger(_args(log_dir=str(tmp_path), log_interval=2), console=console, clock=FakeClock())
    logger.log_train(1, 2.0, lr=0.1, step_time=0.5, seq_length=8, extras={"curriculum_seqlen": 8})
    record = logger.log_train(2, 2.0, lr=0.1, step_time=0.5, seq_length=16, extras={"curriculum_seqlen": 16})
    logger.close()
    # batch 2: 2 x 8 + 2 x 16 tokens in 1 s, not 2 x 2 x seq_length 32
    assert record["tokens_per_sec"] == pytest.approx(48.0) and record["curriculum_seqlen"] == 16
    assert "curriculum_seqlen 16" in console.getvalue().splitlines()[-1]


def test_train_records_carry_the_gpu_peak_memory_on_cuda(tmp_path, monkeypatch):
    logger = _logger(_args(log_dir=str(tmp_path), log_interval=1), console=io.StringIO(), clock=FakeClock(),
                            peak=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**30)
    record = logger.log_train(1, 2.0, lr=0.1, step_time=0.5)
    logger.close()
    assert record["gpu_max_allocated_gb"] == pytest.approx(3.0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "gpu_max_allocated_gb" not in logger.log_train(2, 2.0, lr=0.1, step_time=0.5)


def test_other_ranks_write_nothing(tmp_path):
    console = io.StringIO()
    logger = _logger(_args(log_dir=str(tmp_path)), is_logging_rank=False, console=console, clock=FakeClock())
    assert _run(logger, FakeClock())[1] is not None
    logger.close()
    assert console.getvalue() == "" and not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    clock = FakeClock()
    logger = _logger(_args(tensorboard_dir=str(tmp_path / "tb")), console=io.StringIO(), clock=clock)
    _run(logger, clock)
    logger.log_eval(4, 1.5)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/lm_loss")] == [(2, 3.0), (4, 2.0)]
    assert [e.value for e in events.Scalars("train/tokens_per_sec")] == pytest.approx([128.0, 128.0])
    assert [(e.step, e.value) for e in events.Scalars("validation/lm_loss")] == [(4, 1.5)]


def test_wandb_offline_writes_a_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    clock = FakeClock()
    args = _args(log_dir=str(tmp_path), use_wandb=True, wandb_project="neox-test", wandb_run_name="tiny")
    logger = _logger(args, console=io.StringIO(), clock=clock)
    _run(logger, clock)
    logger.close()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "run-*.wandb"))


def test_comet_offline_writes_an_archive(tmp_path, monkeypatch):
    monkeypatch.delenv("COMET_API_KEY", raising=False)
    monkeypatch.delenv("COMET_OFFLINE_DIRECTORY", raising=False)
    monkeypatch.setenv("COMET_ERROR_TRACKING_ENABLE", "false")  # no crash reports from a test
    monkeypatch.setenv("COMET_DISABLE_ANNOUNCEMENT", "true")
    clock = FakeClock()
    args = _args(log_dir=str(tmp_path), use_comet=True, comet_project="neox-test", comet_tags=["tiny"])
    logger = _logger(args, console=io.StringIO(), clock=clock)
    _run(logger, clock)
    logger.close()
    assert glob.glob(str(tmp_path / "comet" / "*.zip"))


def test_missing_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingOptionalDependency, match="use_wandb.*requirements-wandb.txt"):
        _logger(_args(use_wandb=True), console=io.StringIO())


# ---- debugging values ------------------------------------------------------------------------------


def _model_with_grads() -> nn.Module:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(2.0)
    model.weight.grad = torch.tensor([[3.0, 4.0]])
    model.bias.grad = torch.tensor([0.0])
    return model


def test_gradient_parameter_norms_and_zeros():
    model = _model_with_grads()
    grads = gradient_norms(model)
    assert grads == {"gradient_norms/weight": 5.0, "gradient_norms/bias": 0.0}
    assert total_norm(grads) == 5.0
    assert parameter_norms(model) == {
        "parameter_norms/weight": pytest.approx(math.sqrt(5.0)),
        "parameter_norms/bias": 2.0,
    }
    assert gradient_pct_zeros(model) == {"gradient_pct_zeros/weight": 0.0, "gradient_pct_zeros/bias": 100.0}


def test_optimizer_state_norms_after_one_adam_step():
    model = _model_with_grads()
    opt = torch.optim.Adam(model.parameters(), betas=(0.9, 0.999))
    opt.step()
    norms = optimizer_state_norms(model, opt)
    # exp_avg = 0.1 g -> 0.5; exp_avg_sq = 0.001 g^2 = [0.009, 0.016] -> 0.001 * sqrt(81 + 256)
    assert norms["optimizer_state_norms/weight/exp_avg"] == pytest.approx(0.5)
    assert norms["optimizer_state_norms/weight/exp_avg_sq"] == pytest.approx(0.001 * math.sqrt(337.0))
    assert "optimizer_state_norms/weight/step" not in norms


def test_debug_metrics_follows_the_switches(tmp_path):
    model = _model_with_grads()
    args = _args(log_grad_norm=True, log_grad_pct_zeros=True, memory_profiling=True)
    values = debug_metrics(args, model)
    assert values["grad_norm_total"] == 5.0 and values["gradient_pct_zeros/bias"] == 100.0
    assert not any(key.startswith("parameter_norms/") for key in values)
    assert values["memory/max_rss_gb"] > 0
    with pytest.raises(ValueError, match="optimizer"):
        debug_metrics(_args(log_optimizer_states=True), model)


def test_debug_values_add_the_ranks_shares_of_each_parameter():
    """Two tensor-parallel shards of one weight, a bias on two stages (a tied copy, counted on one stage only)."""
    from megatron.observability.training_logger import counted_here, debug_sums, debug_values

    args = _args(log_grad_norm=True, log_grad_pct_zeros=True, log_param_norm=True)
    shard0, shard1, tied_copy = _model_with_grads(), _model_with_grads(), _model_with_grads()
    shard1.weight.grad = torch.tensor([[0.0, 12.0]])
    for model in (shard0, shard1):
        model.weight.model_parallel = True
    tied_copy.weight.ds_pipe_replicated = True
    tp_rank1 = type("TensorParallelRank1", (), {"get_model_parallel_rank": lambda self: 1})()
    assert counted_here(shard1.weight, tp_rank1) and not counted_here(shard1.bias, tp_rank1)
    assert not counted_here(tied_copy.weight)
    shares = [debug_sums(args, shard0), debug_sums(args, shard1, parallel_state=tp_rank1),
              debug_sums(args, tied_copy, names=lambda name: f"other.{name}")]
    values = debug_values(args, shares)
    assert values["gradient_norms/weight"] == 13.0  # sqrt(3^2 + 4^2 + 12^2)
    assert values["gradient_pct_zeros/weight"] == 25.0 and values["gradient_pct_zeros/bias"] == 100.0
    assert "gradient_norms/other.weight" not in values and values["gradient_norms/other.bias"] == 0.0
    assert values["parameter_norms/weight"] == pytest.approx(math.sqrt(10.0))
    assert values["grad_norm_total"] == 13.0
    assert values["param_norm_total"] == pytest.approx(math.sqrt(10.0 + 4.0 + 4.0))


def test_memory_stats_and_profiler_on_cpu(tmp_path):
    if torch.cuda.is_available():
        assert "memory/allocated_gb" in memory_stats()
        return
    stats = memory_stats()
    assert 0 < stats["memory/rss_gb"] <= stats["memory/max_rss_gb"] + 1e-3 < 1024
    profiler = MemoryProfiler(_args(memory_profiling=True, memory_profiling_path=str(tmp_path / "mem")))
    path = profiler.dump(7)
    profiler.stop()
    with open(path, encoding="utf-8") as f:
        assert json.load(f)["iteration"] == 7
    with pytest.raises(ValueError, match="memory_profiling_path"):
        MemoryProfiler(_args(memory_profiling=True))


def test_eval_extras_reach_the_record_and_the_console(tmp_path):
    console = io.StringIO()
    logger = _logger(_args(log_dir=str(tmp_path)), console=console, clock=FakeClock(), peak=1.0)
    logger.log_eval(3, 2.0, extras={"lm_loss_char_lvl_ppl": 1.5})
    logger.close()
    (record,) = _read_jsonl(tmp_path / "metrics.jsonl")
    assert record["lm_loss_char_lvl_ppl"] == 1.5
    assert console.getvalue().splitlines()[-1].endswith("| lm_loss_char_lvl_ppl 1.500000E+00")
