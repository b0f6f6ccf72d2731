"""checkpoint_validation_with_forward_pass's decision after a load (the loss itself on real engines:
tests/checkpoint/test_weights_only.py; through deepy.py: tests/e2e/test_train.py's exact resume)."""
import pytest

import megatron.training.checkpoint_validation as validation
from megatron.errors import CheckpointError
from megatron.training.checkpoint_validation import VALIDATION_KEY, check_loaded_checkpoint
from tests.neox_arguments.helpers import RM_ARGS, problems_of, tiny

PATH = "ckpt/global_step4"


def _check(monkeypatch, saved, reloaded, **settings):
    monkeypatch.setattr(validation, "validation_loss", lambda *_: reloaded)
    args = tiny(checkpoint_validation_with_forward_pass=True, **settings)
    client = {} if saved is None else {VALIDATION_KEY: saved}
    return check_loaded_checkpoint(args, None, None, PATH, client, is_logging_rank=True)


def test_the_saved_loss_reproduced_passes_and_says_how_closely(monkeypatch, capsys):
    assert _check(monkeypatch, 4.25, 4.25) == 4.25
    assert "reproduces its saved loss 4.250000 on the fixed sequence exactly" in capsys.readouterr().out
    assert _check(monkeypatch, 4.25, 4.25 * (1 + 5e-5)) == pytest.approx(4.25 * (1 + 5e-5))
    assert "to a relative 5e-05 (allowed 0.0001)" in capsys.readouterr().out
    assert _check(monkeypatch, 4.25, 4.3, bf16={"enabled": True}) == 4.3  # 16-bit rounds more


@pytest.mark.parametrize("reloaded", [4.5, float("nan")])
def test_another_loss_is_a_checkpoint_error_naming_both(monkeypatch, reloaded):
    with pytest.raises(CheckpointError, match=rf"checkpoint {PATH} does not reproduce its saved loss .*: saved 4.25, "
                                              rf"after loading {reloaded!r} .*allowed 0.0001 in fp32"):
        _check(monkeypatch, 4.25, reloaded)


def test_a_checkpoint_without_the_loss_is_loaded_with_a_note(monkeypatch, capsys):
    assert _check(monkeypatch, None, 1.0) is None
    assert f"checkpoint {PATH} holds no validation loss" in capsys.readouterr().out


def test_off_or_nothing_loaded_checks_nothing(monkeypatch):
    monkeypatch.setattr(validation, "validation_loss", lambda *_: pytest.fail("computed"))
    assert check_loaded_checkpoint(tiny(), None, None, PATH, {VALIDATION_KEY: 1.0}, True) is None
    assert check_loaded_checkpoint(tiny(checkpoint_validation_with_forward_pass=True), None, None, None, {}, True) \
        is None


def test_preference_objectives_are_refused():
    assert "checkpoint_validation_with_forward_pass with train_impl='rm' is not supported yet" in problems_of(
        checkpoint_validation_with_forward_pass=True, **RM_ARGS)
