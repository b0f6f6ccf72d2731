"""Non-persistent checkpoints (non_persistent_ckpt_type 'global'): saved atomically into their own directory,
which keeps only the newest; resumed from when newer than the persistent checkpoint; the loop saves them every
non_persistent_save_interval iterations that are not persistent saves. A stand-in engine (tests.checkpoint.test_engine)
records what DeepSpeed would be asked to do."""

import os

import pytest

from megatron.checkpoint.engine import save_checkpoint
from megatron.checkpoint.format import complete_tags, read_latest
from megatron.checkpoint.non_persistent import MARKER, in_non_persistent_dir, non_persistent_dir, non_persistent_due
from tests.neox_arguments.helpers import problems_of, tiny
from tests.checkpoint.test_engine import FakeEngine, _model, args_for, load, resolve, save


def _save_transient(args, iteration, engine):
    return save_checkpoint(args, _model(args), iteration, engine, {"consumed_train_samples": iteration},
                           non_persistent=True)


def test_saved_apart_atomically_keeping_only_the_newest_and_resumed_when_newer(tmp_path, capsys):
    args = args_for(tmp_path, non_persistent_ckpt_type="global", non_persistent_save_interval=2)
    transient = non_persistent_dir(args)
    assert transient == os.path.join(str(tmp_path), "non_persistent")
    engine = FakeEngine()
    save(args, 4, engine)
    os.makedirs(os.path.join(transient, "global_step5"))  # a non-persistent save that died before COMPLETE
    for it in (6, 8):
        path = _save_transient(args, it, engine)
        assert os.path.isfile(os.path.join(path, "COMPLETE")) and os.path.isfile(os.path.join(path, "checksums.xxh128"))
    assert sorted(os.listdir(transient)) == [MARKER, "global_step8", "latest"]  # only the newest, no leftovers
    assert in_non_persistent_dir(args, path) and not in_non_persistent_dir(args, str(tmp_path / "global_step4"))
    assert (read_latest(str(tmp_path)), complete_tags(str(tmp_path))) == ("global_step4", ["global_step4"])
    assert resolve(args) == (transient, "global_step8")
    assert "resuming from the non-persistent checkpoint" in capsys.readouterr().out
    loading = FakeEngine()
    iteration, state, path = load(args, loading)
    assert (iteration, state["consumed_train_samples"], path) == (8, 8, os.path.join(transient, "global_step8"))
    save(args, 10, engine)  # a newer persistent checkpoint wins
    assert resolve(args) == (str(tmp_path), "global_step10")
    assert resolve(args_for(tmp_path, non_persistent_ckpt_type="global", iteration=4)) == (str(tmp_path),
                                                                                          "global_step4")
    assert resolve(args_for(tmp_path)) == (str(tmp_path), "global_step10")  # not configured: not read
    _save_transient(args, 12, engine)
    elsewhere = tiny(load=str(tmp_path), save=str(tmp_path / "next"), config_files={"model.yml": "{num_layers: 2}"},
                     non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=transient)
    assert resolve(elsewhere) == (transient, "global_step12")  # an explicit directory, another save


def test_due_every_interval_except_at_persistent_saves():
    args = tiny(save="/ckpt", non_persistent_ckpt_type="global", non_persistent_save_interval=3)
    assert [it for it in range(1, 13) if non_persistent_due(args, it, (6, 10))] == [3, 9, 12]
    assert not any(non_persistent_due(tiny(save="/ckpt"), it, ()) for it in range(1, 5))


def test_local_and_in_memory_are_refused_and_the_keys_go_together():
    assert "non_persistent_ckpt_type='local' is not supported yet (Megatron-LM marks it TBD too)" in \
        problems_of(non_persistent_ckpt_type="local")
    assert "'in_memory' is not supported yet" in problems_of(non_persistent_ckpt_type="in_memory")
    assert "non_persistent_save_interval=5 needs non_persistent_ckpt_type: global" in \
        problems_of(save="/ckpt", non_persistent_save_interval=5)
    assert "non_persistent_save_interval=0 must be >= 1" in \
        problems_of(save="/ckpt", non_persistent_ckpt_type="global", non_persistent_save_interval=0)
    assert "needs save" in problems_of(non_persistent_ckpt_type="global", non_persistent_save_interval=5)
    assert "is the save / load directory" in problems_of(save="/ckpt", non_persistent_ckpt_type="global",
                                                         non_persistent_global_ckpt_dir="/ckpt/")


@pytest.mark.attack("non_persistent_global_ckpt_dir pointing at another run's save directory (its lock held or "
                    "not) or at a directory of checkpoints no non-persistent save wrote: resumed from, then all its "
                    "global_step* deleted")
@pytest.mark.parametrize("other_run", ["finished", "running", "gpt-neox"])
def test_another_runs_save_directory_is_never_resumed_from_nor_emptied(tmp_path, other_run):
    from megatron.checkpoint.engine import complete_checkpoint
    from megatron.checkpoint.run_lock import RunLock
    from megatron.errors import CheckpointError
    from megatron.launch.prelaunch import file_problems

    other = tmp_path / "other"
    for it in (4, 8):
        save(args_for(other), it, FakeEngine())
    lock = RunLock(str(other))
    if other_run in ("finished", "running"):
        lock.acquire()
        if other_run == "finished":
            lock.release()  # its lock file stays behind: a run's save directory
    else:  # GPT-NeoX's layout: no lock file, no marker
        for name in os.listdir(other):
            if name.startswith("."):
                os.remove(other / name)
    before = sorted(os.listdir(other))
    args = tiny(save=str(tmp_path / "ours"), load=str(tmp_path / "ours"), config_files={"model.yml": "{}"},
                non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=str(other),
                non_persistent_save_interval=2, user_script="train.py")
    os.makedirs(tmp_path / "ours")
    save(args, 2, FakeEngine())  # a persistent checkpoint: resume consults the non-persistent directory
    expected = f"non_persistent_global_ckpt_dir='{other}' " + ("is the save directory of a training run"
                                                                if other_run != "gpt-neox" else "holds checkpoints")
    assert expected in "".join(file_problems(args))  # deepy.py, before launch
    with pytest.raises(CheckpointError, match=expected):
        resolve(args)  # resuming
    with pytest.raises(CheckpointError, match=expected):
        _save_transient(args, 3, FakeEngine())  # saving
    complete_checkpoint(str(other / "global_step8"), 8, None, only=True)  # keep_only: nothing without the marker
    assert sorted(os.listdir(other)) == before and complete_tags(str(other)) == ["global_step4", "global_step8"]
    lock.release()
