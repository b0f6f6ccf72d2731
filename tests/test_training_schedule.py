import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.training_schedule import OverflowGuard, iterations_for_epochs, resolve_train_iters
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
    assert resolve_train_iters(args) == 38 and args.train_iters == 38


def test_epochs_over_separate_training_files_and_derived_schedule(tmp_path):
    a = write_dataset(tmp_path / "a", [64, 64])
    b = write_dataset(tmp_path / "b", [128])
    args = tiny(train_data_paths=[a, b], valid_data_paths=[a], test_data_paths=[b], train_epochs=1,
                seq_length=32, max_position_embeddings=32, checkpoint_factor=3, lr_decay_fraction=0.5)
    assert resolve_train_iters(args) == 4  # 256 tokens / 32 = 8 samples / batch 2
    assert args.save_iters == [3] and args.lr_decay_iters == 2


def test_too_little_data_for_one_sample(tmp_path):
    prefix = write_dataset(tmp_path / "small", [10])
    args = tiny(data_path=prefix, split="1", train_epochs=1)
    with pytest.raises(ValueError, match="less than one sample"):
        iterations_for_epochs(args)


def test_overflow_guard_stops_after_the_limit_in_a_row():
    guard = OverflowGuard(limit=3)
    for it, skipped in enumerate([True, True, False, True, True], start=1):
        guard.record(skipped, it)
    assert guard.total == 4 and guard.in_a_row == 2
    with pytest.raises(FloatingPointError, match="3 optimizer steps in a row"):
        guard.record(True, 6)
