"""The sequence-length curriculum (megatron.data.curriculum): its lengths are DeepSpeed's CurriculumScheduler's step by
step, resume exactly (from the checkpoint's state, or replayed), and drive training: the training loop's own
helpers on two gloo ranks, without a pipeline and with two pipeline stages (whose engine must exchange the changing
activation shapes), and a resume from a real checkpoint. The cut batches themselves: tests/model/test_batch.py."""
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from megatron.data.curriculum import SeqlenCurriculum, curriculum_problems
from tests.distributed_helpers import run_distributed

LINEAR = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4, "max_difficulty": 16,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 4}}
ROOT = {**LINEAR, "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2, "root_degree": 2}}
DISCRETE = {**LINEAR, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [8, 16, 12], "max_step": [2, 4]}}
"""Not monotone: the scheduler stops at max_difficulty (16, step 3), so step 5 stays at 16 rather than 12."""
SCHEDULES = {"fixed_linear": LINEAR, "fixed_root": ROOT, "fixed_discrete": DISCRETE}
STEPS = 12


def _deepspeed_lengths(config: dict, steps: int) -> list:
    from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    scheduler = CurriculumScheduler(copy.deepcopy(config))
    return [scheduler.update_difficulty(step) for step in range(1, steps + 1)]


def _linear_root_formula(config: dict, step: int, degree: float) -> int:
    """DeepSpeed's documented fixed_root rule: min + (max - min) * (step / total) ** (1 / degree), floored to a
    multiple of difficulty_step (at least min rounded up to one), capped at max."""
    low, high, settings = config["min_difficulty"], config["max_difficulty"], config["schedule_config"]
    unit = settings["difficulty_step"]
    value = math.floor((step / settings["total_curriculum_step"]) ** (1 / degree) * (high - low) + low)
    value -= value % unit
    return min(max(value, -(-low // unit) * unit), high)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_length_of_each_step_is_deepspeeds(name):
    config = SCHEDULES[name]
    schedule = SeqlenCurriculum(config)
    lengths = [schedule.seqlen_for_step(step) for step in range(1, STEPS + 1)]
    assert lengths == _deepspeed_lengths(config, STEPS)
    if name == "fixed_discrete":
        assert lengths == [8, 8, 16, 16] + [16] * (STEPS - 4)
    else:
        degree = 1 if name == "fixed_linear" else config["schedule_config"]["root_degree"]
        assert lengths == [_linear_root_formula(config, step, degree) for step in range(1, STEPS + 1)]
        assert lengths[0] < 16 and lengths[-1] == 16 and lengths == sorted(lengths)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("stop", [0, 1, 3, 5])
def test_a_resumed_schedule_continues_as_the_uninterrupted_one(name, stop):
    config = SCHEDULES[name]
    whole = _deepspeed_lengths(config, STEPS)
    first = SeqlenCurriculum(config)
    for step in range(1, stop + 1):
        first.seqlen_for_step(step)
    state = first.state_dict()
    from_state, replayed = SeqlenCurriculum(config), SeqlenCurriculum(config)
    from_state.resume(stop, state)
    replayed.resume(stop)  # a checkpoint without the state (GPT-NeoX's)
    for resumed in (from_state, replayed):
        assert [resumed.seqlen_for_step(step) for step in range(stop + 1, STEPS + 1)] == whole[stop:]
    other = SeqlenCurriculum({**config, "max_difficulty": 12, "min_difficulty": 2})
    other.resume(stop, state)  # the schedule changed since the checkpoint: its lengths, not the saved ones
    assert [other.seqlen_for_step(s) for s in range(stop + 1, STEPS + 1)] == \
        _deepspeed_lengths(other.config, STEPS)[stop:]


def test_bad_sections_are_refused_naming_the_key():
    def problems(config, **kw):
        return " | ".join(curriculum_problems(config, kw.get("seq_length", 16), kw.get("train_impl", "normal"),
                                              kw.get("sp", False), kw.get("mp", 1)))

    assert all(curriculum_problems(c, 16, "normal") == [] for c in SCHEDULES.values())
    assert curriculum_problems({**LINEAR, "enabled": False, "max_difficulty": 99}, 16, "normal") == []
    assert "max_difficulty=32 is longer than seq_length=16" in problems({**LINEAR, "max_difficulty": 32})
    assert "min_difficulty=0 must be a positive integer" in problems({**LINEAR, "min_difficulty": 0})
    assert "curriculum_type='vocab'" in problems({**LINEAR, "curriculum_type": "vocab"})
    assert "train_impl='dpo'" in problems(LINEAR, train_impl="dpo")
    assert "'custom' needs a Python schedule function" in problems({**LINEAR, "schedule_type": "custom"})
    assert "schedule_config.difficulty_step=2.5 must be a positive integer" in problems(
        {**LINEAR, "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2.5}})
    assert "lacks root_degree" in problems({**ROOT, "schedule_config": LINEAR["schedule_config"]})
    assert "difficulty one longer than max_step" in problems(
        {**DISCRETE, "schedule_config": {"difficulty": [8, 16], "max_step": [2, 4]}})
    assert "every curriculum length must divide over model_parallel_size=4" in problems(ROOT, sp=True, mp=4)
    assert problems(LINEAR, sp=True, mp=4) == "" and problems(ROOT, mp=4) == ""


def test_the_config_accepts_the_section_and_refuses_curriculum_seqlen():
    from tests.neox_arguments.helpers import problems_of, tiny

    assert tiny(curriculum_learning={**LINEAR, "max_difficulty": 32}).curriculum_learning["max_difficulty"] == 32
    assert "curriculum_learning.max_difficulty=64 is longer than seq_length=32" in problems_of(
        curriculum_learning={**LINEAR, "max_difficulty": 64})
    assert "curriculum_seqlen is GPT-NeoX's run-time record" in problems_of(curriculum_seqlen=8)


# ---- the training loop's helpers on real engines ---------------------------------------------------------------
MICRO, VOCAB = 2, 128
TRAIN = {**DISCRETE, "schedule_config": {"difficulty": [8, 12, 16], "max_step": [1, 2]}}  # 8, 12, 16, 16
LAYOUTS = {"dp2": dict(pipe_parallel_size=0), "pp2": dict(pipe_parallel_size=2)}


def _args(world: int, layout: dict, **more):
    from megatron.neox_arguments import NeoXArgs

    return NeoXArgs.from_dict({
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
        "max_position_embeddings": 16, "pos_emb": "rotary", "make_vocab_size_divisible_by": 64,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "model_parallel_size": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1.0e-2}}, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1, "num_gpus": world, "train_iters": 4, "seed": 1234,
        "distributed_backend": "gloo", "curriculum_learning": TRAIN, **layout, **more})


class _Seen:
    """The batches a training step pulls, with the length of each."""

    def __init__(self, batches) -> None:
        self.batches, self.lengths = batches, []

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        self.lengths.append(batch[0][0].shape[1])
        return batch


def _train(args, samples, steps=None, before_first=None):
    """(losses, lengths per step, lengths the engine pulled, engine, ctx, schedule, start iteration) of `steps`
    steps (else up to train_iters) after the checkpoint `args.load` holds (if any), through megatron.training.loop's
    own helpers."""
    from megatron.checkpoint.engine import load_checkpoint
    from megatron.initialize import initialize_megatron
    from megatron.training.step import train_step
    from megatron.training.batches import ModelBatches, curriculum_step, start_curriculum
    from megatron.training.setup import setup_model_and_optimizer
    from megatron.training_schedule import TrainingSchedule

    ctx = initialize_megatron(args, build_tokenizer_fn=lambda _: SimpleNamespace(vocab_size=VOCAB, eod=0))
    engine, optimizer, _ = setup_model_and_optimizer(args, ctx, TrainingSchedule.from_neox_args(args))
    iteration, client_state, _ = load_checkpoint(args, ctx.model_config, engine, ctx.checkpoint)
    schedule = start_curriculum(args, engine, iteration, client_state)
    batches = ModelBatches(args, ctx, iter(samples))
    seen = _Seen(batches)
    losses, lengths = [], []
    if before_first is not None:
        before_first(engine, ctx)
    for step in range(iteration, args.train_iters if steps is None else iteration + steps):
        lengths.append(curriculum_step(schedule, batches, step))
        losses.append(train_step(args, engine, seen, ctx, optimizer)[0])
    return losses, lengths, seen.lengths, engine, ctx, schedule, iteration


def _curriculum_runs(rank: int, world_size: int, directory: str):
    from megatron.checkpoint.engine import save_checkpoint
    from megatron.training.state import TrainState, run_state

    samples = [{"text": torch.randint(0, VOCAB, (MICRO, 17), generator=torch.Generator().manual_seed(50 + i))}
               for i in range(4)]
    results, first_loss = {}, {}

    def untrained_loss(engine, ctx):  # the first step's loss, from the model on the cut batch itself
        from megatron.model.batch import masks_and_position_ids

        tokens, labels = samples[0]["text"][:, :8], samples[0]["text"][:, 1:9]
        mask, loss_mask, pos = masks_and_position_ids(tokens, 0, False)
        with torch.no_grad():
            first_loss["direct"] = float(engine.module.loss_fn(engine.module((tokens, pos, mask)),
                                                               (labels, loss_mask)))

    for name, layout in LAYOUTS.items():
        args = _args(world_size, layout)
        losses, lengths, pulled, engine, ctx, schedule, _ = _train(
            args, samples, before_first=untrained_loss if name == "dp2" else None)
        results[name] = (losses, lengths, pulled)
        ctx.parallel_state.destroy()
    # stop after step 2 with a checkpoint, then resume from it in a new engine
    args = _args(world_size, LAYOUTS["dp2"], save=directory)
    losses, _, _, engine, ctx, schedule, _ = _train(args, samples[:2], steps=2)
    save_checkpoint(args, ctx.model_config, 2, engine,
                    run_state(TrainState(iteration=2, consumed_train_samples=2 * MICRO * world_size), schedule))
    ctx.parallel_state.destroy()
    resumed_args = _args(world_size, LAYOUTS["dp2"], load=directory)
    losses, lengths, pulled, _, ctx, _, start = _train(resumed_args, samples[2:])
    ctx.parallel_state.destroy()
    results["resumed"] = (losses, lengths, pulled, start)
    return results, first_loss["direct"]


def test_training_steps_use_the_curriculum_length_with_and_without_a_pipeline_and_resume(tmp_path):
    ranks = run_distributed(_curriculum_runs, world_size=2, args=(str(tmp_path),), timeout_s=300)
    (results, direct), (other, _) = ranks
    want = _deepspeed_lengths(TRAIN, 4)
    assert want == [8, 12, 16, 16]
    for name in LAYOUTS:
        losses, lengths, pulled = results[name]
        assert lengths == want and pulled == want, name  # one micro-batch per step on each rank
        assert losses == other[name][0], f"{name}: every rank reports the data-parallel mean"
    assert results["dp2"][0][0] == pytest.approx(direct, rel=1e-5)  # step 1 trained on the first 8 tokens
    assert results["pp2"][0] == pytest.approx(results["dp2"][0], rel=1e-4)  # shapes change between the stages
    losses, lengths, pulled, start = results["resumed"]
    assert start == 2 and lengths == want[2:] and pulled == want[2:]
    assert losses == pytest.approx(results["dp2"][0][2:], rel=1e-5)
