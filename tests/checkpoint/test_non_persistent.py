"""Non-persistent checkpoints (non_persistent_ckpt_type 'global'): saved atomically into their own directory,
which keeps only the newest; resumed from when newer than the persistent checkpoint; the loop saves them every
non_persistent_save_interval iterations that are not persistent saves. A stand-in engine (tests.checkpoint.test_engine)
records what DeepSpeed would be asked to do."""

import os

from megatron.checkpoint.engine import save_checkpoint
from megatron.checkpoint.format import complete_tags, read_latest
from megatron.checkpoint.non_persistent import in_non_persistent_dir, non_persistent_dir, non_persistent_due
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
    assert sorted(os.listdir(transient)) == ["global_step8", "latest"]  # only the newest, no leftovers
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
