"""profile / profile_step_start / profile_step_stop: torch.profiler records exactly the steps between them into one
Chrome-trace file per rank, and with CUDA each of them is an NVTX range inside the CUDA profiler's capture range
(through deepy.py: tests/e2e/test_train.py)."""
import glob
import json
import os
from types import SimpleNamespace

import pytest
import torch

from megatron.observability.profiler import StepProfiler, step_profiler, trace_dir
from tests.neox_arguments.helpers import problems_of, tiny


def _train(profiler: StepProfiler, steps: int) -> None:
    model = torch.nn.Linear(16, 16)
    for iteration in range(steps):
        profiler.begin(iteration)
        model(torch.randn(4, 16)).sum().backward()
        profiler.end(iteration)
    profiler.close()


def test_the_steps_between_start_and_stop_are_one_trace_file_per_rank(tmp_path):
    args = tiny(profile=True, profile_step_start=1, profile_step_stop=2, tensorboard_dir=str(tmp_path / "tb"),
                train_iters=5)
    profiler = step_profiler(args, rank=3)
    assert profiler.directory == str(tmp_path / "tb" / "profile") and not profiler.cuda
    _train(profiler, 5)
    [trace] = glob.glob(str(tmp_path / "tb" / "profile" / "rank3.*.pt.trace.json"))
    assert profiler.trace_file == trace
    events = json.load(open(trace))["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert len(steps) == 2, steps  # the steps taken after 1 and after 2 steps
    assert any(e.get("name") == "aten::addmm" for e in events)


def test_a_run_ending_inside_the_range_writes_what_it_recorded(tmp_path):
    profiler = StepProfiler(2, 100, str(tmp_path), rank=0, cuda=False)
    _train(profiler, 4)
    assert len(glob.glob(str(tmp_path / "rank0.*.pt.trace.json"))) == 1


def test_with_cuda_each_profiled_step_is_an_nvtx_range_inside_the_capture_range(tmp_path, monkeypatch):
    """The CUDA calls (recorded here; this machine has no GPU) come in GPT-NeoX's order around steps 2 and 3."""
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    runtime = SimpleNamespace(cudaProfilerStart=lambda: calls.append(("start",)),
                              cudaProfilerStop=lambda: calls.append(("stop",)))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    _train(StepProfiler(1, 2, str(tmp_path), rank=0, cuda=True), 4)
    assert calls == [("start",), ("push", "iteration 2"), ("pop",), ("push", "iteration 3"), ("pop",), ("stop",)]


def test_without_cuda_no_cuda_call_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("CUDA called"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: pytest.fail("NVTX called"))
    _train(StepProfiler(0, 0, str(tmp_path), rank=0, cuda=False), 2)


def test_traces_go_under_tensorboard_dir_else_log_dir_and_bad_settings_are_named():
    assert trace_dir("tb", "logs") == os.path.join("tb", "profile")
    assert trace_dir(None, "logs") == os.path.join("logs", "profile") and trace_dir(None, None) is None
    assert "set tensorboard_dir or log_dir" in problems_of(profile=True)
    assert "need 0 <= start <= stop" in problems_of(profile=True, log_dir="logs", profile_step_start=3,
                                                    profile_step_stop=2)
    assert "profile_step_start=10 is not below train_iters=4" in problems_of(profile=True, log_dir="logs",
                                                                             train_iters=4)
    assert "profile_step_start=1 is a setting of profile" in problems_of(profile_step_start=1)
