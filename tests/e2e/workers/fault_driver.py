"""The fault suite's driver: a 2-rank training job killed (SIGKILL, whole job) at 20 moments chosen at random,
then resumed each time, against the same job run straight through; and one rank killed alone.

    python tests/e2e/workers/fault_driver.py CONFIG.yml OUT_DIR SEED

Kill points: mid-save (DeepSpeed's files written, the save unfinished), between COMPLETE and `latest`,
mid-evaluation (after its first batch), and at a random time (startup, loading, a step, anything). Rank 0 stops at an
armed point and says so; the driver then kills both ranks. The ranks are forked from this process, which imports
torch, DeepSpeed and the project once, so each of the ~20 segments starts in a second or two instead of the ~15 s
of a deepy.py launch. Writes OUT_DIR/summary.json: the counts the test checks and prints."""

import json
import os
import random
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)

from tests.accelerator import deepspeed_accelerator_env  # noqa: E402

os.environ.update(deepspeed_accelerator_env())
import megatron.checkpoint.async_save as async_checkpoint  # noqa: E402
import megatron.checkpoint.engine as checkpointing  # noqa: E402
import megatron.checkpoint.format as checkpoint_format  # noqa: E402
import megatron.training.loop as training  # noqa: E402
from megatron.checkpoint.integrity import verification_problems  # noqa: E402
from megatron.launch.signals import interrupted_exit_code  # noqa: E402,F401 (imported before forking)
from megatron.neox_arguments import NeoXArgs  # noqa: E402
from megatron.neox_arguments.launcher import ENCODED_CONFIG_ENV  # noqa: E402
from tests.e2e.launch import free_port  # noqa: E402

import deepspeed.runtime.engine  # noqa: E402,F401  (everything a segment would import, imported once here)
import torch._dynamo  # noqa: E402,F401  (torch's optimizers import it on construction)
import torch.distributed.fsdp  # noqa: E402,F401  (deepspeed.comm's initialisation imports it)
import megatron.data.data_utils  # noqa: E402,F401
import megatron.observability.training_logger  # noqa: E402,F401
import megatron.model  # noqa: E402,F401
import megatron.optim.optimizers  # noqa: E402,F401
import train  # noqa: E402,F401
from megatron.utils.lazy_compile import DEEPSPEED_MUON, import_with_lazy_compile  # noqa: E402

import_with_lazy_compile(DEEPSPEED_MUON)

KILLS = 20
POINTS = ("save", "latest", "eval", "time")
ASYNC_POINTS = POINTS + ("write",)
"""Half the segments save with async_save; "write" kills those while rank 0's writer thread writes a file."""


class Armed:
    """The point rank 0 stops at in this segment (set in the child before training)."""

    point: Optional[Tuple[str, int]] = None
    hit_file: str = ""
    saving: int = -1


def _stop_here(point: str, iteration: int) -> None:
    if os.environ.get("RANK") == "0" and Armed.point == (point, iteration):
        with open(Armed.hit_file, "w") as handle:
            handle.write(f"{point} {iteration}\n")
        time.sleep(3600)  # killed here


def _install_hooks() -> None:
    original_save, original_rng, original_write = (training.save_checkpoint, checkpointing._rng_states,
                                                   checkpointing._write_atomically)
    original_evaluate = training.evaluate

    def save(neox_args, model_config, iteration, engine, *args, **kwargs):
        Armed.saving = iteration
        return original_save(neox_args, model_config, iteration, engine, *args, **kwargs)

    def rng_states(*args):  # called after DeepSpeed has written its files: the save is half done
        _stop_here("save", Armed.saving)
        return original_rng(*args)

    def write_atomically(path, text):
        if os.path.basename(path) == checkpoint_format.LATEST_FILE:  # COMPLETE is written, `latest` not yet
            _stop_here("latest", Armed.saving)
        return original_write(path, text)

    class StopAfterFirstBatch:
        def __init__(self, batches, iteration):
            self.batches, self.iteration, self.drawn = batches, iteration, 0

        def __getattr__(self, name):
            return getattr(self.batches, name)

        def __iter__(self):
            return self

        def __next__(self):
            if self.drawn == 1:
                _stop_here("eval", self.iteration)
            self.drawn += 1
            return next(self.batches)

    original_submit = async_checkpoint.BackgroundWriter.submit

    def submit(writer, job):
        saving = Armed.saving

        def armed_job():
            _stop_here("write", saving)  # in the writer thread: training goes on until the kill
            job()

        return original_submit(writer, armed_job)

    async_checkpoint.BackgroundWriter.submit = submit

    def evaluate(neox_args, engine, batches, iterations):
        iteration = int(getattr(engine, "global_steps", 0))
        return original_evaluate(neox_args, engine, StopAfterFirstBatch(batches, iteration) if batches else batches,
                                 iterations)

    training.save_checkpoint, checkpointing._rng_states, checkpointing._write_atomically = (
        save, rng_states, write_atomically)
    training.evaluate = evaluate


def _child(rank: int, args: NeoXArgs, port: int, out_dir: str, armed: Optional[Tuple[str, int]], tag: str) -> None:
    log = os.open(os.path.join(out_dir, f"{tag}.rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), ENCODED_CONFIG_ENV: args.encode()})
    Armed.point, Armed.hit_file = armed, os.path.join(out_dir, "hit")
    sys.argv = ["train.py"]
    code = 1
    try:
        code = train.main()
    except BaseException:  # noqa: BLE001 (a traceback is what the log should show)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Segment:
    """The two ranks of one launch, forked; `poll` reaps them."""

    def __init__(self, args: NeoXArgs, out_dir: str, armed: Optional[Tuple[str, int]], tag: str) -> None:
        port = free_port()
        self.pids: List[int] = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                _child(rank, args, port, out_dir, armed, tag)
            self.pids.append(pid)
        self.codes: Dict[int, Optional[int]] = {pid: None for pid in self.pids}

    def poll(self) -> List[Optional[int]]:
        """Exit statuses (None: still running)."""
        for pid in self.pids:
            if self.codes[pid] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    self.codes[pid] = os.waitstatus_to_exitcode(status)
        return [self.codes[pid] for pid in self.pids]

    def running(self) -> bool:
        return None in self.poll()

    def wait(self, timeout: float) -> List[Optional[int]]:
        deadline = time.time() + timeout
        while self.running() and time.time() < deadline:
            time.sleep(0.05)
        return self.poll()

    def kill(self, ranks: Tuple[int, ...] = (0, 1)) -> None:
        for rank in ranks:
            if self.codes[self.pids[rank]] is None:
                try:
                    os.kill(self.pids[rank], signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _newest_complete(save: str) -> int:
    tags = checkpoint_format.complete_tags(save)
    return checkpoint_format.tag_iteration(tags[-1]) if tags else 0


def _records(log_dir: str, kind: str) -> List[Dict[str, Any]]:
    path = os.path.join(log_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as handle:
        return [r for r in map(json.loads, filter(str.strip, handle)) if r.get("type") == kind]


def _run_to_end(args: NeoXArgs, out_dir: str, tag: str) -> List[Optional[int]]:
    return Segment(args, out_dir, None, tag).wait(600)


def _args(config_file: str, **values: Any) -> NeoXArgs:
    return NeoXArgs.from_ymls([config_file], overwrite_values={"user_script": "train.py", **values})


def main() -> int:
    config_file, out_dir, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    base = _args(config_file)
    train_iters, eval_interval = base.train_iters, base.eval_interval
    _install_hooks()
    summary: Dict[str, Any] = {"seed": seed, "kills": {p: 0 for p in ASYNC_POINTS}, "async_kills": 0,
                               "checkpoints_lost": 0, "damaged_checkpoints": 0, "segment_failures": []}

    straight_dir = os.path.join(out_dir, "straight")
    straight = _args(config_file, save=os.path.join(straight_dir, "ckpt"), load=os.path.join(straight_dir, "ckpt"),
                     log_dir=os.path.join(straight_dir, "logs"))
    summary["straight_exit"] = _run_to_end(straight, out_dir, "straight")

    faulty_dir = os.path.join(out_dir, "faulty")
    save = os.path.join(faulty_dir, "ckpt")
    faulty = _args(config_file, save=save, load=save, log_dir=os.path.join(faulty_dir, "logs"))
    faulty_async = _args(config_file, save=save, load=save, log_dir=os.path.join(faulty_dir, "logs"), async_save=True)
    hit = os.path.join(out_dir, "hit")
    for kill in range(KILLS):
        resume = _newest_complete(save)
        room = resume + 2 < train_iters  # near the end, only kills that do not move the run forward
        in_background = kill % 2 == 1
        points = ASYNC_POINTS if in_background else POINTS
        point = rng.choice(points if room else ("save", "eval"))
        iteration = (resume // eval_interval + 1) * eval_interval
        if point == "eval" and iteration > min(resume + 2, train_iters):
            point = "save"
        if point != "eval":
            iteration = rng.randint(resume + 1, resume + 2) if room else resume + 1
        if os.path.exists(hit):
            os.remove(hit)
        # a kill at a random time: at the latest mid-save of the iteration chosen
        segment = Segment(faulty_async if in_background else faulty, out_dir,
                          (point if point != "time" else "save", iteration), f"kill{kill:02d}")
        deadline = time.time() + (rng.uniform(0.1, 2.5) if point == "time" else 300)
        while time.time() < deadline and not os.path.exists(hit) and segment.running():
            time.sleep(0.02)
        codes = segment.poll()
        segment.kill()
        segment.wait(60)
        if None not in codes:  # it ended before the kill
            summary["segment_failures"].append({"kill": kill, "point": point, "exit": codes})
        summary["kills"][point] += 1
        summary["async_kills"] += in_background
        after = _newest_complete(save)
        if after < resume:
            summary["checkpoints_lost"] += 1
        if after and verification_problems(os.path.join(save, checkpoint_format.tag_for(after))):
            summary["damaged_checkpoints"] += 1
    summary["final_exit"] = _run_to_end(faulty, out_dir, "final")
    summary["final_latest"] = checkpoint_format.read_latest(save)

    for kind, key in (("train", "train_mismatches"), ("eval", "eval_mismatches")):
        expected = {(r["iteration"], r.get("split")): r["lm_loss"] for r in _records(straight.log_dir, kind)}
        seen = _records(faulty.log_dir, kind)
        summary[f"{kind}_records"] = len(seen)
        summary[key] = [r for r in seen if expected.get((r["iteration"], r.get("split"))) != r["lm_loss"]]
        summary[f"{kind}_iterations_covered"] = len({(r["iteration"], r.get("split")) for r in seen}) == len(expected)

    # one rank dies, or hangs: the other must stop with a clear error, at once / after distributed_timeout_minutes
    for case, timeout_minutes in (("death", 10.0), ("hang", 0.15)):
        lost = _args(config_file, save=None, load=None, log_dir=os.path.join(out_dir, case, "logs"),
                     train_iters=100000, distributed_timeout_minutes=timeout_minutes)
        segment = Segment(lost, out_dir, None, case)
        deadline = time.time() + 300
        while time.time() < deadline and len(_records(lost.log_dir, "train")) < 2 and segment.running():
            time.sleep(0.1)
        os.kill(segment.pids[1], signal.SIGKILL if case == "death" else signal.SIGSTOP)
        stopped = time.time()
        while segment.poll()[0] is None and time.time() < stopped + 300:  # the survivor
            time.sleep(0.05)
        codes = segment.poll()
        with open(os.path.join(out_dir, f"{case}.rank0.log")) as handle:
            errors = [line.strip() for line in handle if line.startswith("error:")]
        summary[f"rank_{case}"] = {"survivor_exit": codes[0], "seconds": round(time.time() - stopped, 1),
                                   "timeout_seconds": timeout_minutes * 60, "survivor_error": errors}
        segment.kill()
        if case == "hang":
            os.kill(segment.pids[1], signal.SIGCONT)
        segment.wait(60)

    with open(os.path.join(out_dir, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
