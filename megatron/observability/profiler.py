"""profile / profile_step_start / profile_step_stop: the steps between them recorded by torch.profiler on any device,
one trace file per rank, plus NVTX ranges and the CUDA profiler's capture range where CUDA is present.

GPT-NeoX's keys (megatron/training.py): with ``profile`` it wraps the steps whose starting iteration (steps already
taken) lies in [profile_step_start, profile_step_stop] in NVTX ranges between cudaProfilerStart and cudaProfilerStop,
for ``nsys profile --capture-range=cudaProfilerApi``, and runs torch.profiler with a TensorBoard trace handler. Here the
same steps (the iterations logged as profile_step_start + 1 .. profile_step_stop + 1) are recorded by torch.profiler
(CPU activity always, CUDA kernels where CUDA is present; shapes, memory, FLOPs and module names as GPT-NeoX records
them), each step a ``ProfilerStep#N`` of the trace, and each rank writes its own Chrome-trace JSON,
``rank{R}.<timestamp>.pt.trace.json``, into ``trace_dir``: ``<tensorboard_dir>/profile`` (TensorBoard's profiler
plugin shows it there), else ``<log_dir>/profile``. Perfetto (ui.perfetto.dev) and chrome://tracing open the files as
they are. Where CUDA is present each profiled step is also an NVTX range ``iteration N`` inside cudaProfilerStart /
cudaProfilerStop, so that nsys captures exactly those steps as under GPT-NeoX.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

TRACE_SUBDIR = "profile"


def trace_dir(tensorboard_dir: Optional[str], log_dir: Optional[str]) -> Optional[str]:
    """Where the traces go: <tensorboard_dir>/profile, else <log_dir>/profile; None when neither is set."""
    base = tensorboard_dir or log_dir
    return os.path.join(base, TRACE_SUBDIR) if base else None


class StepProfiler:
    """Records the steps that start at iterations ``start``..``stop`` (steps taken before them); call ``begin`` and
    ``end`` around every step, and ``close`` when training ends (a run that stops inside the range writes what it
    recorded)."""

    def __init__(self, start: int, stop: int, directory: str, rank: int, cuda: Optional[bool] = None) -> None:
        self.start, self.stop, self.directory, self.rank = start, stop, directory, rank
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.profiler: Optional[Any] = None
        self.trace_file: Optional[str] = None

    def _profiled(self, iteration: int) -> bool:
        return self.start <= iteration <= self.stop

    def begin(self, iteration: int) -> None:
        """Before the step that starts at ``iteration`` steps taken."""
        if not self._profiled(iteration):
            return
        if self.profiler is None:
            self._start()
        if self.cuda:
            torch.cuda.nvtx.range_push(f"iteration {iteration + 1}")

    def end(self, iteration: int) -> None:
        """After the step that started at ``iteration``."""
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.nvtx.range_pop()
        self.profiler.step()
        if iteration >= self.stop:
            self.close()

    def close(self) -> None:
        """Stop recording and write this rank's trace (nothing when not recording)."""
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        profiler, self.profiler = self.profiler, None
        profiler.stop()

    def _start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda and torch.profiler.ProfilerActivity.CUDA in torch.profiler.supported_activities():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.cuda:
            torch.cuda.cudart().cudaProfilerStart()
        handler = torch.profiler.tensorboard_trace_handler(self.directory, worker_name=f"rank{self.rank}")

        def write(profiler) -> None:
            before = set(os.listdir(self.directory))
            handler(profiler)
            written = sorted(set(os.listdir(self.directory)) - before)
            self.trace_file = os.path.join(self.directory, written[-1]) if written else None

        # the schedule makes each step a ProfilerStep#N of the trace (recording from the first step on)
        schedule = torch.profiler.schedule(wait=0, warmup=0, active=self.stop - self.start + 1, repeat=1)
        self.profiler = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write,
                                               record_shapes=True, profile_memory=True, with_flops=True,
                                               with_modules=True)
        self.profiler.start()


def step_profiler(neox_args, rank: int) -> Optional[StepProfiler]:
    """The run's StepProfiler, None without ``profile`` (validation makes sure a trace directory exists)."""
    if not neox_args.profile:
        return None
    return StepProfiler(neox_args.profile_step_start, neox_args.profile_step_stop,
                        trace_dir(neox_args.tensorboard_dir, neox_args.log_dir), rank)
