"""Checkpoint bookkeeping around the DeepSpeed engine: atomic `latest`, markers, pruning, architecture
checks and RNG restore. A stand-in engine records what DeepSpeed would be asked to do."""

import json
import os
import random

import pytest

from megatron.checkpointing import (CheckpointError, complete_tags, load_checkpoint, read_latest, resolve_checkpoint,
                                    save_checkpoint)
from megatron.model_config import ModelConfig
from tests.neox_arguments.helpers import tiny


class FakeEngine:
    def __init__(self):
        self.saved = []
        self.loaded = []

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        assert save_latest is False  # `latest` is ours to write
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)
        with open(os.path.join(save_dir, tag, "mp_rank_00_model_states.json"), "w") as handle:
            json.dump(client_state, handle)
        self.saved.append(tag)

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only):
        self.loaded.append((tag, load_optimizer_states, load_module_only))
        with open(os.path.join(load_dir, tag, "mp_rank_00_model_states.json")) as handle:
            return os.path.join(load_dir, tag), json.load(handle)


def _model(args) -> ModelConfig:
    return ModelConfig.from_neox_args(args, padded_vocab_size=128)


def save(args, iteration, engine, extra=None):
    return save_checkpoint(args, _model(args), iteration, engine, extra)


def load(args, engine):
    return load_checkpoint(args, _model(args), engine)


def resolve(args):
    return resolve_checkpoint(args, _model(args))


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
    iteration, state = load(args, engine)
    assert (iteration, state["consumed_train_samples"]) == (4, 8)
    assert random.random() == expected
    assert engine.loaded == [("global_step4", True, False)]


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
    assert load(args_for(tmp_path), FakeEngine()) == (0, {})
    assert load(tiny(), FakeEngine()) == (0, {})


def test_an_interrupted_save_is_never_latest_and_is_refused_by_name(tmp_path):
    args = args_for(tmp_path)
    save(args, 2, FakeEngine())
    os.makedirs(tmp_path / "global_step4")  # a save that died before COMPLETE
    assert resolve(args) == (str(tmp_path), "global_step2")
    with pytest.raises(CheckpointError, match="incomplete.*global_step2"):
        resolve(args_for(tmp_path, iteration=4))
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve(args_for(tmp_path, iteration=9))


def test_another_architecture_is_refused_with_every_mismatch(tmp_path):
    save(args_for(tmp_path), 2, FakeEngine())
    other = args_for(tmp_path, hidden_size=32, num_layers=3, attention_config=None)
    with pytest.raises(CheckpointError) as err:
        resolve(other)
    text = str(err.value)
    assert "hidden_size: checkpoint 64, config 32" in text and "num_layers: checkpoint 2, config 3" in text
