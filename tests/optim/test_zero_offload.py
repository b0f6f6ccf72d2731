"""ZeRO-Offload: the config rules (megatron.optim.zero_offload), and DeepSpeed's offloading on two gloo ranks giving the
losses of the same run without offload, and resuming exactly from its checkpoint. (The deepy.py path with
offload is covered by tests/e2e/test_deepspeed_features.py.)"""

import pytest
import torch

from megatron.optim.zero_offload import offload_device_problems, offload_problems
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch, tiny_config
from tests.neox_arguments.helpers import problems_of, tiny

CPU_ADAM = {"type": "CPU_Adam", "params": {"lr": 1e-3}}


def test_offloading_the_optimizer_needs_cpu_adam_or_deepspeeds_override():
    message = problems_of(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                          optimizer={"type": "Adam", "params": {"lr": 1e-3}})
    assert "set optimizer.type to CPU_Adam" in message and "zero_force_ds_cpu_optimizer" in message
    args = tiny(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                optimizer={"type": "Adam", "params": {"lr": 1e-3}},
                deepspeed_extra_args={"zero_force_ds_cpu_optimizer": False})
    assert args.deepspeed_config["zero_force_ds_cpu_optimizer"] is False
    args = tiny(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"},
                                   "offload_param": {"device": "cpu", "pin_memory": True}}, optimizer=CPU_ADAM)
    assert args.deepspeed_config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize("zero,expected", [
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device='cpu' needs ZeRO stage 3"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stages 1, 2 and 3"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "must be one of none, cpu, nvme"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme"}}, "needs zero_optimization.offload_optimizer.nvme_path"),
    ({"stage": 3, "offload_param": "cpu"}, "must be a dict"),
])
def test_offload_sections_are_checked(zero, expected):
    assert expected in problems_of(zero_optimization=zero, optimizer=CPU_ADAM)


def test_offload_rules_leave_device_none_alone():
    assert offload_problems(0, {"offload_optimizer": {"device": "none"}}, "adam", None) == []


def test_nvme_is_refused_on_a_worker_where_async_io_cannot_build():
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}
    problems = offload_device_problems(zero, async_io_builds=lambda: False)
    assert len(problems) == 1 and "offload_param.device='nvme'" in problems[0] and "libaio-dev" in problems[0]
    assert offload_device_problems(zero, async_io_builds=lambda: True) == []
    assert offload_device_problems({"stage": 3, "offload_param": {"device": "cpu"}},
                                   async_io_builds=lambda: False) == []


STEPS, SAVE_AT = 6, 3
CASES = {"zero2": {"stage": 2}, "zero2_offload_optimizer": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
         "zero3": {"stage": 3},
         "zero3_offload_both": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "cpu"}}}


def _engine(zero, state, world_size: int = 2):
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from megatron.model.gpt2_model import build_model

    torch.manual_seed(0)
    model = build_model(tiny_config(), state)
    config = {"train_batch_size": 2 * world_size, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 6, "gradient_clipping": 1.0, "zero_optimization": zero}
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=state)
    return engine, model


def _train(engine, model, rank, steps):
    losses = []
    for step in steps:
        inputs, labels = random_batch(seed=rank)  # one batch per rank, learnt by heart
        loss = model.loss_fn(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _offload_losses(rank: int, world_size: int, checkpoints: str):
    """{case: losses of STEPS steps} and, for the offload cases, the losses after resuming at SAVE_AT."""
    from megatron.mpu.deepspeed_comm import init_deepspeed_comm
    from megatron.mpu import ParallelState

    init_deepspeed_comm("gloo", dist_init_required=False)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    results = {}
    for name, zero in CASES.items():
        engine, model = _engine(zero, state)
        results[name] = _train(engine, model, rank, range(SAVE_AT))
        if "offload" in name:
            engine.save_checkpoint(checkpoints, tag=name)
        results[name] += _train(engine, model, rank, range(SAVE_AT, STEPS))
        if "offload" in name:
            engine, model = _engine(zero, state)
            engine.load_checkpoint(checkpoints, tag=name)
            results[name + "_resumed"] = _train(engine, model, rank, range(SAVE_AT, STEPS))
    state.destroy()
    return results


@pytest.mark.slow
def test_offload_gives_the_losses_without_offload_and_resumes_exactly(tmp_path):
    results = run_distributed(_offload_losses, world_size=2, args=(str(tmp_path),))[0]
    assert results["zero2"][-1] < results["zero2"][0] - 0.05  # it trains
    for offloaded, plain in (("zero2_offload_optimizer", "zero2"), ("zero3_offload_both", "zero3")):
        assert results[offloaded] == pytest.approx(results[plain], rel=1e-5), offloaded
        assert results[offloaded + "_resumed"] == results[offloaded][SAVE_AT:], offloaded


def _async_io_compatible() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


def _nvme_losses(rank: int, world_size: int, nvme_path: str):
    from megatron.mpu.deepspeed_comm import init_deepspeed_comm
    from megatron.mpu import ParallelState

    init_deepspeed_comm("gloo", dist_init_required=False)
    state = ParallelState(pipe_parallel_size=0, model_parallel_size=1)
    results = {}
    for device in ("cpu", "nvme"):
        where = {"device": device, **({"nvme_path": nvme_path} if device == "nvme" else {})}
        engine, model = _engine({"stage": 3, "offload_optimizer": where, "offload_param": where}, state, world_size)
        results[device] = _train(engine, model, rank, range(3))
    state.destroy()
    return results


@pytest.mark.slow
@pytest.mark.skipif(not _async_io_compatible(), reason="NVMe offload needs libaio (apt-get install libaio-dev) for "
                                                       "DeepSpeed's async_io op; it is refused where it is missing")
def test_nvme_offload_gives_the_losses_of_cpu_offload(tmp_path):
    """Where DeepSpeed's async_io op builds (libaio installed; its first build takes minutes), ZeRO-3 with optimizer
    and parameters swapped to NVMe through it trains exactly as with them offloaded to CPU memory."""
    results = run_distributed(_nvme_losses, world_size=1, args=(str(tmp_path),))[0]
    assert results["nvme"] == pytest.approx(results["cpu"], rel=1e-6)
    swapped = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("zero_stage_3/*/rank0"))
    assert len(swapped) == 2 and swapped[1] == "zero_stage_3/optimizer/rank0", swapped  # DeepSpeed's swap folders
