"""Checks deepy.py runs before any worker starts (megatron/neox_arguments/prelaunch.py): pairwise data whose
chosen and rejected files do not pair up, and missing pos_/neg_ / reward files."""

from pathlib import Path

import numpy as np

from megatron.neox_arguments.prelaunch import data_problems
from tests.data.dataset_factory import write_dataset
from tests.neox_arguments.helpers import tiny


def test_pairwise_files_are_checked_before_launch(tmp_path: Path) -> None:
    pos = write_dataset(tmp_path / "pos", [np.arange(4)] * 6)
    neg = write_dataset(tmp_path / "neg", [np.arange(4)] * 6)
    short = write_dataset(tmp_path / "short", [np.arange(4)] * 5)
    pairwise = dict(dataset_impl="pairwise", train_impl="dpo", pack_impl="unpacked", train_iters=2)
    assert data_problems(tiny(**pairwise, pos_train_data_paths=[pos], neg_train_data_paths=[neg])) == []
    (problem,) = data_problems(tiny(**pairwise, pos_train_data_paths=[pos], neg_train_data_paths=[short]))
    assert "has 6 sequences but neg_train_data_paths" in problem and "has 5" in problem
    (missing,) = data_problems(tiny(**pairwise, pos_train_data_paths=[pos],
                                    neg_train_data_paths=[str(tmp_path / "nothing")]))
    assert missing.startswith("neg_train_data_paths:") and "not found" in missing
