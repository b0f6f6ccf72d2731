"""no_save_optim (and checkpoint_validation_with_forward_pass, which every run here has on) on real DeepSpeed engines (two gloo ranks, bf16, ZeRO 0 and 1): the checkpoint holds the weights
and the LR schedule but no optimizer state, and a run resumed from it continues with the saved weights (its first
loss is the straight run's), the schedule where it was, a fresh optimizer whose fp32 master weights are the saved
16-bit weights, and a note saying so."""
import glob
import os
from types import SimpleNamespace

import pytest
import torch

from tests.checkpoint.test_resharding import GLOBAL_BATCH, SAVED_AT, STEPS, VOCAB, _args, _micro_batches
from tests.distributed_helpers import run_distributed

pytestmark = pytest.mark.slow

LAYOUTS = {"zero0": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=0, bf16={"enabled": True}),
           "zero1": dict(model_parallel_size=1, pipe_parallel_size=0, zero_stage=1, bf16={"enabled": True})}
"""bf16 without ZeRO trains through DeepSpeed's bf16 optimizer (fp32 master weights and Adam's state in its own
zero_pp_rank_* files), with ZeRO 1 through ZeRO's (its partitions)."""
TP2 = dict(model_parallel_size=2, pipe_parallel_size=0, zero_stage=1, bf16={"enabled": True})
"""Another split than the checkpoint's: its weights are resharded (megatron.checkpoint.resharding)."""
CLOSE_BF16 = 5e-4
"""bf16 sums in another order (tensor-parallel) round otherwise (tests/checkpoint/test_resharding.py)."""


def _master_weights_are_the_weights(engine) -> bool:
    """Whether every fp32 master weight, rounded to the training dtype, is the module's weight: DeepSpeed's unfused
    16-bit optimizer (bf16 without ZeRO on CPU) keeps them in fp32_groups beside fp16_groups, ZeRO behind
    safe_get_full_fp32_param."""
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        pairs = [(master, weight) for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups)
                 for master, weight in zip(masters, weights)]
    else:
        pairs = [(safe_get_full_fp32_param(p), p) for p in engine.module.parameters()]
    return bool(pairs) and all(torch.equal(master.to(weight.dtype), weight.detach()) for master, weight in pairs)


def _train(world: int, layout: dict, save: str, load, first_step: int) -> dict:
    """Steps first_step..STEPS (saving after SAVED_AT): their losses and learning rates, the iteration the run
    started from, and whether the optimizer's fp32 master weights were the loaded weights."""
    from megatron.checkpoint.engine import load_checkpoint, restore_rng, save_checkpoint
    from megatron.initialize import initialize_megatron
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training.checkpoint_validation import check_loaded_checkpoint
    from megatron.training.step import current_lr, train_step
    from megatron.training_schedule import TrainingSchedule

    args = _args(world, {**layout, "checkpoint_validation_with_forward_pass": True}, save, load)
    ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=VOCAB, eod=0))
    engine, optimizer, lr_scheduler = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    iteration, client, loaded = load_checkpoint(args, ctx.model_config, engine, ctx.checkpoint)
    validated = check_loaded_checkpoint(args, engine, ctx, loaded, client, is_logging_rank=True)
    restore_rng(args, loaded, client)
    masters = _master_weights_are_the_weights(engine) if loaded else None
    ps = ctx.parallel_state
    batches = _micro_batches(args, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), first_step)
    losses, lrs = [], []
    for step in range(first_step, STEPS + 1):
        lrs.append(current_lr(lr_scheduler))
        losses.append(train_step(args, engine, batches, ctx, optimizer)[0])
        if step == SAVED_AT and load is None:
            save_checkpoint(args, ctx.model_config, step, engine, {"consumed_train_samples": step * GLOBAL_BATCH})
    ps.destroy()
    return {"losses": losses, "lrs": lrs, "iteration": iteration, "masters": masters, "validated": validated,
            "saved_validation": client.get("checkpoint_validation_loss")}


def _runs(rank: int, world_size: int, root: str) -> dict:
    results = {}
    for name, layout in LAYOUTS.items():
        save = os.path.join(root, name)
        results[name] = _train(world_size, {**layout, "no_save_optim": True}, save, None, 1)
        results[f"{name}_resumed"] = _train(world_size, layout, save + "-resumed", save, SAVED_AT + 1)
    results["zero1_into_tp2"] = _train(world_size, TP2, os.path.join(root, "tp2"), os.path.join(root, "zero1"),
                                       SAVED_AT + 1)
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("weights_only"))
    return root, run_distributed(_runs, world_size=2, args=(root,), timeout_s=600)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_no_save_optim_checkpoint_holds_no_optimizer_state(runs, name):
    from megatron.checkpoint.files import load_checkpoint_file

    root, _ = runs
    path = os.path.join(root, name, f"global_step{SAVED_AT}")
    assert not glob.glob(os.path.join(path, "*optim_states.pt")), sorted(os.listdir(path))
    state = load_checkpoint_file(os.path.join(path, "mp_rank_00_model_states.pt"))
    assert state["optimizer"] is None and state["module"] and state["lr_scheduler"]["num_iters"] == SAVED_AT


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_run_resumes_its_weights_and_schedule_with_a_fresh_optimizer(runs, name):
    _, results = runs
    straight, resumed = results[name], results[f"{name}_resumed"]
    assert resumed["iteration"] == SAVED_AT and resumed["masters"] is True
    assert resumed["validated"] == resumed["saved_validation"]  # checkpoint_validation_with_forward_pass: exact
    assert resumed["losses"][0] == pytest.approx(straight["losses"][SAVED_AT], rel=1e-6), (resumed, straight)
    assert resumed["lrs"] == pytest.approx(straight["lrs"][SAVED_AT:], rel=1e-9)
    # Adam starting afresh takes another step than Adam with two steps' moments: the losses part
    assert resumed["losses"][1] != pytest.approx(straight["losses"][SAVED_AT + 1], rel=1e-6), (resumed, straight)


def test_a_weights_only_checkpoint_resumes_into_another_split_with_its_schedule(runs):
    _, results = runs
    straight, resumed = results["zero1"], results["zero1_into_tp2"]
    assert resumed["iteration"] == SAVED_AT and resumed["masters"] is True
    # checkpoint_validation_with_forward_pass passes in another split, within bf16's rounding
    assert resumed["validated"] == pytest.approx(resumed["saved_validation"], abs=CLOSE_BF16)
    assert resumed["losses"][0] == pytest.approx(straight["losses"][SAVED_AT], abs=CLOSE_BF16), (resumed, straight)
    assert resumed["lrs"] == pytest.approx(straight["lrs"][SAVED_AT:], rel=1e-9)


def test_no_save_optim_with_zero_3_is_refused():
    from tests.neox_arguments.helpers import problems_of

    assert "no_save_optim=true with ZeRO stage 3" in problems_of(no_save_optim=True, zero_optimization={"stage": 3})
