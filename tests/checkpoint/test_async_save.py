"""async_save (megatron.checkpoint.async_save): the state is copied at the save, so later steps cannot change what is
written; the files are written on a thread; the checkpoint is completed (checksums, COMPLETE, latest) only after
every file is written, and a failed write is an error that leaves `latest` where it was. Killed mid-write on
two ranks, resumed exactly: the fault suite (tests/e2e/test_fault_suite.py) kills half its segments with
async_save, some while rank 0's writer is writing."""
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from megatron.checkpoint.async_save import (DONE, FAILED, PACE_SHARE, WRITER_NICENESS, WRITING, ArenaPool,
                                      AsyncCheckpoints, BackgroundWriter, WritePacer, snapshot)
from megatron.errors import CheckpointError
from megatron.checkpoint.engine import complete_checkpoint, failed_save
from megatron.checkpoint.format import COMPLETE_MARKER, LATEST_FILE, complete_tags, read_latest
from megatron.checkpoint import async_save as async_checkpoint, integrity as checkpoint_integrity
from megatron.checkpoint.integrity import read_manifest, verification_problems
from megatron.checkpoint.hashed_save import BLOCK, new_digest


def xxh128(data: bytes) -> str:
    digest = new_digest()
    digest.update(data)
    return digest.hexdigest()


class Inner:
    """Stands for DeepSpeed's TorchCheckpointEngine (loading and directories are still its)."""

    def create(self, info):
        pass

    def makedirs(self, path, exist_ok=False):
        os.makedirs(path, exist_ok=exist_ok)

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)

    def is_data_parallel_writer(self, dp_rank):
        return dp_rank == 0


class Engine:
    def __init__(self):
        self.checkpoint_engine = Inner()


def test_the_snapshot_is_not_changed_by_later_steps_and_copies_each_tensor_once():
    weight = torch.arange(6.0).reshape(2, 3)
    flat = torch.zeros(10)
    state = {"module": {"w": weight, "tied": weight}, "optimizer": [{"step": 3, "buffer": flat[2:5]}], "lr": 0.1}
    arenas = ArenaPool()
    copied, arena = snapshot(state, arenas)
    weight.add_(100.0)  # the next optimizer step, in place
    flat.fill_(7.0)
    assert torch.equal(copied["module"]["w"], torch.arange(6.0).reshape(2, 3))
    assert copied["module"]["w"] is copied["module"]["tied"]  # one tensor met twice stays one
    assert torch.equal(copied["optimizer"][0]["buffer"], torch.zeros(3))
    assert copied["optimizer"][0]["buffer"].untyped_storage().nbytes() == 3 * 4  # the view alone, not the buffer
    assert copied["optimizer"][0]["step"] == 3 and copied["lr"] == 0.1
    for tensor in (copied["module"]["w"], copied["optimizer"][0]["buffer"]):  # where O_DIRECT writes from
        assert tensor.data_ptr() % BLOCK == 0
    leaf = torch.ones(2, requires_grad=True)
    assert not snapshot({"x": leaf * 2}, arenas)[0]["x"].requires_grad  # non-leaf tensors (flat buffers' views) too
    odd = {"empty": torch.zeros(0), "complex": torch.ones(2, dtype=torch.complex64), "bf16": torch.ones(3).bfloat16()}
    again = snapshot(odd, arenas)[0]  # what cannot lie in the block is copied the ordinary way
    assert all(torch.equal(again[key], value) and again[key].dtype == value.dtype for key, value in odd.items())


def test_a_written_snapshots_block_is_taken_again_by_the_next_save_and_one_in_use_is_not():
    arenas = ArenaPool()
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    first, block = snapshot(state, arenas)
    second, other = snapshot(state, arenas)  # the first is still being written
    assert other is not block and first["w"].data_ptr() != second["w"].data_ptr()
    arenas.give_back(block)
    third, again = snapshot({"w": torch.ones(1000), "b": torch.ones(10)}, arenas)
    assert again is block and torch.equal(third["w"], torch.ones(1000))
    assert torch.equal(second["w"], state["w"])  # the block still in use was left alone


def test_the_pacer_spreads_the_queued_bytes_over_the_time_given_and_hurry_lifts_it():
    pacer = WritePacer()
    pacer.wrote(1 << 20)  # nothing set: no wait
    pacer.queue(4 << 20)
    pacer.spread(0.4)
    start = time.monotonic()
    for _ in range(4):
        pacer.wrote(1 << 20)
    assert 0.3 < time.monotonic() - start < 2.0
    pacer.queue(100 << 20)
    pacer.spread(1000.0)  # a rate that would take minutes...
    threading.Timer(0.2, pacer.hurry).start()  # ...until a save waits for it
    start = time.monotonic()
    pacer.wrote(50 << 20)
    pacer.wrote(50 << 20)
    assert time.monotonic() - start < 5.0


def test_a_save_spreads_its_writes_over_the_steps_to_the_next_one(monkeypatch):
    saves = AsyncCheckpoints(Engine(), complete=lambda *a: None, failure=failed_save)
    spread = []
    monkeypatch.setattr(saves.writer.pacer, "spread", spread.append)
    saves.started("unused", 1, steps_ahead=4)
    assert spread == []  # no step timed yet: as fast as the disk takes them
    saves.pending = None
    clock = iter([10.0, 12.0, 14.5, 16.5])  # steps of 2.0, 2.5 and 2.0 s
    monkeypatch.setattr(async_checkpoint, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    for _ in range(4):
        saves.poll()
    assert saves.step_seconds() == 2.0
    saves.started("unused", 4, steps_ahead=5)
    assert spread == [pytest.approx(PACE_SHARE * 5 * 2.0)]
    saves.started("unused", 4, steps_ahead=None)  # no later save nor end: not paced
    assert len(spread) == 1


def test_files_are_written_on_the_writer_thread_and_errors_are_reported(tmp_path):
    writer = BackgroundWriter(Inner())
    release = threading.Event()
    writer.submit(release.wait)
    writer.save({"w": torch.ones(3)}, str(tmp_path / "a.pt"))
    assert writer.status() == WRITING and not (tmp_path / "a.pt").exists()
    release.set()
    writer.wait()
    assert writer.status() == DONE
    assert torch.equal(writer.load(str(tmp_path / "a.pt"))["w"], torch.ones(3))
    writer.save({"w": torch.ones(3)}, str(tmp_path / "missing" / "b.pt"))
    writer.wait()
    assert writer.status() == FAILED and isinstance(writer.take_error(), (OSError, RuntimeError))
    assert writer.status() == DONE


@pytest.mark.skipif(not hasattr(os, "getpriority") or not os.path.isdir("/proc/self/task"),
                    reason="per-thread priorities are Linux's")
def test_the_writer_thread_runs_at_a_low_priority_and_the_training_thread_keeps_its_own():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = BackgroundWriter(Inner())
    seen = []
    writer.submit(lambda: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    writer.wait()
    assert len(seen) == 1 and seen[0] >= WRITER_NICENESS > 0
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def _save(saves: AsyncCheckpoints, save_dir, iteration: int, value: float) -> str:
    """What megatron.checkpoint.engine.save_checkpoint(complete=False) does with the engine's writer."""
    path = os.path.join(save_dir, f"global_step{iteration}")
    os.makedirs(path)
    saves.writer.save({"w": torch.full((4,), value)}, os.path.join(path, "mp_rank_00_model_states.pt"))
    saves.started(path, iteration)
    return path


def test_the_checkpoint_is_complete_and_latest_moves_only_after_the_writes(tmp_path):
    engine = Engine()
    saves = AsyncCheckpoints(engine, failure=failed_save,
                             complete=lambda path, it, digests: complete_checkpoint(path, it, 2, digests=digests))
    assert engine.checkpoint_engine is saves.writer
    gate = threading.Event()
    saves.writer.submit(gate.wait)  # a slow disk: nothing gets written until the gate opens
    path = _save(saves, tmp_path, 2, 1.0)
    assert not saves.poll()  # still writing: the step goes on, nothing is complete
    assert not os.path.exists(os.path.join(path, COMPLETE_MARKER)) and read_latest(str(tmp_path)) is None
    assert complete_tags(str(tmp_path)) == []  # what a kill now would leave: no checkpoint a resume would load
    gate.set()
    saves.writer.wait()
    assert saves.poll()  # every file written: completed on the writer thread
    saves.wait()
    assert read_latest(str(tmp_path)) == "global_step2" and verification_problems(path) == []
    for iteration in (4, 6):  # a save while one is in flight waits for it; keep_last_n_checkpoints prunes
        saves.wait()
        _save(saves, tmp_path, iteration, float(iteration))
    saves.wait()
    assert complete_tags(str(tmp_path)) == ["global_step4", "global_step6"]
    assert read_latest(str(tmp_path)) == "global_step6"
    saved = torch.load(tmp_path / "global_step6" / "mp_rank_00_model_states.pt", weights_only=True)
    assert torch.equal(saved["w"], torch.full((4,), 6.0))


def test_a_failed_background_write_is_an_error_and_latest_stays(tmp_path):
    saves = AsyncCheckpoints(Engine(),
                             complete=lambda path, it, digests: complete_checkpoint(path, it, None, digests=digests),
                             failure=failed_save)
    _save(saves, tmp_path, 2, 1.0)
    saves.wait()
    path = os.path.join(tmp_path, "global_step4")
    os.makedirs(path)

    def disk_full():
        raise OSError(28, "No space left on device")

    saves.writer.submit(disk_full)
    saves.started(path, 4)
    with pytest.raises(CheckpointError, match="global_step4 failed.*global_step2.*will be resumed from"):
        saves.wait()
    assert not os.path.exists(path) and open(os.path.join(tmp_path, LATEST_FILE)).read() == "global_step2"


def test_the_writers_digests_are_the_manifests_and_a_byte_damaged_before_completion_is_caught(tmp_path, monkeypatch):
    """The large files are hashed as they are written, not read back; so damage between the write and the
    checksums (which reading back would have recorded as the truth) is caught at load, as damage after it is."""
    read_back = []
    digest = checkpoint_integrity.file_digest
    monkeypatch.setattr(checkpoint_integrity, "file_digest",
                        lambda file, *how: read_back.append(file) or digest(file, *how))
    saves = AsyncCheckpoints(Engine(), failure=failed_save,
                             complete=lambda path, it, digests: complete_checkpoint(path, it, None, digests=digests))
    path = _save(saves, tmp_path, 2, 1.0)
    with open(os.path.join(path, "rng_state_rank0.pt"), "wb") as handle:  # written outside the writer: read back
        handle.write(b"rng")
    saves.wait()
    model = os.path.join(path, "mp_rank_00_model_states.pt")
    with open(model, "rb") as handle:
        intact = handle.read()
    assert read_manifest(path) == {"mp_rank_00_model_states.pt": xxh128(intact), "rng_state_rank0.pt": xxh128(b"rng")}
    assert read_back == [os.path.join(path, "rng_state_rank0.pt")]
    assert verification_problems(path) == []

    path = _save(saves, tmp_path, 4, 2.0)
    saves.writer.wait()
    model = os.path.join(path, "mp_rank_00_model_states.pt")
    with open(model, "r+b") as handle:  # one byte of the weights damaged on the disk before the checksums
        handle.seek(os.path.getsize(model) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    assert torch.load(model, weights_only=True)["w"].shape == (4,)  # still loads: torch checks no checksum
    saves.wait()
    assert read_latest(str(tmp_path)) == "global_step4"
    assert verification_problems(path) == ["mp_rank_00_model_states.pt is damaged (its XXH3-128 differs from the one "
                                           "recorded when it was saved)"]


def test_the_writes_are_spread_over_the_steps_to_the_next_save_of_any_kind_or_the_end():
    from megatron.training.loop import steps_to_next_save

    schedule = SimpleNamespace(save_iters=(4, 8), train_iters=10)
    plain = SimpleNamespace(non_persistent_save_interval=None, exit_interval=None)
    assert [steps_to_next_save(plain, schedule, at) for at in (4, 8, 10)] == [4, 2, None]
    often = SimpleNamespace(non_persistent_save_interval=3, exit_interval=None)
    assert steps_to_next_save(often, schedule, 4) == 2  # the non-persistent save at 6
    leaving = SimpleNamespace(non_persistent_save_interval=None, exit_interval=5)
    assert steps_to_next_save(leaving, schedule, 4) == 1  # the run exits at 5 (and waits for the write)


class DeepSpeedLike(Engine):
    """Writes its model file as DeepSpeed's engine does: the state with the client state, through its checkpoint
    engine (async_save's writer, once AsyncCheckpoints has taken it)."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        self.checkpoint_engine.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        self.checkpoint_engine.save({"module": {"w": torch.ones(4)}, **client_state},
                                    os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))


def test_an_async_checkpoint_loads_with_weights_only(tmp_path):
    """save_checkpoint with async_save's writer: its model-state and RNG files load with weights_only=True (and the
    model file with a plain torch.load, as GPT-NeoX's converter reads it)."""
    from megatron.checkpoint.engine import save_checkpoint
    from megatron.model.config import ModelConfig
    from tests.checkpoint.weights_only import assert_loads_weights_only
    from tests.neox_arguments.helpers import tiny

    args = tiny(save=str(tmp_path), load=str(tmp_path))
    engine = DeepSpeedLike()
    saves = AsyncCheckpoints(engine, failure=failed_save,
                             complete=lambda path, it, digests: complete_checkpoint(path, it, None, digests=digests))
    path = save_checkpoint(args, ModelConfig.from_neox_args(args, padded_vocab_size=128), 3, engine, complete=False)
    saves.started(path, 3)
    saves.wait()
    assert read_latest(str(tmp_path)) == "global_step3" and verification_problems(path) == []
    assert assert_loads_weights_only(path) == ["mp_rank_00_model_states.pt", "rng_state_rank0.pt"]


def _two_ranks_finish_at_different_times(rank: int, world_size: int, save_dir: str) -> dict:
    """Rank 1's disk is slow: its file is written only after rank 0 has polled twice. What rank 0 sees after each
    poll (collective: both ranks poll at the same points)."""
    import torch.distributed as dist

    saves = AsyncCheckpoints(Engine(), failure=failed_save,
                             complete=lambda path, it, digests: complete_checkpoint(path, it, None, digests=digests))
    path = os.path.join(save_dir, "global_step2")
    if rank == 0:
        os.makedirs(path)
    dist.barrier()
    gate = threading.Event()
    if rank == 1:
        saves.writer.submit(gate.wait)  # rank 1's writes wait behind this
    saves.writer.save({"w": torch.full((4,), float(rank))}, os.path.join(path, f"mp_rank_0{rank}_model_states.pt"))
    saves.started(path, 2)
    if rank == 0:
        saves.writer.wait()  # rank 0's file is on disk before the first poll
    seen = []
    for _ in range(2):
        completed = saves.poll()
        if rank == 0:
            saves.writer.wait()  # its completion job, if one was queued, has run
        dist.barrier()
        seen.append({"completed": completed, "complete": os.path.exists(os.path.join(path, COMPLETE_MARKER)),
                     "latest": read_latest(save_dir), "rank1_file": os.path.exists(
                         os.path.join(path, "mp_rank_01_model_states.pt"))})
        dist.barrier()
    gate.set()
    saves.wait()
    dist.barrier()
    seen.append({"complete": os.path.exists(os.path.join(path, COMPLETE_MARKER)), "latest": read_latest(save_dir),
                 "rank1_file": os.path.exists(os.path.join(path, "mp_rank_01_model_states.pt"))})
    return {"seen": seen}


@pytest.mark.slow
@pytest.mark.fault
def test_two_ranks_finishing_their_writes_at_different_times_complete_only_after_both(tmp_path):
    """The ranks agree on completion with MIN over their writers' status (FAILED < WRITING < DONE): while rank 1 is
    still writing, rank 0 (done) must not write COMPLETE or move `latest` (issue 32's missed bug: MAX completed the
    checkpoint before rank 1's file existed)."""
    from tests.distributed_helpers import run_distributed

    results = run_distributed(_two_ranks_finish_at_different_times, world_size=2, args=(str(tmp_path),))
    seen = results[0]["seen"]
    while_writing = {"completed": False, "complete": False, "latest": None, "rank1_file": False}
    assert seen[:2] == [while_writing, while_writing], seen
    assert seen[2] == {"complete": True, "latest": "global_step2", "rank1_file": True}, seen
    assert sorted(read_manifest(str(tmp_path / "global_step2"))) == ["mp_rank_00_model_states.pt",
                                                                     "mp_rank_01_model_states.pt"]
