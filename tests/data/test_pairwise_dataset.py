"""dataset_impl 'pairwise': aligned chosen / rejected samples from pos_/neg_ paths, allow_chopped, and the
errors for data that does not pair up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron.data.data_utils import build_train_valid_test_datasets
from megatron.errors import ConfigError, DataError
from megatron.data.pairwise_dataset import as_text_and_labels
from megatron.training_schedule import TrainingSchedule
from tests.data.dataset_factory import write_dataset
from tests.neox_arguments.helpers import tiny

SEQ = 8


def pairs(tmp_path: Path, n: int = 12, long_every: int = 4):
    """Pair k: chosen tokens all 1000 + k, rejected all 2000 + k; every `long_every`-th pair too long to fit."""
    lengths = [SEQ + 4 if k % long_every == 0 else 3 + k % 5 for k in range(n)]
    pos = write_dataset(tmp_path / "pos", [np.full(m, 1000 + k) for k, m in enumerate(lengths)])
    neg = write_dataset(tmp_path / "neg", [np.full(m - 1, 2000 + k) for k, m in enumerate(lengths)])
    pos_label = write_dataset(tmp_path / "pos_label", [np.r_[[-100] * 2, np.full(m - 2, 1000 + k)]
                                                      for k, m in enumerate(lengths)])
    neg_label = write_dataset(tmp_path / "neg_label", [np.r_[[-100] * 2, np.full(m - 3, 2000 + k)]
                                                      for k, m in enumerate(lengths)])
    return pos, neg, pos_label, neg_label


def config(pos, neg, pos_label=None, neg_label=None, **extra):
    return {**dict(dataset_impl="pairwise", train_impl="dpo", pack_impl="unpacked", seq_length=SEQ, train_iters=10,
                   train_batch_size=2, train_micro_batch_size_per_gpu=2, pos_train_data_paths=[pos],
                   neg_train_data_paths=[neg], **({"pos_train_label_data_paths": [pos_label],
                                                    "neg_train_label_data_paths": [neg_label]} if pos_label else {})),
            **extra}


def datasets(**cfg):
    args = tiny(**cfg)
    return build_train_valid_test_datasets(args, TrainingSchedule.from_neox_args(args).split_samples())


@pytest.mark.parametrize("allow_chopped", [True, False])
def test_samples_are_aligned_pairs(tmp_path: Path, allow_chopped: bool, capsys) -> None:
    train, valid, test = datasets(**config(*pairs(tmp_path), allow_chopped=allow_chopped))
    assert valid is None and test is None and len(train) >= 20
    seen = set()
    for i in range(len(train)):
        s = train[i]
        assert set(s) == {"pos", "neg", "pos_label", "neg_label"} and all(v.shape == (SEQ + 1,) for v in s.values())
        k = int(s["pos"][0]) - 1000
        seen.add(k)
        assert int(s["neg"][0]) == 2000 + k and s["pos_label"][:2].tolist() == [-100, -100]
        for key in ("pos", "neg", "pos_label", "neg_label"):
            real = s[key][s[key] != -100]
            assert set(real.tolist()) <= {1000 + k, 2000 + k}
    long_pairs = {k for k in range(12) if k % 4 == 0}
    if allow_chopped:
        assert long_pairs <= seen
    else:
        assert not seen & long_pairs and len(seen) == 9
        assert "left out 3 of 12 pairs" in capsys.readouterr().out
    batch = as_text_and_labels({k: torch.as_tensor(np.stack([train[0][k], train[1][k]])) for k in train[0]})
    assert batch["text"].shape == (4, SEQ + 1) and torch.equal(batch["text"][2], torch.as_tensor(train[0]["neg"]))
    assert torch.equal(batch["label"][3], torch.as_tensor(train[1]["neg_label"]))


def test_pairs_that_do_not_pair_up(tmp_path: Path) -> None:
    pos, neg, pos_label, neg_label = pairs(tmp_path)
    short = write_dataset(tmp_path / "short", [np.full(3, 5)] * 5)
    with pytest.raises(DataError, match="has 12 sequences but the rejected .* has 5"):
        datasets(**config(pos, short))
    with pytest.raises(DataError, match="not aligned"):
        datasets(**config(pos, neg, neg_label, pos_label))
    with pytest.raises(ConfigError, match="pos_train_data_paths is set but neg_train_data_paths is not"):
        tiny(**{**config(pos, neg), "neg_train_data_paths": None})
    with pytest.raises(ConfigError, match="set pack_impl: unpacked"):
        tiny(**config(pos, neg, pack_impl="packed"))
    with pytest.raises(ConfigError, match="set dataset_impl: pairwise"):
        tiny(**{**config(pos, neg), "dataset_impl": "gpt2", "pos_train_data_paths": None,
                "neg_train_data_paths": None, "data_path": pos})
    assert tiny(**config(pos, neg, pipe_parallel_size=2, num_gpus=2)).pipe_parallel_size == 2  # DPO in a pipeline
    assert tiny(**config(pos, neg, zero_optimization={"stage": 3})).zero_stage == 3  # tests/post_training/test_zero3
