"""Checks deepy.py runs before any worker starts (megatron/launch/prelaunch.py): pairwise data whose
chosen and rejected files do not pair up, and missing pos_/neg_ / reward files."""

import subprocess
import sys
from pathlib import Path

import numpy as np

from megatron.launch.prelaunch import data_problems
from tests.data.dataset_factory import write_dataset
from tests.neox_arguments.helpers import tiny

REPO = Path(__file__).resolve().parents[2]


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


def test_the_launcher_imports_no_torch():
    """deepy.py answers --help and refuses a bad config in a fraction of a second: what it imports (the config, the
    pre-launch checks, the autotuner's and signals' launcher side) needs neither torch nor DeepSpeed."""
    code = ("import sys, importlib.util; sys.argv = ['deepy.py']; "
            "spec = importlib.util.spec_from_file_location('deepy', 'deepy.py'); "
            "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "heavy = [m for m in ('torch', 'deepspeed', 'lm_eval', 'transformers') if m in sys.modules]; "
            "sys.exit(f'deepy.py imported {heavy}' if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
