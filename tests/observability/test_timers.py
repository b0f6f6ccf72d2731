"""Timers: accumulation over start/stop pairs, reset, normalisation, misuse errors (fake clock)."""

import time

import pytest

from megatron.observability.timers import Timer, Timers, cuda_synchronizer


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_timer_accumulates_and_resets():
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("forward").start()
    clock.now = 0.25
    timers("forward").stop()
    clock.now = 1.0
    timers("forward").start()
    clock.now = 1.5
    timers("forward").stop()
    assert timers.elapsed_ms(["forward"], reset=False) == {"forward": pytest.approx(750.0)}
    assert timers.elapsed_ms(["forward"], normalizer=3) == {"forward": pytest.approx(250.0)}
    assert timers.elapsed_ms(["forward"]) == {"forward": 0.0}  # reset by the previous call


def test_elapsed_of_running_timer_counts_up_to_now_and_keeps_running():
    clock = FakeClock()
    timer = Timer("step", clock=clock)
    timer.start()
    clock.now = 2.0
    assert timer.elapsed(reset=True) == pytest.approx(2.0)
    assert timer.running
    clock.now = 3.0
    timer.stop()
    assert timer.elapsed() == pytest.approx(1.0)


def test_unknown_names_are_skipped_and_format_lists_times():
    clock = FakeClock()
    timers = Timers(clock=clock)
    timers("backward").start()
    clock.now = 0.01
    timers("backward").stop()
    assert "backward" in timers and "optimizer" not in timers
    assert timers.format(["forward", "backward"]) == "time (ms) | backward: 10.00"


def test_misuse_raises():
    timer = Timer("x")
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()
    timer.start()
    with pytest.raises(RuntimeError, match="started twice"):
        timer.start()
    with pytest.raises(ValueError, match="normalizer"):
        Timers().elapsed_ms(normalizer=0)


def test_real_clock_and_no_sync_on_cpu():
    import torch

    if not torch.cuda.is_available():
        assert cuda_synchronizer(True) is None
    assert cuda_synchronizer(False) is None
    timers = Timers()
    timers("sleep").start()
    time.sleep(0.02)
    timers("sleep").stop()
    assert 15.0 < timers.elapsed_ms()["sleep"] < 1000.0


def test_disabled_timers_record_nothing():
    clock = FakeClock()
    timers = Timers(enabled=False, clock=clock)
    timers("forward").start()
    timers("forward").start()  # no misuse error either: nothing is recorded
    clock.now = 5.0
    timers("forward").stop()
    assert timers.elapsed_ms() == {} and timers.format() == ""
    assert timers("forward").elapsed() == 0.0
