"""Run a function in N gloo processes on 127.0.0.1 and report every rank's failure.

Usage from a test::

    from tests.distributed_helpers import run_distributed

    def _body(rank: int, world_size: int, x: int) -> float:   # module-level, so it pickles
        ...
        return value

    results = run_distributed(_body, world_size=2, args=(3,))   # one return value per rank

Each worker gets a fresh ``spawn`` interpreter with OMP_NUM_THREADS=1, DeepSpeed's CPU accelerator only where
there is no CUDA (tests.accelerator) and the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables, joins a
gloo world on a free port, runs the function, then barriers and destroys the world (a worker exiting right after a
collective can abort otherwise). Failures and hangs raise AssertionError with the traceback of every failing rank.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Sequence

import torch.multiprocessing as mp

_DEFAULT_TIMEOUT_S = 240.0


from tests.accelerator import deepspeed_accelerator_env  # noqa: E402
from tests.e2e.launch import free_port  # noqa: E402  (one way to pick a port, see its docstring)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: "mp.Queue",
    backend: str = "gloo",
) -> None:
    os.environ.update(
        {
            "OMP_NUM_THREADS": "1",
            **deepspeed_accelerator_env(),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        value = fn(rank, world_size, *args)
        # a CUDA-only world ("cuda:gloo") has no barrier on a machine without CUDA: a gloo group's
        dist.barrier(group=None if backend == "gloo" else dist.new_group(backend="gloo"))
        # Plain pickle copies tensors by value; torch's queue pickler would share them through file
        # descriptors that vanish when this worker exits.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report everything, including KeyboardInterrupt in a worker
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout_s: float = _DEFAULT_TIMEOUT_S,
    backend: str = "gloo",
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` and ``args`` must pickle (define ``fn`` at module level). Return values must pickle too. ``backend``:
    the default group's; "cuda:gloo" makes it serve CUDA tensors only, as NCCL does (a CPU tensor handed to it
    raises "No backend type associated with device type cpu").
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world_size, port, fn, tuple(args), results, backend),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict = {}
    deadline_hit = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    deadline_hit = True
                    break
                if not any(proc.is_alive() for proc in procs) and results.empty():
                    break  # every worker died without reporting (e.g. a segfault)
                continue
            outcomes[rank] = (ok, pickle.loads(value) if ok else value)
            if not ok:
                # Peers of a failed rank usually block in a collective; give them a short grace.
                deadline = min(deadline, time.monotonic() + 30.0)
    finally:
        for proc in procs:
            proc.join(timeout=10)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
    failures = [f"--- rank {r} failed ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        failures.append(
            f"--- ranks {missing} reported nothing (exit codes {codes}{', timed out' if deadline_hit else ''}) ---"
        )
    if failures:
        raise AssertionError("distributed run failed:\n" + "\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]
