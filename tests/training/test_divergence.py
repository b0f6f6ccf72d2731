"""A run that diverges (issue 32, item 17): a non-finite loss, or fp16 overflow step after step, stops train.py with
one error line, no traceback, and exit status 3 (megatron.errors.EXIT_DIVERGED), which deepy.py passes on."""

from types import SimpleNamespace

import pytest

import train
from megatron.errors import EXIT_DIVERGED, TrainingDiverged
from megatron.neox_arguments import NeoXArgs
from megatron.training.loop import _TrainingRun
from megatron.training_schedule import OverflowGuard
from tests.neox_arguments.helpers import tiny


def _run_at(iteration: int) -> SimpleNamespace:
    """The parts of a _TrainingRun that count_step reads."""
    return SimpleNamespace(state=SimpleNamespace(iteration=iteration, consumed_train_samples=0), background=None,
                           overflow=OverflowGuard(limit=2), memory_profiler=None, summary={"losses": []})


def _main_raising(monkeypatch, error: BaseException) -> int:
    monkeypatch.setattr(NeoXArgs, "consume_neox_args", classmethod(lambda cls: tiny()))

    def pretrain(args):
        raise error

    monkeypatch.setattr("megatron.training.loop.pretrain", pretrain)
    return train.main()


@pytest.mark.fault
@pytest.mark.parametrize("loss", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_train_py_with_one_line_and_exit_3(monkeypatch, capsys, loss):
    with pytest.raises(TrainingDiverged) as caught:
        _TrainingRun.count_step(_run_at(4), loss, False, 2, False)
    assert _main_raising(monkeypatch, caught.value) == EXIT_DIVERGED == 3
    err = capsys.readouterr().err
    assert err == (f"error: training diverged at iteration 5: the loss is {loss}; lower lr or check the data (the "
                   f"last checkpoint in save, if any, is from before this step; relaunching resumes there)\n"), err


@pytest.mark.fault
def test_fp16_overflow_without_end_stops_the_same_way(monkeypatch, capsys):
    run = _run_at(0)
    _TrainingRun.count_step(run, 2.0, True, 2, False)
    with pytest.raises(TrainingDiverged) as caught:
        _TrainingRun.count_step(run, 2.0, True, 2, False)
    assert _main_raising(monkeypatch, caught.value) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: training diverged at iteration 2: 2 optimizer steps in a row were skipped") and \
        "Traceback" not in err
