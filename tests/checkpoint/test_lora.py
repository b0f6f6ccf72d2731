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


def _base_of_another_split(rank: int, world_size: int, directory: str) -> None:
    """A base saved at tensor parallel 1 loaded into a LoRA model at tensor parallel 2 (load_base_resharded): the
    loss of the base model, the adapters untouched."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatron.checkpoint.lora import load_base_resharded
    from megatron.checkpoint.neox_checkpoint import flat_state_dict, write_checkpoint
    from megatron.model.gpt2_model import build_model
    from megatron.model.lora import lora_state
    from megatron.mpu import ParallelState, SingleProcessState
    from tests.model.helpers import TINY_MODEL, random_batch, tiny_config

    args = {**TINY_MODEL, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    torch.manual_seed(0)
    base_config = tiny_config(**args)
    base = build_model(base_config, SingleProcessState())
    if rank == 0:
        write_checkpoint(directory, flat_state_dict(base.state_dict(), base_config), base_config, args, {}, 1)
    dist.barrier()
    lora = {"r": 2, "target_modules": ["query_key_value", "dense", "linear1", "linear2"]}
    config = tiny_config(**args, model_parallel_size=2, lora=lora, seed=99)
    parallel_state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
    model = build_model(config, parallel_state)  # other weights
    adapters = {name: value.detach().clone() for name, value in lora_state(model).items()}
    inputs, labels = random_batch()
    with torch.no_grad():
        want = float(base.loss_fn(base(inputs), labels))
        assert abs(float(model.loss_fn(model(inputs), labels)) - want) > 1e-3
        engine = SimpleNamespace(module=model, mpu=parallel_state)
        state = load_base_resharded(engine, config, FoundCheckpoint(directory, "global_step1", "ours"))
        assert state["iteration"] == 1
        got = float(model.loss_fn(model(inputs), labels))
    print(f"rank {rank}: loss of the TP-1 base {want}, of the TP-2 LoRA model that loaded it {got}")
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert all(torch.equal(value, adapters[name]) for name, value in lora_state(model).items())


@pytest.mark.slow
def test_a_base_saved_at_another_tensor_parallel_size_is_resharded_as_it_loads(tmp_path):
    from tests.distributed_helpers import run_distributed

    run_distributed(_base_of_another_split, world_size=2, args=(str(tmp_path / "base"),))


def test_adapters_loading_without_their_optimizer_state_under_zero3_is_refused(monkeypatch):
    """ZeRO-3 keeps the adapters' weights in its optimizer partitions (placeholders in its model files): loading an
    adapter checkpoint with finetune / no_load_optim would leave them at their initial values, so it is refused."""
    from types import SimpleNamespace

    import torch

    from megatron.checkpoint import lora

    found = FoundCheckpoint(load_dir="/x/adapters", tag="global_step3", kind="ours")
    monkeypatch.setattr(lora, "resolve_checkpoint", lambda *args: found)
    monkeypatch.setattr(lora, "adapter_base", lambda path: {"load": "/x/base", "tag": "global_step1"})
    monkeypatch.setattr(lora, "_check_adapter_split", lambda *args: None)
    monkeypatch.setattr(lora, "saved_without_optimizer", lambda checkpoint: False)
    module = torch.nn.Linear(2, 2)
    module.weight.ds_id = 0  # a ZeRO-3 partitioned parameter
    engine = SimpleNamespace(module=module)
    for args in (dict(finetune=True, no_load_optim=False), dict(finetune=False, no_load_optim=True)):
        with pytest.raises(CheckpointError, match="lora under ZeRO-3: adapter checkpoint /x/adapters/global_step3 "
                                                  "would load without its optimizer state"):
            lora.load_lora_checkpoint(SimpleNamespace(load="/x/adapters", **args), None, engine, found)
