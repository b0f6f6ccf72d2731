"""Checkpoint files are read without running code: a planted pickle that would call os.system is refused,
naming the file and the object, by every reader (our RNG and model files, the conversion tools, DeepSpeed's
engine), and the files this project and DeepSpeed write still load."""
import os

import pytest
import torch

from megatron.checkpoint.files import load_checkpoint_file
from megatron.errors import CheckpointError
from tests.distributed_helpers import run_distributed


class Planted:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path, marker) -> None:
    state = torch.load(path, weights_only=False) if os.path.exists(path) else {}
    state["planted"] = Planted(str(marker))
    torch.save(state, path)


@pytest.mark.fault
@pytest.mark.attack("a checkpoint file holding a pickle that runs a command when loaded")
def test_a_planted_object_is_refused_and_never_runs(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}}, path)
    assert torch.equal(load_checkpoint_file(str(path), mmap=True)["module"]["w"], torch.ones(2))
    plant(path, marker)
    for mmap in (False, True):
        with pytest.raises(CheckpointError, match=rf"{path} holds a Python object .*GLOBAL posix.system"):
            load_checkpoint_file(str(path), mmap=mmap)
    assert not marker.exists()


def test_numpy_rng_state_and_deepspeed_bookkeeping_load(tmp_path):
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    state = {"np_rng_state": np.random.get_state(), "zero_stage": ZeroStageEnum.optimizer_states,
             "loss_scaler": DynamicLossScaler(2 ** 8, 2.0, 1000, 1, 1, False), "shapes": {"w": torch.Size([2, 3])},
             "names": {"a", "b"}}
    torch.save(state, tmp_path / "f.pt")
    loaded = load_checkpoint_file(str(tmp_path / "f.pt"))
    assert loaded["np_rng_state"][0] == "MT19937" and (loaded["np_rng_state"][1] == state["np_rng_state"][1]).all()
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states and loaded["loss_scaler"].cur_scale == 2 ** 8



def test_deepspeeds_objects_are_written_as_plain_data_and_read_back(tmp_path):
    """What a run without ZeRO keeps in its model-states file (the bf16 optimizer's fragment addresses, fp16's loss
    scaler) and ZeRO's stage: written as records, so that a plain weights_only load reads the file, and read back
    by load_checkpoint_file as DeepSpeed's objects, equal to what was saved."""
    from collections import OrderedDict

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from megatron.checkpoint.files import DEEPSPEED_OBJECT, as_plain_data, from_plain_data, savable

    weight = torch.arange(6.0)
    state = {"optimizer": {"param_slice_mappings": [OrderedDict(w=fragment_address(numel=4, start=2))],
                           "loss_scaler": DynamicLossScaler(2 ** 8, 2.0, 1000, 1, 1, False),
                           "zero_stage": ZeroStageEnum.optimizer_states, "groups": [(weight, 1)]}}
    torch.save(as_plain_data(state), tmp_path / "f.pt")
    plain = torch.load(tmp_path / "f.pt", weights_only=True)  # no class allowed beyond torch's
    assert plain["optimizer"]["zero_stage"] == {DEEPSPEED_OBJECT: "ZeroStageEnum", "value": 1}
    loaded = load_checkpoint_file(str(tmp_path / "f.pt"))["optimizer"]
    assert loaded["param_slice_mappings"] == [OrderedDict(w=fragment_address(numel=4, start=2))]
    assert type(loaded["param_slice_mappings"][0]) is OrderedDict and type(loaded["groups"][0]) is tuple
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states
    assert type(loaded["loss_scaler"]) is DynamicLossScaler and vars(loaded["loss_scaler"]) == vars(
        state["optimizer"]["loss_scaler"])
    assert torch.equal(loaded["groups"][0][0], weight)
    unknown = {DEEPSPEED_OBJECT: "system", "value": "touch x"}  # names no class of the table: stays data
    assert from_plain_data(unknown) == unknown
    # DeepSpeed's optimizer files stay as DeepSpeed writes them: its zero_to_fp32 compares their ZeRO stage to numbers
    assert savable(state, "global_step1/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt") is state
    assert savable(state, "global_step1/mp_rank_00_model_states.pt")["optimizer"]["zero_stage"][DEEPSPEED_OBJECT]

@pytest.mark.fault
@pytest.mark.attack("a planted RNG-state file (with its checksums rewritten) that runs a command on resume")
def test_a_planted_rng_state_is_refused_on_resume(tmp_path):
    from megatron.checkpoint.integrity import write_manifest
    from tests.checkpoint.test_engine import FakeEngine, args_for, load, save

    args = args_for(tmp_path)
    path = save(args, 4, FakeEngine())
    plant(os.path.join(path, "rng_state_rank0.pt"), tmp_path / "ran")
    with pytest.raises(CheckpointError, match="rng_state_rank0.pt is damaged"):  # the checksum differs
        load(args, FakeEngine())
    write_manifest(path)  # who can plant a file can rewrite the checksums: still nothing runs
    with pytest.raises(CheckpointError, match="rng_state_rank0.pt holds a Python object"):
        load(args, FakeEngine())
    assert not (tmp_path / "ran").exists()


@pytest.mark.fault
@pytest.mark.attack("a planted model file that runs a command when the conversion tools read it")
def test_conversion_refuses_a_planted_model_file(tmp_path):
    from megatron.errors import ConversionError
    from megatron.checkpoint.neox_checkpoint import _load

    plant(str(tmp_path / "layer_00-model_00-model_states.pt"), tmp_path / "ran")
    with pytest.raises(ConversionError, match="layer_00-model_00-model_states.pt holds a Python object"):
        _load(str(tmp_path / "layer_00-model_00-model_states.pt"))
    assert not (tmp_path / "ran").exists()


def _engine_round_trip(rank, world_size, directory):
    import deepspeed

    from megatron.checkpoint.files import use_safe_loading
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import ParallelState
    from tests.model.helpers import tiny_config

    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    model = build_model(tiny_config(), state)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()), mpu=state,
        config={"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})
    use_safe_loading(engine)
    engine.save_checkpoint(directory, tag="ok")
    loaded, _ = engine.load_checkpoint(directory, tag="ok")
    results = [loaded is not None]
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        engine.save_checkpoint(directory, tag=name)
        plant(os.path.join(directory, name, name), os.path.join(directory, "ran"))
        try:
            engine.load_checkpoint(directory, tag=name)
            results.append("loaded")
        except CheckpointError as exc:
            results.append(str(exc))
    state.destroy()
    return results, os.path.exists(os.path.join(directory, "ran"))


@pytest.mark.slow
@pytest.mark.attack("planted model and ZeRO optimizer files that run a command when DeepSpeed's engine loads them")
def test_deepspeed_engine_reads_its_files_safely(tmp_path):
    (results, ran), = run_distributed(_engine_round_trip, world_size=1, args=(str(tmp_path),))
    assert results[0] is True  # the files DeepSpeed writes (ZeRO-1 included) load
    assert "mp_rank_00_model_states.pt holds a Python object" in results[1]
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt holds a Python object" in results[2]
    assert not ran


@pytest.mark.attack("an engine told to read universal checkpoints or given another checkpoint engine, reaching "
                    "DeepSpeed's torch.load(weights_only=False) past the config's check")
def test_safe_loading_covers_every_checkpoint_engine_and_refuses_universal_loading(tmp_path):
    from types import SimpleNamespace

    from megatron.checkpoint.files import use_safe_loading

    class OtherEngine:  # e.g. DeepSpeed's FastCheckpointEngine: its own torch.load
        def load(self, path, map_location=None):
            return torch.load(path, weights_only=False)

    path = tmp_path / "mp_rank_00_model_states.pt"
    plant(str(path), tmp_path / "ran")
    engine = SimpleNamespace(checkpoint_engine=OtherEngine(), load_universal_checkpoint=lambda: False)
    use_safe_loading(engine)
    with pytest.raises(CheckpointError, match="holds a Python object"):
        engine.checkpoint_engine.load(str(path))
    engine = SimpleNamespace(checkpoint_engine=OtherEngine(), load_universal_checkpoint=lambda: True)
    with pytest.raises(CheckpointError, match="checkpoint.load_universal is set"):
        use_safe_loading(engine)
    assert not (tmp_path / "ran").exists()
