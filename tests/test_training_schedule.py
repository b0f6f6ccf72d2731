"""TrainingSchedule: iterations from train_epochs, decay and warmup lengths, save steps and split sizes, all
computed once from a validated config that is never changed; and the fp16 overflow guard."""

import dataclasses

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.training_schedule import OverflowGuard, TrainingSchedule, checkpoint_iterations, iterations_for_epochs
from tests.neox_arguments.helpers import tiny


def write_dataset(prefix, doc_lengths):
    builder = MMapIndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for length in doc_lengths:
        builder.add_item(np.arange(length, dtype=np.uint16) % 100)
        builder.end_document()
    builder.finalize()
    return str(prefix)


def test_epochs_count_the_training_split_only(tmp_path):
    prefix = write_dataset(tmp_path / "d", [100] * 10)  # 1000 tokens, 10 documents
    args = tiny(data_path=prefix, split="8,1,1", train_epochs=3, seq_length=32, max_position_embeddings=32)
    # train split: 8 documents = 800 tokens = 25 samples of 32; 3 epochs = 75 samples; batch 2 -> 38 iterations
    assert iterations_for_epochs(args) == 38
    before = args.to_dict()
    assert TrainingSchedule.from_neox_args(args).train_iters == 38
    assert args.to_dict() == before and args.train_iters is None  # the config is never changed


def test_epochs_over_separate_training_files_and_derived_schedule(tmp_path):
    a = write_dataset(tmp_path / "a", [64, 64])
    b = write_dataset(tmp_path / "b", [128])
    args = tiny(train_data_paths=[a, b], valid_data_paths=[a], test_data_paths=[b], train_epochs=1,
                seq_length=32, max_position_embeddings=32, checkpoint_factor=3, lr_decay_fraction=0.5, warmup=0.5)
    schedule = TrainingSchedule.from_neox_args(args)
    assert schedule.train_iters == 4  # 256 tokens / 32 = 8 samples / batch 2
    assert (schedule.save_iters, schedule.decay_iters, schedule.warmup_iters) == ((3,), 2, 1.0)


def test_decay_length_rules():
    def decay(**kw):
        return TrainingSchedule.from_neox_args(tiny(train_iters=100, **kw)).decay_iters

    assert decay() == 100
    assert decay(lr_decay_iters=40) == 40
    assert decay(lr_decay_fraction=0.25) == 25
    assert decay(lr_decay_iters=40, lr_decay_fraction=0.25) == 25  # the fraction "overrides lr_decay_iters"
    assert decay(lr_decay_fraction=0.001) == 1  # at least one iteration


def test_checkpoint_iterations_linear_log_and_extra():
    assert checkpoint_iterations(10, "linear", None, 35) == (10, 20, 30)
    assert checkpoint_iterations(2, "log", [3, 100], 20) == (2, 3, 4, 8, 16)
    schedule = TrainingSchedule.from_neox_args(tiny(train_iters=25, checkpoint_factor=10, extra_save_iters=[5]))
    assert schedule.save_iters == (5, 10, 20)


def test_split_samples_follow_gpt_neox():
    schedule = TrainingSchedule.from_neox_args(tiny(train_iters=100, train_batch_size=8, eval_iters=5,
                                                    eval_interval=30, num_gpus=4))
    assert schedule.split_samples() == (800, (100 // 30 + 1) * 5 * 8, 40)


def test_frozen():
    schedule = TrainingSchedule.from_neox_args(tiny(train_iters=10))
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule.train_iters = 11


def test_needs_iterations_or_epochs_and_enough_data(tmp_path):
    with pytest.raises(ValueError, match="train_iters, train_samples or train_epochs"):
        TrainingSchedule.from_neox_args(tiny())
    prefix = write_dataset(tmp_path / "small", [10])
    with pytest.raises(ValueError, match="less than one sample"):
        iterations_for_epochs(tiny(data_path=prefix, split="1", train_epochs=1))


def test_overflow_guard_stops_after_the_limit_in_a_row():
    guard = OverflowGuard(limit=3)
    for it, skipped in enumerate([True, True, False, True, True], start=1):
        guard.record(skipped, it)
    assert guard.total == 4 and guard.in_a_row == 2
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        guard.record(True, 6)


def test_train_samples_give_the_iterations_rounded_up():
    args = tiny(train_samples=9, train_micro_batch_size_per_gpu=2, lr_decay_fraction=0.5, lr_warmup_iters=1)
    schedule = TrainingSchedule.from_neox_args(args)
    assert (schedule.train_iters, schedule.decay_iters, schedule.warmup_iters) == (5, 2, 1.0)  # ceil(9 / 2)
    assert args.train_iters is None and schedule.split_samples()[0] == 10


def test_batch_rampup_follows_megatron_and_counts_the_iterations_of_train_samples():
    """[4, 4, 24] toward 12: two increments of 4, one every 24 / 2 = 12 samples consumed."""
    from megatron.training_schedule import BatchRampup

    ramp = BatchRampup(start=4, increment=4, samples=24, global_batch=12)
    assert [ramp.batch_size(c) for c in (0, 4, 8, 11, 12, 20, 23, 24, 28, 1000)] == [4, 4, 4, 4, 8, 8, 8, 12, 12, 12]
    consumed, sizes = 0, []
    for _ in range(ramp.iterations_for(76)):
        sizes.append(ramp.batch_size(consumed))
        consumed += sizes[-1]
    assert sizes == [4, 4, 4, 8, 8, 12, 12, 12, 12] and consumed == 76  # 28 in the ramp, then 48 = 4 x 12
    assert ramp.iterations_for(77) == 10 and BatchRampup(12, 4, 24, 12).batch_size(0) == 12


def test_rampup_schedule_spans_the_samples_in_full_batch_iterations():
    args = tiny(train_samples=76, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3,
                rampup_batch_size=[4, 4, 24], lr_warmup_iters=2)
    schedule = TrainingSchedule.from_neox_args(args)
    assert (schedule.train_iters, schedule.length, schedule.decay_iters, schedule.warmup_iters) == (9, 7, 7, 2.0)
    assert [schedule.batch_size_at(c) for c in (0, 12, 24)] == [4, 8, 12]
