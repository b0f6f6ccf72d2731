"""An adapter checkpoint's base (megatron.checkpoint.lora.base_checkpoint): found, verified, and refused by name when
it is gone or is no longer the checkpoint the adapters were trained on."""

import os

import pytest

from megatron.checkpoint.engine import FoundCheckpoint
from megatron.checkpoint.integrity import write_manifest
from megatron.checkpoint.lora import base_checkpoint, base_pointer
from megatron.errors import CheckpointError


def _base(tmp_path):
    path = tmp_path / "base" / "global_step2"
    path.mkdir(parents=True)
    (path / "neox_args.json").write_text("{}")
    (path / "COMPLETE").write_text("")
    write_manifest(str(path))
    return FoundCheckpoint(load_dir=str(tmp_path / "base"), tag="global_step2", kind="ours")


def test_the_recorded_base_is_found_and_a_changed_or_missing_one_refused(tmp_path, monkeypatch):
    base = _base(tmp_path)
    monkeypatch.setattr("megatron.checkpoint.lora.read_client_state", lambda path: {"iteration": 2})
    pointer = base_pointer(base)
    assert pointer["iteration"] == 2 and pointer["load"] == os.path.abspath(base.load_dir)
    assert base_checkpoint(pointer, "adapters").path == base.path
    (tmp_path / "base" / "global_step2" / "neox_args.json").write_text('{"rewritten": 1}')
    write_manifest(base.path)  # a consistent checkpoint, but another one
    with pytest.raises(CheckpointError, match="is not the one adapter checkpoint adapters was trained on"):
        base_checkpoint(pointer, "adapters")
    with pytest.raises(CheckpointError, match="which is not there; put the base back"):
        base_checkpoint({**pointer, "tag": "global_step9"}, "adapters")
