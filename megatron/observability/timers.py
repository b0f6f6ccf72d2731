"""Named wall-clock timers for the training loop (`wall_clock_breakdown`).

CUDA kernels run asynchronously, so a timer that should measure GPU work must synchronise the device
before reading the clock; on CPU there is nothing to wait for, so the timers only synchronise when
they were asked to and CUDA is really there.

With `Timers(enabled=False)` (wall_clock_breakdown off) timers record nothing and never synchronise, so
the loop can keep its timer calls without paying for them; elapsed_ms() then reports nothing.

Usage::

    timers = Timers()
    timers("forward").start(); ...; timers("forward").stop()
    timers.elapsed_ms(["forward", "backward"])   # {"forward": 12.3, "backward": 25.1}, and resets them
"""

import time
from typing import Callable, Dict, Iterable, List, Optional

import torch


def cuda_synchronizer(enabled: bool = True) -> Optional[Callable[[], None]]:
    """torch.cuda.synchronize when `enabled` and CUDA is available, else None (no waiting on CPU)."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.synchronize
    return None


class Timer:
    """One named stopwatch that accumulates time over start/stop pairs until it is reset."""

    def __init__(self, name: str, synchronize: Optional[Callable[[], None]] = None,
                 clock: Callable[[], float] = time.perf_counter, enabled: bool = True) -> None:
        self.name = name
        self.enabled = enabled
        self._synchronize = synchronize
        self._clock = clock
        self._accumulated = 0.0
        self._started_at: Optional[float] = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def _now(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()

    def start(self) -> None:
        if not self.enabled:
            return
        if self.running:
            raise RuntimeError(f"timer '{self.name}' was started twice without stop()")
        self._started_at = self._now()

    def stop(self) -> None:
        if not self.enabled:
            return
        if self._started_at is None:
            raise RuntimeError(f"timer '{self.name}' was stopped without start()")
        self._accumulated += self._now() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        self._accumulated = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (including a running interval); optionally reset to zero.

        A running timer keeps running: its interval up to now is counted and, if reset, restarts now."""
        was_running = self.running
        if was_running:
            self.stop()
        seconds = self._accumulated
        if reset:
            self.reset()
        if was_running:
            self.start()
        return seconds


class Timers:
    """A registry of named timers, created on first use (`timers("name")`)."""

    def __init__(self, enabled: bool = True, synchronize_cuda: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled = enabled
        self._synchronize = cuda_synchronizer(synchronize_cuda and enabled)
        self._clock = clock
        self._timers: Dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(name, self._synchronize, self._clock, self.enabled)
        return self._timers[name]

    def __contains__(self, name: str) -> bool:
        return name in self._timers

    @property
    def names(self) -> List[str]:
        return list(self._timers)

    def elapsed_ms(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0,
                   reset: bool = True) -> Dict[str, float]:
        """{name: milliseconds / normalizer} for the given timers (default: all that exist).

        `normalizer` is typically the number of iterations since the last report, to give per-iteration
        times. Names never started are skipped, so the loop can ask for a fixed list."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        if not self.enabled:
            return {}
        wanted = self.names if names is None else [n for n in names if n in self._timers]
        return {name: self._timers[name].elapsed(reset=reset) * 1000.0 / normalizer for name in wanted}

    def format(self, names: Optional[Iterable[str]] = None, normalizer: float = 1.0, reset: bool = True) -> str:
        """One console line: 'time (ms) | forward: 12.30 | backward: 25.10'."""
        if not self.enabled:
            return ""
        times = self.elapsed_ms(names, normalizer, reset)
        return "time (ms)" + "".join(f" | {name}: {ms:.2f}" for name, ms in times.items())
