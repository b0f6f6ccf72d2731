"""AnnealingLR: hand-computed rates at key iterations for every decay style, lr_mult, checkpoint rules."""

import math

import pytest
import torch

from megatron.learning_rates import AnnealingLR, build_lr_scheduler, decay_iterations
from tests.neox_arguments.helpers import tiny

ADAM = {"type": "Adam", "params": {"lr": 1.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}}


def _optimizer(lr_mults=(1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr_mult": m} for m in lr_mults]
    return torch.optim.SGD(groups, lr=0.0)


def _scheduler(style: str, **overrides) -> AnnealingLR:
    values = {"optimizer": ADAM, "train_iters": 100, "warmup": 0.1, "lr_decay_style": style, "min_lr": 1.0e-4}
    args = tiny(**{**values, **overrides})
    return build_lr_scheduler(args, _optimizer())


def _lr_at(sched: AnnealingLR, iteration: int) -> float:
    sched.step(iteration)
    return sched.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential"])
def test_warmup_is_linear_from_zero_over_warmup_times_decay_iters(style):
    sched = _scheduler(style)  # W = 0.1 x 100 = 10
    assert sched.warmup_iter == 10.0 and sched.end_iter == 100
    assert _lr_at(sched, 0) == 0.0
    assert _lr_at(sched, 1) == pytest.approx(1.0e-4)  # 1e-3 * 1 / 10
    assert _lr_at(sched, 5) == pytest.approx(5.0e-4)
    assert _lr_at(sched, 10) == pytest.approx(1.0e-3)


def test_constant():
    sched = _scheduler("constant")
    assert [_lr_at(sched, i) for i in (11, 55, 100, 500)] == [pytest.approx(1e-3)] * 4


def test_linear_decays_to_min_lr():
    sched = _scheduler("linear")
    # p = (it - 10) / 90; lr = 1e-4 + 9e-4 * (1 - p)
    assert _lr_at(sched, 55) == pytest.approx(1e-4 + 9e-4 * 0.5)  # p = 0.5 -> 5.5e-4
    assert _lr_at(sched, 28) == pytest.approx(1e-4 + 9e-4 * 0.8)  # p = 0.2 -> 8.2e-4
    assert _lr_at(sched, 100) == pytest.approx(1e-4)
    assert _lr_at(sched, 1000) == pytest.approx(1e-4)  # stays at min_lr after T


def test_cosine():
    sched = _scheduler("cosine")
    # lr = 1e-4 + 9e-4 * (1 + cos(pi p)) / 2
    assert _lr_at(sched, 55) == pytest.approx(5.5e-4)  # cos(pi/2) = 0
    assert sched.get_lr(32.5) == pytest.approx(1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2)  # p = 0.25
    assert _lr_at(sched, 100) == pytest.approx(1e-4)
    assert _lr_at(sched, 400) == pytest.approx(1e-4)  # no cosine rebound after T


def test_exponential_halves_and_is_floored():
    sched = _scheduler("exponential")
    assert _lr_at(sched, 55) == pytest.approx(1e-3 * 0.5**0.5)  # 7.0711e-4
    assert _lr_at(sched, 100) == pytest.approx(5e-4)
    floored = _scheduler("exponential", min_lr=8e-4)
    assert _lr_at(floored, 100) == pytest.approx(8e-4)  # 5e-4 < min_lr


def test_lr_decay_iters_and_fraction_set_the_decay_length():
    args = tiny(optimizer=ADAM, train_iters=100, lr_decay_iters=40, warmup=0.25)
    sched = build_lr_scheduler(args, _optimizer())
    assert (decay_iterations(args), sched.warmup_iter) == (40, 10.0)
    assert _lr_at(sched, 25) == pytest.approx(5e-4)  # linear to 0: p = 15/30
    args = tiny(optimizer=ADAM, train_iters=100, lr_decay_fraction=0.5, warmup=0.0)
    sched = build_lr_scheduler(args, _optimizer())
    assert sched.end_iter == 50 and _lr_at(sched, 0) == pytest.approx(1e-3)  # no warmup
    assert _lr_at(sched, 25) == pytest.approx(5e-4)


def test_step_advances_by_one_and_lr_mult_scales_each_group():
    args = tiny(optimizer=ADAM, train_iters=100, warmup=0.1)
    opt = _optimizer(lr_mults=(1.0, 0.5))
    sched = build_lr_scheduler(args, opt)
    for _ in range(5):
        sched.step()
    assert sched.num_iters == 5
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(5e-4), pytest.approx(2.5e-4)]
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_missing_train_iters_and_lr_are_errors():
    with pytest.raises(ValueError, match="train_iters"):
        build_lr_scheduler(tiny(optimizer=ADAM), _optimizer())
    with pytest.raises(ValueError, match="learning rate"):
        build_lr_scheduler(tiny(train_iters=10), _optimizer())


def test_checkpoint_round_trip_restores_progress():
    sched = _scheduler("cosine")
    sched.step(42)
    fresh = _scheduler("cosine")
    fresh.load_state_dict(sched.state_dict())
    assert fresh.num_iters == 42 and fresh.get_last_lr() == sched.get_last_lr()


def test_mismatched_checkpoint_is_an_error_naming_the_options():
    saved = _scheduler("cosine").state_dict()
    with pytest.raises(ValueError, match="decay_style.*override_lr_scheduler.*use_checkpoint_lr_scheduler"):
        _scheduler("linear").load_state_dict(saved)


def test_override_keeps_config_and_use_checkpoint_takes_checkpoint():
    saved = _scheduler("cosine")
    saved.step(55)
    state = saved.state_dict()
    override = _scheduler("linear", override_lr_scheduler=True, min_lr=0.0)
    override.load_state_dict(state)
    assert override.decay_style == "linear" and override.num_iters == 55
    assert override.get_last_lr()[0] == pytest.approx(5e-4)  # linear to 0 at p = 0.5
    use_ckpt = _scheduler("linear", use_checkpoint_lr_scheduler=True, min_lr=0.0)
    use_ckpt.load_state_dict(state)
    assert use_ckpt.decay_style == "cosine" and use_ckpt.min_lr == 1e-4
    assert use_ckpt.get_last_lr()[0] == pytest.approx(5.5e-4)


def test_both_checkpoint_flags_is_an_error():
    with pytest.raises(ValueError, match="both true"):
        _scheduler("linear", override_lr_scheduler=True, use_checkpoint_lr_scheduler=True)


def test_drives_a_real_optimizer():
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=0.0)
    sched = AnnealingLR(opt, start_lr=0.5, warmup_iter=2, total_iters=4, decay_style="linear")
    for _ in range(2):  # steps taken at lr 0 then lr 0.25 (schedule after step 1)
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert param.item() == pytest.approx(1.0 - 0.25)
