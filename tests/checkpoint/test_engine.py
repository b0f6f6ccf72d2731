"""Checkpoint bookkeeping around the DeepSpeed engine: atomic `latest`, markers, pruning, architecture
checks and RNG restore. A stand-in engine records what DeepSpeed would be asked to do."""

import json
import os
import random

import pytest
import torch

import megatron.checkpoint.engine
from megatron.checkpoint.engine import find_checkpoint, load_checkpoint, resolve_checkpoint, restore_rng, save_checkpoint
from megatron.checkpoint.files import load_checkpoint_file
from megatron.checkpoint.format import complete_tags, read_latest
from megatron.checkpoint.integrity import write_manifest
from megatron.errors import CheckpointError
from megatron.model.config import ModelConfig
from tests.checkpoint.weights_only import assert_loads_weights_only
from tests.neox_arguments.helpers import tiny


class FakeEngine:
    def __init__(self):
        self.saved = []
        self.loaded = []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # `latest` is ours to write
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        torch.save({"module": {}, **client_state}, os.path.join(save_dir, tag, "mp_rank_00_model_states.pt"))
        self.saved.append(tag)

    @staticmethod
    def zero_optimization():
        return False

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only):
        self.loaded.append((tag, load_optimizer_states, load_module_only))
        state = load_checkpoint_file(os.path.join(load_dir, tag, "mp_rank_00_model_states.pt"))  # use_safe_loading
        return os.path.join(load_dir, tag), {k: v for k, v in state.items() if k != "module"}


def _model(args) -> ModelConfig:
    return ModelConfig.from_neox_args(args, padded_vocab_size=128)


def save(args, iteration, engine, extra=None):
    return save_checkpoint(args, _model(args), iteration, engine, extra)


def load(args, engine):
    """load_checkpoint, then the RNG set as the training loop sets it."""
    iteration, client_state, path = load_checkpoint(args, _model(args), engine, find_checkpoint(args))
    restore_rng(args, path, client_state)
    return iteration, client_state, path


def resolve(args):
    """(load_dir, tag) of the checkpoint a run of ``args`` loads (None: none), as initialize_megatron finds it and
    load_checkpoint checks it."""
    checkpoint = resolve_checkpoint(args, _model(args), find_checkpoint(args))
    return None if checkpoint is None else (checkpoint.load_dir, checkpoint.tag)


def args_for(tmp_path, **overrides):
    return tiny(save=str(tmp_path), load=str(tmp_path), config_files={"model.yml": "{num_layers: 2}"}, **overrides)


def test_save_writes_marker_config_files_and_latest(tmp_path):
    args = args_for(tmp_path)
    path = save(args, 5, FakeEngine(), {"consumed_train_samples": 10})
    assert read_latest(str(tmp_path)) == "global_step5"
    for name in ("COMPLETE", "neox_args.json", "configs/model.yml", "rng_state_rank0.pt"):
        assert os.path.isfile(os.path.join(path, name)), name
    saved = json.load(open(os.path.join(path, "neox_args.json")))
    assert saved["hidden_size"] == 64 and saved["padded_vocab_size"] == 128  # the tokenizer's padded vocabulary


def test_keep_last_n_checkpoints_prunes_the_oldest(tmp_path):
    args = args_for(tmp_path, keep_last_n_checkpoints=2)
    engine = FakeEngine()
    for it in (1, 2, 3):
        save(args, it, engine)
    assert complete_tags(str(tmp_path)) == ["global_step2", "global_step3"]


def test_no_save_rng(tmp_path):
    path = save(args_for(tmp_path, no_save_rng=True), 1, FakeEngine())
    assert not os.path.exists(os.path.join(path, "rng_state_rank0.pt"))


def test_load_resumes_iteration_state_and_rng(tmp_path):
    args = args_for(tmp_path)
    random.seed(7)
    save(args, 4, FakeEngine(), {"consumed_train_samples": 8})
    expected = random.random()
    random.seed(99)
    engine = FakeEngine()
    iteration, state, path = load(args, engine)
    assert (iteration, state["consumed_train_samples"]) == (4, 8)
    assert path == os.path.join(args.load, "global_step4")  # DPO's reference model starts from it
    assert random.random() == expected
    assert engine.loaded == [("global_step4", True, False)]


def _draws() -> tuple:
    import numpy as np

    return random.random(), float(np.random.rand()), float(torch.rand(1))


def _seed(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_the_resume_sets_every_rng_once_where_restore_rng_is_called(tmp_path):
    """load_checkpoint leaves the RNG alone (what setup draws after it does not matter); restore_rng sets python's,
    numpy's and torch's to the saved states, read from the rank's file of plain data."""
    args = args_for(tmp_path)
    _seed(7)
    path = save(args, 4, FakeEngine())
    expected = _draws()
    _seed(99)
    iteration, client_state, loaded = load_checkpoint(args, _model(args), FakeEngine(), find_checkpoint(args))
    assert loaded == path and _draws() != expected  # nothing set by the load
    restore_rng(args, loaded, client_state)
    assert _draws() == expected
    saved = torch.load(os.path.join(path, "rng_state_rank0.pt"), weights_only=True)
    assert isinstance(saved["numpy"][1], list) and saved["numpy"][0] == "MT19937"


def test_a_checkpoint_whose_rng_file_holds_numpy_arrays_still_resumes(tmp_path):
    """Checkpoints saved before the RNG states were plain data: numpy's key array is an ndarray (the safe loader
    reads it, megatron.checkpoint.files.checkpoint_globals)."""
    import numpy as np

    args = args_for(tmp_path)
    path = save(args, 4, FakeEngine())
    _seed(5)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               os.path.join(path, "rng_state_rank0.pt"))
    expected = _draws()
    write_manifest(path)  # the file changed after the save; its manifest would say so
    _seed(1)
    load(args, FakeEngine())
    assert _draws() == expected


def test_no_load_optim_finetune_and_no_load_rng(tmp_path):
    save(args_for(tmp_path), 4, FakeEngine())
    engine = FakeEngine()
    assert load(args_for(tmp_path, no_load_optim=True), engine)[0] == 4
    assert engine.loaded[-1] == ("global_step4", False, False)
    assert load(args_for(tmp_path, finetune=True), engine)[0] == 0
    assert engine.loaded[-1] == ("global_step4", False, True)
    random.seed(3)
    expected = random.random()
    random.seed(3)
    load(args_for(tmp_path, no_load_rng=True), engine)
    assert random.random() == expected


def test_nothing_to_load_starts_from_scratch(tmp_path):
    assert load(args_for(tmp_path), FakeEngine()) == (0, {}, None)
    assert load(tiny(), FakeEngine()) == (0, {}, None)


@pytest.mark.fault
def test_an_interrupted_save_is_never_latest_and_is_refused_by_name(tmp_path):
    args = args_for(tmp_path)
    save(args, 2, FakeEngine())
    os.makedirs(tmp_path / "global_step4")  # a save that died before COMPLETE
    assert resolve(args) == (str(tmp_path), "global_step2")
    with pytest.raises(CheckpointError, match="incomplete.*global_step2"):
        resolve(args_for(tmp_path, iteration=4))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve(args_for(tmp_path, iteration=9))


@pytest.mark.fault
def test_pruning_orders_tags_by_iteration_and_keeps_the_one_latest_names(tmp_path):
    args = args_for(tmp_path, keep_last_n_checkpoints=2)
    for it in (8, 9, 10):
        save(args, it, FakeEngine())
    assert sorted(os.listdir(tmp_path)) == ["global_step10", "global_step9", "latest"]
    assert read_latest(str(tmp_path)) == "global_step10"


@pytest.mark.fault
@pytest.mark.attack("`latest` naming an interrupted save, to load a partial checkpoint")
def test_latest_naming_an_incomplete_directory_is_refused(tmp_path):
    args = args_for(tmp_path)
    save(args, 2, FakeEngine())
    os.makedirs(tmp_path / "global_step4")
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(CheckpointError, match="global_step4 is incomplete"):
        resolve(args)


def _failing_write(monkeypatch, name):
    """_write_atomically dies (as a killed process would) when it writes `name`."""
    write = megatron.checkpoint.engine._write_atomically

    def dies_on(path, text):
        if os.path.basename(path) == name:
            open(f"{path}.tmp999", "w").close()  # what a kill inside it leaves behind
            raise KeyboardInterrupt(f"killed while writing {name}")
        write(path, text)

    monkeypatch.setattr(megatron.checkpoint.engine, "_write_atomically", dies_on)


@pytest.mark.fault
def test_a_crash_before_complete_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    args = args_for(tmp_path)
    save(args, 4, FakeEngine())
    _failing_write(monkeypatch, "COMPLETE")
    with pytest.raises(KeyboardInterrupt):
        save(args, 8, FakeEngine())
    assert read_latest(str(tmp_path)) == "global_step4" and complete_tags(str(tmp_path)) == ["global_step4"]
    assert resolve(args) == (str(tmp_path), "global_step4")


@pytest.mark.fault
def test_a_crash_between_complete_and_latest_resumes_from_the_newest_complete(tmp_path, monkeypatch, capsys):
    args = args_for(tmp_path)
    save(args, 4, FakeEngine())
    with monkeypatch.context() as patch:
        _failing_write(patch, "latest")
        with pytest.raises(KeyboardInterrupt):
            save(args, 8, FakeEngine())
    assert read_latest(str(tmp_path)) == "global_step4" and (tmp_path / "latest.tmp999").exists()
    engine = FakeEngine()
    assert load(args, engine)[0] == 8 and engine.loaded[-1][0] == "global_step8"
    assert "resuming from" in capsys.readouterr().out
    assert resolve(args_for(tmp_path, iteration=4)) == (str(tmp_path), "global_step4")  # on purpose: iteration
    save(args, 12, FakeEngine())
    assert not any(name.startswith("latest.tmp") for name in os.listdir(tmp_path))  # the stray one is removed


@pytest.mark.parametrize("latest", [None, "", "\x00\x8fgarbage", b"\xff\xfe\x9c\x00\xc3", "global_step99"],
                         ids=["deleted", "empty", "garbage", "random-bytes", "a-missing-directory"])
@pytest.mark.fault
@pytest.mark.attack("a deleted, empty or garbage `latest`, to resume from an older checkpoint (or none) and "
                    "overwrite complete ones")
def test_a_damaged_latest_resumes_from_the_newest_complete_checkpoint(tmp_path, capsys, latest):
    args = args_for(tmp_path)
    for it in (4, 8):
        save(args, it, FakeEngine())
    if latest is None:
        os.remove(tmp_path / "latest")
    elif isinstance(latest, bytes):  # not UTF-8
        (tmp_path / "latest").write_bytes(latest)
    else:
        (tmp_path / "latest").write_text(latest)
    assert resolve(args) == (str(tmp_path), "global_step8")
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'global_step8'}, the newest complete checkpoint" in out
    assert "set iteration to resume from another one" in out


def test_another_architecture_is_refused_with_every_mismatch(tmp_path):
    save(args_for(tmp_path), 2, FakeEngine())
    other = args_for(tmp_path, hidden_size=32, num_layers=3, attention_config=None)
    with pytest.raises(CheckpointError) as err:
        resolve(other)
    text = str(err.value)
    assert "hidden_size: checkpoint 64, config 32" in text and "num_layers: checkpoint 2, config 3" in text


# ---- GPT-NeoX's checkpoints and this project's older layout --------------------------------------------------

def _gpt_neox_checkpoint(tmp_path, args, iteration=6, yaml_extra="", tp=1, client_extra=None):
    """What GPT-NeoX writes (megatron/checkpoint/engine.py save_ds_checkpoint): mp_rank files with `module` and the
    client state, configs/*.yml, DeepSpeed's `latest`; no COMPLETE, no neox_args.json. Weights of this
    project's model, whose state dict is GPT-NeoX's (tests/checkpoint_conversion checks that)."""
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState

    path = tmp_path / f"global_step{iteration}"
    (path / "configs").mkdir(parents=True)
    module = build_model(_model(args), SingleProcessState()).state_dict()
    random.seed(11)
    client = {"iteration": iteration, "random_rng_state": random.getstate(), "np_rng_state": None,
              "args": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 32,
                       "make_vocab_size_divisible_by": 128, "padded_vocab_size": 128,
                       "tokenizer_type": "GPT2BPETokenizer", "model_parallel_size": tp}, **(client_extra or {})}
    import numpy as np

    client["np_rng_state"], client["torch_rng_state"] = np.random.get_state(), torch.get_rng_state()
    for rank in range(tp):
        torch.save({"module": module, "optimizer": None, **client}, path / f"mp_rank_{rank:02d}_model_states.pt")
    (path / "configs" / "model.yml").write_text('{"num-layers": 2, "hidden-size": 64,\n "num-attention-heads": 4,'
                                                 f' "attention-config": [[["global"], "all"]],{yaml_extra}}}\n')
    (tmp_path / "latest").write_text(f"global_step{iteration}")
    return path


def test_a_gpt_neox_checkpoint_is_recognised_and_loaded(tmp_path):
    from megatron.checkpoint.engine import checkpoint_vocab_size
    from megatron.checkpoint.format import GPT_NEOX
    from megatron.checkpoint.files import checkpoint_kind

    args = args_for(tmp_path)
    path = _gpt_neox_checkpoint(tmp_path, args)
    expected = random.getstate()
    assert checkpoint_kind(str(path)) == GPT_NEOX
    assert resolve(args) == (str(tmp_path), "global_step6")
    assert checkpoint_vocab_size(find_checkpoint(args)) == 128  # from the embedding's rows
    random.seed(0)
    engine = FakeEngine()
    iteration, state, _ = load(args, engine)
    assert iteration == 6 and engine.loaded == [("global_step6", True, False)]
    assert random.getstate() == expected  # GPT-NeoX's RNG states are in its client state


def test_a_gpt_neox_checkpoint_of_another_model_is_refused_naming_each_difference(tmp_path):
    _gpt_neox_checkpoint(tmp_path, args_for(tmp_path), yaml_extra=' "activation": "swiglu", "norm": "rmsnorm"', tp=2)
    with pytest.raises(CheckpointError) as err:
        resolve(args_for(tmp_path, num_layers=3, attention_config=None))
    text = str(err.value)
    assert "GPT-NeoX checkpoint" in text
    assert "num_layers: checkpoint 2 (args in its mp_rank files), config 3" in text
    assert "activation: checkpoint 'swiglu' (its configs/*.yml), config 'gelu'" in text
    assert "norm: checkpoint 'rmsnorm'" in text
    assert "model_parallel_size: checkpoint 2 (its files), config 1" in text
    assert "set no_load_optim: true (weights and iteration) or finetune: true" in text


def test_a_gpt_neox_checkpoint_of_another_split_resolves_for_its_weights_only(tmp_path):
    _gpt_neox_checkpoint(tmp_path, args_for(tmp_path), tp=2)
    with pytest.raises(CheckpointError, match=r"(?s)model_parallel_size: checkpoint 2 \(its files\), config 1.*its "
                                              r"optimizer state only into its own"):
        resolve(args_for(tmp_path))
    assert resolve(args_for(tmp_path, no_load_optim=True)) == (str(tmp_path), "global_step6")
    assert resolve(args_for(tmp_path, finetune=True)) == (str(tmp_path), "global_step6")


def test_an_interrupted_save_without_neox_args_is_not_taken_for_gpt_neox(tmp_path):
    from megatron.checkpoint.format import LAYOUT, LAYOUT_KEY

    args = args_for(tmp_path)
    save(args, 2, FakeEngine())
    _gpt_neox_checkpoint(tmp_path, args, iteration=4, client_extra={LAYOUT_KEY: LAYOUT})  # ours, died before COMPLETE
    (tmp_path / "latest").write_text("global_step2")
    with pytest.raises(CheckpointError, match="global_step4 is incomplete"):
        resolve(args_for(tmp_path, iteration=4))


def test_an_old_layout_checkpoint_is_refused_for_training_with_the_upgrade_command(tmp_path):
    from megatron.checkpoint.format import OURS_OLD
    from megatron.checkpoint.files import checkpoint_kind

    args = args_for(tmp_path)
    path = save(args, 3, FakeEngine())
    saved = json.load(open(os.path.join(path, "neox_args.json")))
    del saved["checkpoint_layout"]  # written before GPT-NeoX's layout
    json.dump(saved, open(os.path.join(path, "neox_args.json"), "w"))
    os.remove(os.path.join(path, "checksums.xxh128"))  # and before checksums
    assert checkpoint_kind(path) == OURS_OLD
    with pytest.raises(CheckpointError, match=r"(?s)older layout.*tools/ckpts/upgrade_checkpoint.py --input_dir "
                                              r".*global_step3 --output_dir NEW_SAVE_DIR"):
        resolve(args)
    assert resolve_checkpoint(args, _model(args), find_checkpoint(args), layout_must_match=False).path == \
        str(tmp_path / "global_step3")


def test_split_and_replicated_experts_do_not_load_into_each_other(tmp_path):
    """DeepSpeed's experts split over the tensor-parallel ranks (enable_expert_tensor_parallelism) are saved as
    shards: a checkpoint of whole experts is refused by a training run that splits them, with the key named;
    inference (which merges the checkpoint and takes its own slices) reads it."""
    moe = dict(moe_num_experts=4, moe_type="deepspeed", model_parallel_size=2, num_gpus=2)
    save(args_for(tmp_path, **moe), 3, FakeEngine())
    split = args_for(tmp_path, enable_expert_tensor_parallelism=True, **moe)
    with pytest.raises(CheckpointError, match="enable_expert_tensor_parallelism: checkpoint False, config True"):
        resolve(split)
    assert resolve_checkpoint(split, _model(split), find_checkpoint(split), layout_must_match=False).path == \
        str(tmp_path / "global_step3")


def test_save_writes_gpt_neox_client_state(tmp_path):
    args = args_for(tmp_path)
    path = save(args, 5, FakeEngine(), {"consumed_train_samples": 10})
    state = torch.load(os.path.join(path, "mp_rank_00_model_states.pt"), weights_only=False)
    assert state["iteration"] == 5 and state["consumed_train_samples"] == 10
    assert state["args"] == {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                             "max_position_embeddings": 32, "make_vocab_size_divisible_by": 128,
                             "padded_vocab_size": 128, "tokenizer_type": "GPT2BPETokenizer", "model_parallel_size": 1}
    assert not {"random_rng_state", "np_rng_state", "torch_rng_state"} & set(state)  # RNG: once, in rng_state_rank0
    assert assert_loads_weights_only(path) == ["mp_rank_00_model_states.pt", "rng_state_rank0.pt"]
    assert json.load(open(os.path.join(path, "neox_args.json")))["checkpoint_layout"] == "gpt-neox"


def test_the_padded_vocabulary_of_a_gpt_neox_checkpoint_comes_from_its_embedding(tmp_path):
    from megatron.initialize import _checkpoint_vocabulary
    from megatron.errors import ConfigError

    args = args_for(tmp_path)
    _gpt_neox_checkpoint(tmp_path, args)  # 128 rows
    found = find_checkpoint(args)
    assert _checkpoint_vocabulary(args, found, tokenizer_vocab=100, vocab=104) == 128
    explicit = args_for(tmp_path, padded_vocab_size=104)
    assert _checkpoint_vocabulary(explicit, found, 100, 104) == 104  # explicit: compared
    with pytest.raises(ConfigError, match="embedding has 128 rows.*tokenizer's 200 tokens"):
        _checkpoint_vocabulary(args, found, tokenizer_vocab=200, vocab=256)


@pytest.mark.fault
def test_another_parallel_layout_is_accepted_for_resharding(tmp_path):
    """Another number of data-parallel ranks under ZeRO, or another tensor / pipeline split: load_checkpoint
    reshards (megatron.checkpoint.resharding; tests/checkpoint/test_resharding.py trains on)."""
    saved_args = args_for(tmp_path, global_num_gpus=2, zero_optimization={"stage": 1})
    assert saved_args.data_parallel_size == 2
    save(saved_args, 4, FakeEngine())
    assert resolve(args_for(tmp_path, global_num_gpus=1, zero_optimization={"stage": 1})) == (str(tmp_path),
                                                                                              "global_step4")
    assert resolve(args_for(tmp_path, global_num_gpus=2, model_parallel_size=2)) == (str(tmp_path), "global_step4")
    # into and out of context parallelism (tests/model/test_context_parallel.py trains on)
    assert resolve(args_for(tmp_path, global_num_gpus=4, context_parallel_size=2,
                            zero_optimization={"stage": 1})) == (str(tmp_path), "global_step4")
    save(args_for(tmp_path, global_num_gpus=4, context_parallel_size=2, zero_optimization={"stage": 1}), 8,
         FakeEngine())
    assert resolve(args_for(tmp_path, global_num_gpus=1, zero_optimization={"stage": 2})) == (str(tmp_path),
                                                                                              "global_step8")


@pytest.mark.fault
def test_another_seq_length_is_refused_on_resume_and_another_batch_size_is_noted(tmp_path, capsys):
    save(args_for(tmp_path), 4, FakeEngine())
    args = args_for(tmp_path)
    with pytest.raises(CheckpointError, match=rf"seq_length: checkpoint {args.seq_length}, config "
                                              rf"{args.seq_length // 2}: resuming continues the data.*finetune: true"):
        resolve(args_for(tmp_path, seq_length=args.seq_length // 2))
    assert resolve(args_for(tmp_path, seq_length=args.seq_length // 2, finetune=True)) == (str(tmp_path),
                                                                                          "global_step4")
    capsys.readouterr()
    bigger = args_for(tmp_path, train_micro_batch_size_per_gpu=2 * args.train_micro_batch_size_per_gpu)
    assert resolve(bigger) == (str(tmp_path), "global_step4")
    assert (f"the global batch size changed from {args.train_batch_size} (checkpoint) to "
            f"{bigger.train_batch_size}: the data continues at the sample") in capsys.readouterr().out


@pytest.mark.fault
def test_resuming_experts_at_another_expert_parallel_size_is_refused_with_the_way_out(tmp_path):
    moe = dict(moe_num_experts=4, moe_type="deepspeed", global_num_gpus=2)
    save(args_for(tmp_path, moe_expert_parallel_size=2, **moe), 4, FakeEngine())
    assert resolve(args_for(tmp_path, moe_expert_parallel_size=2, **moe)) == (str(tmp_path), "global_step4")
    with pytest.raises(CheckpointError, match=r"(?s)cannot be resumed by this run:.*moe_expert_parallel_size: "
                                              r"checkpoint 2, this run 1: DeepSpeed's optimizer state of the experts.*"
                                              r"set no_load_optim: true"):
        resolve(args_for(tmp_path, **moe))
    assert resolve(args_for(tmp_path, no_load_optim=True, **moe)) == (str(tmp_path), "global_step4")
    dropless = dict(moe_num_experts=4, global_num_gpus=2)
    save(args_for(tmp_path, moe_expert_parallel_size=2, **dropless), 8, FakeEngine())
    with pytest.raises(CheckpointError, match=r"(?s)moe_expert_parallel_size: checkpoint 2, this run 1: the dropless "
                                              r"layer keeps its experts stacked.*generate.py, eval.py and the "
                                              r"conversion tools read either"):
        resolve(args_for(tmp_path, no_load_optim=True, **dropless))


@pytest.mark.attack("`latest` naming another run's checkpoint (an absolute path, ../other/global_step3), to load "
                    "its state and then overwrite this run's complete checkpoints")
@pytest.mark.parametrize("outside", ["absolute", "relative"])
def test_latest_naming_a_directory_outside_the_save_directory_is_refused(tmp_path, outside):
    ours, other = tmp_path / "ours", tmp_path / "other"
    save(args_for(other), 3, FakeEngine())
    args = args_for(ours)
    for it in (4, 6):
        save(args, it, FakeEngine())
    named = str(other / "global_step3") if outside == "absolute" else "../other/global_step3"
    (ours / "latest").write_text(named)
    engine = FakeEngine()
    with pytest.raises(CheckpointError, match=rf"{ours / 'latest'} names '{named}', which is not a directory "
                                              rf"inside {ours}"):
        load(args, engine)
    assert engine.loaded == [] and complete_tags(str(ours)) == ["global_step4", "global_step6"]
    from megatron.launch.prelaunch import load_problems

    assert f"{ours / 'latest'} names '{named}'" in "".join(load_problems(args))


@pytest.mark.attack("`latest` naming a deleted checkpoint with no complete one left: the run must not be called "
                    "finished nor the checkpoint 'incomplete'")
def test_latest_naming_a_deleted_directory_with_nothing_to_resume_is_one_clear_error(tmp_path):
    import shutil

    from megatron.launch.prelaunch import finished_run_message, load_problems

    args = args_for(tmp_path, train_iters=4)
    save(args, 4, FakeEngine())
    shutil.rmtree(tmp_path / "global_step4")
    message = (f"{tmp_path / 'latest'} names 'global_step4', which does not exist in {tmp_path} (deleted or "
               f"moved?), and it holds no other checkpoint: there is nothing to resume from")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        find_checkpoint(args)  # train.py, generate.py and eval.py find their checkpoint here
    assert message in "".join(load_problems(args))  # deepy.py refuses before launch
    assert finished_run_message(args) is None  # not "nothing to train ... at iteration 4"


def test_the_model_parallel_rng_stream_resumes_where_it_was_saved(tmp_path):
    """The tracker's streams (attention dropout's, row-parallel LoRA dropout's) are saved with the rank's RNG states
    and set back by restore_rng: after a resume the stream draws what the uninterrupted run drew next."""
    from megatron.mpu.random import RNGStatesTracker

    args = args_for(tmp_path)
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork("model-parallel-rng"):
        torch.rand(5)  # the stream moved on by some steps' masks
    path = save_checkpoint(args, _model(args), 4, FakeEngine(), rng_tracker=tracker)
    with tracker.fork("model-parallel-rng"):
        expected = torch.rand(3)
    resumed = RNGStatesTracker()
    resumed.add("model-parallel-rng", 1234)  # as a relaunch seeds it
    iteration, client_state, loaded = load_checkpoint(args, _model(args), FakeEngine(), find_checkpoint(args))
    restore_rng(args, loaded, client_state, resumed)
    with resumed.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(3), expected)
    assert loaded == path
