"""AnnealingLR: GPT-NeoX's closed forms step by step for every decay style, hand-computed rates at key
iterations, the hold after the decay, lr_mult, checkpoint rules, and the step-to-rate alignment under a
real DeepSpeed engine."""

import itertools
import math

import pytest
import torch

from megatron.optim.learning_rates import CHECKED_KEYS, AnnealingLR
from megatron.optim.learning_rates import build_lr_scheduler as _build
from megatron.training_schedule import TrainingSchedule
from tests.distributed_helpers import run_distributed
from tests.neox_arguments.helpers import tiny

ADAM = {"type": "Adam", "params": {"lr": 1.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8}}


def _optimizer(lr_mults=(1.0,)) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr_mult": m} for m in lr_mults]
    return torch.optim.SGD(groups, lr=0.0)


def build_lr_scheduler(args, optimizer) -> AnnealingLR:
    """The scheduler of a config, with its decay and warmup lengths from the run's TrainingSchedule."""
    return _build(args, TrainingSchedule.from_neox_args(args), optimizer)


def _scheduler(style: str, **overrides) -> AnnealingLR:
    values = {"optimizer": ADAM, "train_iters": 100, "warmup": 0.1, "lr_decay_style": style, "min_lr": 1.0e-4}
    args = tiny(**{key: value for key, value in {**values, **overrides}.items() if value is not None})  # None: unset
    return build_lr_scheduler(args, _optimizer())


def _lr_at(sched: AnnealingLR, iteration: int) -> float:
    sched.step(iteration)
    return sched.optimizer.param_groups[0]["lr"]


def _gpt_neox_lr(it: float, lr: float, min_lr: float, warmup_iters: float, decay_iters: int, style: str) -> float:
    """GPT-NeoX's AnnealingLR.get_lr (megatron/learning_rates.py, after its #1379) as closed forms, for
    0 <= it <= decay_iters: n iterations into a decay of e iterations."""
    if warmup_iters > 0 and it <= warmup_iters:
        return lr * max(1, it) / warmup_iters
    n, e = it - warmup_iters, decay_iters - warmup_iters
    if style == "linear":
        value = lr * (e - n) / e
    elif style == "cosine":
        value = min_lr + (lr - min_lr) / 2.0 * (math.cos(math.pi * n / e) + 1)
    elif style == "exponential":
        value = lr * math.exp(-0.693 * n / e)
    else:
        value = lr
    return max(value, min_lr)


def _expected(it: int, lr: float, min_lr: float, warmup_iters: float, decay_iters: int, style: str) -> float:
    """GPT-NeoX's value up to the end of the decay, that of its last iteration after it; warmup capped at lr
    (only 0 < W < 1 at iteration 0 reaches past it)."""
    value = _gpt_neox_lr(min(it, decay_iters), lr, min_lr, warmup_iters, decay_iters, style)
    return min(value, lr) if warmup_iters > 0 and it <= warmup_iters else value


CLOSED_FORM_CASES = list(itertools.product(
    ["constant", "linear", "cosine", "exponential"],
    # (train_iters, warmup): W = 0, 10, 3.7, 10, 20 (all warmup), 0.5 (the capped case)
    [(100, 0.0), (100, 0.1), (37, 0.1), (40, 0.25), (20, 1.0), (100, 0.005)],
    [0.0, 1.0e-4, 6.0e-4],  # 6e-4 > lr * exp(-0.693): the exponential ends on min_lr; linear reaches it early
))


@pytest.mark.parametrize("style,iters_and_warmup,min_lr", CLOSED_FORM_CASES)
def test_every_step_equals_gpt_neox_closed_forms_then_holds(style, iters_and_warmup, min_lr):
    """Driven by step() as DeepSpeed drives it, from the scheduler as built (iteration 0, the rate of the
    first optimizer step) through the end of the decay and 30 iterations past it, in both lr_mult groups."""
    train_iters, warmup = iters_and_warmup
    args = tiny(optimizer=ADAM, train_iters=train_iters, warmup=warmup, lr_decay_style=style, min_lr=min_lr)
    opt = _optimizer(lr_mults=(1.0, 0.5))
    sched = build_lr_scheduler(args, opt)
    warmup_iters = warmup * train_iters
    for it in range(train_iters + 31):
        if it:
            sched.step()
        want = _expected(it, 1.0e-3, min_lr, warmup_iters, train_iters, style)
        assert sched.num_iters == it
        assert math.isclose(opt.param_groups[0]["lr"], want, rel_tol=1e-9, abs_tol=0.0), (it, want)
        assert math.isclose(opt.param_groups[1]["lr"], 0.5 * want, rel_tol=1e-9, abs_tol=0.0), (it, want)
        if it <= train_iters and not (0 < warmup_iters < 1 and it == 0):  # GPT-NeoX's own value up to T
            assert math.isclose(sched.get_lr(), _gpt_neox_lr(it, 1.0e-3, min_lr, warmup_iters, train_iters, style),
                                rel_tol=1e-9, abs_tol=0.0)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential"])
def test_warmup_shorter_than_one_iteration_is_capped_at_lr(style):
    sched = _scheduler(style, warmup=0.005, min_lr=0.0)  # W = 0.5: GPT-NeoX gives lr * 1 / 0.5 = 2 lr at 0
    assert sched.warmup_iter == 0.5
    assert _lr_at(sched, 0) == 1.0e-3
    after = {"constant": 1.0e-3, "linear": 1.0e-3 * (1 - 0.5 / 99.5),
             "cosine": 1.0e-3 * (1 + math.cos(math.pi * 0.5 / 99.5)) / 2,
             "exponential": 1.0e-3 * math.exp(-0.693 * 0.5 / 99.5)}
    assert _lr_at(sched, 1) == pytest.approx(after[style], rel=1e-12)


def test_after_the_decay_holds_where_gpt_neox_cosine_rises_and_exponential_falls():
    """The documented difference: GPT-NeoX's formulas run on past T (cosine back up toward lr, exponential
    down to min_lr); this schedule stays at its value at T. Constant and linear agree with GPT-NeoX there."""
    for style in ("constant", "linear", "cosine", "exponential"):
        sched = _scheduler(style)  # W = 10, T = 100, min_lr = 1e-4
        at_end = _lr_at(sched, 100)
        assert [_lr_at(sched, it) for it in (101, 150, 190, 1000)] == [at_end] * 4
    neox = lambda it, style: _gpt_neox_lr(it, 1e-3, 1e-4, 10.0, 100, style)  # noqa: E731
    assert neox(190, "cosine") == pytest.approx(1e-3)  # p = 2: cos(2 pi) = 1, back to lr
    assert neox(190, "exponential") == pytest.approx(1e-3 * math.exp(-0.693 * 2))  # still falling
    assert neox(1000, "linear") == 1e-4 and neox(1000, "constant") == 1e-3


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "exponential"])
def test_warmup_is_linear_over_warmup_times_decay_iters_from_lr_over_w(style):
    sched = _scheduler(style)  # W = 0.1 x 100 = 10
    assert sched.warmup_iter == 10.0 and sched.end_iter == 100
    assert _lr_at(sched, 0) == pytest.approx(1.0e-4)  # as iteration 1 (GPT-NeoX #1379), not 0
    assert _lr_at(sched, 1) == pytest.approx(1.0e-4)  # 1e-3 * 1 / 10
    assert _lr_at(sched, 5) == pytest.approx(5.0e-4)
    assert _lr_at(sched, 10) == pytest.approx(1.0e-3)


def test_constant():
    sched = _scheduler("constant")
    assert [_lr_at(sched, i) for i in (11, 55, 100, 500)] == [pytest.approx(1e-3)] * 4


def test_linear_decays_toward_zero_clipped_at_min_lr():
    sched = _scheduler("linear")
    # p = (it - 10) / 90; lr = max(1e-3 * (1 - p), 1e-4), as GPT-NeoX
    assert _lr_at(sched, 55) == pytest.approx(1e-3 * 0.5)  # p = 0.5 -> 5e-4
    assert _lr_at(sched, 28) == pytest.approx(1e-3 * 0.8)  # p = 0.2 -> 8e-4
    assert _lr_at(sched, 91) == pytest.approx(1e-4)  # p = 0.9: reaches min_lr here, before T
    assert _lr_at(sched, 95) == pytest.approx(1e-4)  # clipped (5.6e-5 unclipped)
    assert _lr_at(sched, 100) == pytest.approx(1e-4)
    assert _lr_at(sched, 1000) == pytest.approx(1e-4)  # stays at min_lr after T


def test_cosine():
    sched = _scheduler("cosine")
    # lr = 1e-4 + 9e-4 * (1 + cos(pi p)) / 2
    assert _lr_at(sched, 55) == pytest.approx(5.5e-4)  # cos(pi/2) = 0
    assert sched.get_lr(32.5) == pytest.approx(1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2)  # p = 0.25
    assert _lr_at(sched, 100) == pytest.approx(1e-4)
    assert _lr_at(sched, 400) == pytest.approx(1e-4)  # no cosine rebound after T


def test_exponential_about_halves_and_is_floored():
    sched = _scheduler("exponential")
    assert _lr_at(sched, 55) == pytest.approx(1e-3 * math.exp(-0.693 * 0.5), rel=1e-12)  # 7.0714e-4
    assert _lr_at(sched, 100) == pytest.approx(1e-3 * math.exp(-0.693), rel=1e-12)  # 5.0007e-4, not 5e-4
    assert _lr_at(sched, 100) != pytest.approx(5e-4, rel=1e-6)  # GPT-NeoX's 0.693, not ln 2
    assert _lr_at(sched, 400) == _lr_at(sched, 100)  # held after T
    floored = _scheduler("exponential", min_lr=8e-4)
    assert _lr_at(floored, 100) == pytest.approx(8e-4)  # 5e-4 < min_lr


def test_lr_decay_iters_and_fraction_set_the_decay_length():
    args = tiny(optimizer=ADAM, train_iters=100, lr_decay_iters=40, warmup=0.25)
    sched = build_lr_scheduler(args, _optimizer())
    assert (sched.end_iter, sched.warmup_iter) == (40, 10.0)
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
    for _ in range(2):  # steps taken at lr(0) = lr(1) = 0.5 * 1 / 2 (warmup from max(1, it))
        param.grad = torch.ones(1)
        opt.step()
        sched.step()
    assert param.item() == pytest.approx(1.0 - 0.25 - 0.25)


class _OneParameter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def _rates_applied_by_deepspeed(rank: int, world_size: int, steps: int) -> list:
    """The rate of each optimizer step under deepspeed.initialize(lr_scheduler=...), as training.py builds
    it, read off SGD's update from 0 (gradient 1 per step over 2 accumulated micro-batches)."""
    import deepspeed

    model = _OneParameter()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = AnnealingLR(opt, start_lr=1.0, warmup_iter=4, total_iters=10, decay_style="cosine", min_lr=0.1)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "steps_per_print": 10 ** 6}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config,
                                           dist_init_required=False)
    rates = []
    for _ in range(steps):
        with torch.no_grad():
            model.weight.zero_()  # SGD keeps no state: a step from 0 moves the weight by -rate, in fp32
        for _ in range(2):
            engine.backward(engine(torch.ones(1)))  # d/dw = 1, scaled by 1/2 for accumulation
            engine.step()
        rates.append(-model.weight.item())
    return rates


@pytest.mark.slow
def test_deepspeed_applies_the_rate_at_the_steps_taken_before_each_optimizer_step():
    """As GPT-NeoX: the scheduler starts at iteration 0 and the engine calls step() after each optimizer
    step (at the accumulation boundary), so optimizer step k + 1 uses get_lr(k)."""
    rates, = run_distributed(_rates_applied_by_deepspeed, world_size=1, args=(14,))
    want = [_expected(k, 1.0, 0.1, 4.0, 10, "cosine") for k in range(14)]
    assert rates == [pytest.approx(w, rel=1e-6) for w in want]  # fp32 weights
    assert rates[0] == pytest.approx(0.25) and rates[1] == pytest.approx(0.25)  # lr / W twice


# ---- Megatron-LM's schedules: inverse_sqrt, wsd, lr_warmup_iters / lr_warmup_init, decoupled_lr, weight decay ----

def _warmup(it: float, peak: float, warmup_iters: float, init) -> float:
    if init is None:
        return peak * max(1, it) / warmup_iters
    return init + (peak - init) * it / warmup_iters


def _inverse_sqrt(it: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    it = min(it, decay_iters)
    if it <= warmup_iters:
        return _warmup(it, lr, warmup_iters, None)
    return max(lr * (warmup_iters / it) ** 0.5, min_lr)


def _wsd(it: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int, wsd_iters: int, style: str,
         init=None) -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr for 'WSD', held after the decay."""
    it = min(it, decay_iters)
    if it <= warmup_iters:
        return _warmup(it, lr, warmup_iters, init)
    r = max(it - (decay_iters - wsd_iters), 0) / wsd_iters
    coeff = {"linear": 1 - r, "cosine": (math.cos(math.pi * r) + 1) / 2, "exponential": 2 * 0.5 ** r - 1}[style]
    return min_lr + coeff * (lr - min_lr)


def _steps(sched: AnnealingLR, iterations: int):
    """(iteration, each group's lr, each group's weight decay) from the scheduler as built through `iterations`."""
    for it in range(iterations + 1):
        if it:
            sched.step()
        yield it, [g["lr"] for g in sched.optimizer.param_groups], [g["weight_decay"]
                                                                  for g in sched.optimizer.param_groups]


@pytest.mark.parametrize("min_lr", [0.0, 4.0e-4])  # 4e-4: lr * sqrt(10 / it) reaches it at it = 62.5
def test_inverse_sqrt_every_step_equals_its_closed_form_then_holds(min_lr):
    sched = _scheduler("inverse_sqrt", warmup=None, lr_warmup_iters=10, min_lr=min_lr)
    assert (sched.warmup_iter, sched.end_iter) == (10.0, 100)
    for it, (lr,), _ in _steps(sched, 130):
        assert math.isclose(lr, _inverse_sqrt(it, 1e-3, min_lr, 10, 100), rel_tol=1e-12), it
    assert _lr_at(sched, 40) == pytest.approx(5e-4)  # 1e-3 * sqrt(10 / 40)
    assert _lr_at(sched, 90) == pytest.approx(max(min_lr, 1e-3 / 3))


@pytest.mark.parametrize("style,init", list(itertools.product(["exponential", "linear", "cosine"], [None, 2.0e-5])))
def test_wsd_every_step_equals_megatron_closed_form(style, init):
    """Warmup 10 iterations (GPT-NeoX's rule, or from lr_warmup_init), stable at lr to 70, decay over the last
    30 of 100 to min_lr in the wsd style, then held."""
    sched = _scheduler("wsd", warmup=None, lr_warmup_iters=10, lr_wsd_decay_iters=30, lr_wsd_decay_style=style,
                       lr_warmup_init=init)
    for it, (lr,), _ in _steps(sched, 120):
        assert math.isclose(lr, _wsd(it, 1e-3, 1e-4, 10, 100, 30, style, init), rel_tol=1e-12), it
    assert [_lr_at(sched, it) for it in (11, 40, 70)] == [pytest.approx(1e-3)] * 3  # the stable phase
    halfway = {"linear": 0.5, "cosine": 0.5, "exponential": 2 ** 0.5 - 1}[style]
    assert _lr_at(sched, 85) == pytest.approx(1e-4 + halfway * 9e-4)
    assert _lr_at(sched, 100) == pytest.approx(1e-4) and _lr_at(sched, 150) == pytest.approx(1e-4)


def test_lr_warmup_init_is_the_first_steps_rate_and_lr_warmup_iters_the_length():
    sched = _scheduler("linear", warmup=None, lr_warmup_iters=4, lr_warmup_init=1e-4)
    assert [_lr_at(sched, it) for it in range(5)] == [pytest.approx(v) for v in (1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3)]
    gpt_neox = _scheduler("linear", warmup=None, lr_warmup_iters=4)  # no init: lr * max(1, it) / W
    assert [_lr_at(gpt_neox, it) for it in range(3)] == [pytest.approx(v) for v in (2.5e-4, 2.5e-4, 5e-4)]


def _tiny_model(tied: bool = False):
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from tests.model.helpers import tiny_config

    return build_model(tiny_config(no_weight_tying=not tied), SingleProcessState())


@pytest.mark.parametrize("tied", [False, True])
def test_decoupled_lr_gives_the_embedding_and_output_weights_their_own_schedule(tied):
    from megatron.optim.optimizers import build_optimizer

    model = _tiny_model(tied)
    args = tiny(optimizer=ADAM, train_iters=50, warmup=0.2, lr_decay_style="cosine", min_lr=1e-4,
                decoupled_lr=5e-3, decoupled_min_lr=5e-4)
    opt = build_optimizer(args, model)
    sched = build_lr_scheduler(args, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    decoupled = [names[id(p)] for g in opt.param_groups if g.get("decoupled_lr") for p in g["params"]]
    assert sorted(decoupled) == sorted(n for n in names.values() if n.endswith(("word_embeddings.weight",
                                                                                 "final_linear.weight")))
    assert len(decoupled) == (1 if tied else 2) and sum(len(g["params"]) for g in opt.param_groups) == len(names)
    for it, rates, _ in _steps(sched, 60):
        for group, lr in zip(opt.param_groups, rates):
            peak, floor = (5e-3, 5e-4) if group.get("decoupled_lr") else (1e-3, 1e-4)
            assert math.isclose(lr, _gpt_neox_lr(min(it, 50), peak, floor, 10.0, 50, "cosine"), rel_tol=1e-12), it


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_weight_decay_increment_every_step_and_norms_never_decay(style):
    from megatron.optim.optimizers import build_optimizer

    args = tiny(optimizer=ADAM, train_iters=40, weight_decay=0.0, start_weight_decay=0.01, end_weight_decay=0.1,
                weight_decay_incr_style=style)
    opt = build_optimizer(args, _tiny_model())
    sched = build_lr_scheduler(args, opt)
    decays = [g["weight_decay"] > 0 for g in opt.param_groups]
    assert decays == [True, False]  # decay chosen as for a non-zero decay although weight_decay is 0
    for it, _, (wd, none) in _steps(sched, 50):
        r = min(it, 40) / 40
        coeff = r if style == "linear" else (math.cos(math.pi * (1 - r)) + 1) / 2
        assert math.isclose(wd, 0.01 + coeff * 0.09, rel_tol=1e-12) and none == 0.0, it


RESUMED = {"wsd": dict(lr_decay_style="wsd", lr_warmup_iters=10, lr_wsd_decay_iters=30),
           "inverse_sqrt": dict(lr_decay_style="inverse_sqrt", lr_warmup_init=1e-5),
           "decoupled_and_wd": dict(lr_decay_style="cosine", decoupled_lr=3e-3, start_weight_decay=0.0,
                                    end_weight_decay=0.1, weight_decay_incr_style="cosine")}


@pytest.mark.parametrize("kind,stop", [("wsd", 45), ("wsd", 80), ("inverse_sqrt", 33), ("decoupled_and_wd", 61)])
def test_resumes_exactly_from_a_state_dict_mid_schedule(kind, stop):
    """A scheduler rebuilt from the config and loaded from the state at `stop` (stable phase 45, WSD decay 80)
    gives the uninterrupted scheduler's rates and weight decays at every later step."""
    from megatron.optim.optimizers import build_optimizer

    args = tiny(optimizer=ADAM, train_iters=100, **RESUMED[kind])
    first = build_lr_scheduler(args, build_optimizer(args, _tiny_model()))
    first.step(stop)
    resumed = build_lr_scheduler(args, build_optimizer(args, _tiny_model()))
    assert resumed.num_iters == 0 and resumed.get_last_lr() != first.get_last_lr()
    resumed.load_state_dict(first.state_dict())
    for _ in range(stop, 110):
        assert resumed.num_iters == first.num_iters
        assert [(g["lr"], g["weight_decay"]) for g in resumed.optimizer.param_groups] == \
            [(g["lr"], g["weight_decay"]) for g in first.optimizer.param_groups]
        first.step()
        resumed.step()


def test_a_checkpoint_with_other_megatron_settings_is_refused_or_taken():
    saved = _scheduler("wsd", warmup=None, lr_warmup_iters=10, lr_wsd_decay_iters=30)
    saved.step(80)
    state = saved.state_dict()
    with pytest.raises(ValueError, match="wsd_decay_iters: config 20 vs checkpoint 30"):
        _scheduler("wsd", warmup=None, lr_warmup_iters=10, lr_wsd_decay_iters=20).load_state_dict(state)
    taken = _scheduler("wsd", warmup=None, lr_warmup_iters=10, lr_wsd_decay_iters=20,
                       use_checkpoint_lr_scheduler=True)
    taken.load_state_dict(state)
    assert taken.wsd_decay_iters == 30 and taken.get_last_lr() == saved.get_last_lr()


def test_a_gpt_neox_checkpoint_without_the_new_keys_loads():
    sched = _scheduler("cosine")
    neox_state = {key: value for key, value in _scheduler("cosine").state_dict().items()
                  if key in CHECKED_KEYS + ("num_iters",)}
    sched.load_state_dict({**neox_state, "num_iters": 30})
    assert sched.num_iters == 30
    with pytest.raises(ValueError, match="decoupled_lr: config 0.002 vs checkpoint None"):
        _scheduler("cosine", decoupled_lr=2e-3).load_state_dict(neox_state)


def test_under_a_batch_ramp_the_schedule_advances_by_samples_and_resumes_mid_ramp():
    """With samples_per_iteration (the full batch, 12) each step moves the schedule by its batch / 12: the rate is
    the closed form at it = samples consumed / 12, and a scheduler loaded mid-ramp continues identically."""
    def build() -> AnnealingLR:
        return AnnealingLR(_optimizer(), start_lr=1e-3, warmup_iter=2, total_iters=7, decay_style="cosine",
                           min_lr=1e-4, samples_per_iteration=12)

    batches = [4, 4, 4, 8, 8, 12, 12, 12, 12]
    sched, consumed = build(), 0
    for step, batch in enumerate(batches):
        if step == 4:
            resumed = build()
            resumed.load_state_dict(sched.state_dict())
            assert resumed.num_samples == 20 and resumed.get_last_lr() == sched.get_last_lr()
        sched.next_batch = batch
        sched.step()
        consumed += batch
        assert sched.num_iters == consumed / 12
        assert math.isclose(sched.get_last_lr()[0], _gpt_neox_lr(min(consumed / 12, 7), 1e-3, 1e-4, 2.0, 7, "cosine"),
                            rel_tol=1e-12), step
    for batch in batches[4:]:
        resumed.next_batch = batch
        resumed.step()
    assert resumed.state_dict() == sched.state_dict() and resumed.get_last_lr() == sched.get_last_lr()
    with pytest.raises(ValueError, match="keep rampup_batch_size to resume"):
        AnnealingLR(_optimizer(), start_lr=1e-3, warmup_iter=2, total_iters=7, decay_style="cosine",
                    min_lr=1e-4).load_state_dict(build().state_dict() | {"num_iters": 20 / 12})


# ---- Megatron-LM's sample-based lengths: lr_warmup_samples, lr_decay_samples, lr_wsd_decay_samples ----

def _megatron_lr_at_samples(c: float, lr: float, min_lr: float, warmup: int, decay: int, style: str,
                            wsd_decay: int = 0, wsd_style: str = "linear") -> float:
    """Megatron-LM's OptimizerParamScheduler.get_lr after c samples (lr_warmup_init 0), all lengths in samples;
    after the decay the value at its end is held (this project's rule: Megatron-LM drops to min_lr there, the same
    value but for inverse_sqrt)."""
    if c <= warmup:
        return lr * c / warmup
    c = min(c, decay)
    if style == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (math.cos(math.pi * (c - warmup) / (decay - warmup)) + 1)
    if style == "inverse_sqrt":
        return max(lr * math.sqrt(warmup) / math.sqrt(c), min_lr)
    r = max(c - (decay - wsd_decay), 0) / wsd_decay  # wsd
    coeff = {"linear": 1 - r, "cosine": (math.cos(math.pi * r) + 1) / 2, "exponential": 2 * 0.5 ** r - 1}[wsd_style]
    return min_lr + coeff * (lr - min_lr)


SAMPLE_RUN = dict(optimizer=ADAM, train_samples=800, train_batch_size=8, min_lr=1.0e-4, lr_warmup_init=0.0,
                  lr_warmup_samples=20, lr_decay_samples=600)
"""Batch 8 (2 x 4 micro-batches): warmup 2.5 full batches, decay 75: neither a whole number of steps."""


@pytest.mark.parametrize("style,wsd_style", [("cosine", None), ("inverse_sqrt", None), ("wsd", "linear"),
                                             ("wsd", "cosine"), ("wsd", "exponential")])
@pytest.mark.parametrize("ramp", [None, [2, 2, 96]])
def test_sample_lengths_every_step_equal_megatron_closed_form_and_resume(style, wsd_style, ramp):
    """Each step's rate is Megatron-LM's at the samples consumed before it (batch 8, or the ramp 2, 4, 6 over the
    first 96 samples), through the end of the decay and after; a scheduler loaded mid-run continues identically."""
    wsd = dict(lr_wsd_decay_samples=200, lr_wsd_decay_style=wsd_style) if style == "wsd" else {}
    args = tiny(**SAMPLE_RUN, lr_decay_style=style, rampup_batch_size=ramp, **wsd)
    schedule = TrainingSchedule.from_neox_args(args)
    assert (schedule.warmup_iters, schedule.decay_iters) == (2.5, 75)
    sched = _build(args, schedule, _optimizer())
    resumed, consumed = None, 0
    for step in range(schedule.train_iters):
        want = _megatron_lr_at_samples(consumed, 1e-3, 1e-4, 20, 600, style, 200, wsd_style)
        assert math.isclose(sched.get_last_lr()[0], want, rel_tol=1e-12, abs_tol=1e-18), (step, consumed)
        if step == 40:
            resumed = _build(args, schedule, _optimizer())
            resumed.load_state_dict(sched.state_dict())
        batch = schedule.batch_size_at(consumed)
        for scheduler in filter(None, (sched, resumed)):
            scheduler.next_batch = batch  # read under a ramp only (the training loop sets it)
            scheduler.step()
        consumed += batch
    assert consumed >= 800 and sched.get_last_lr() == resumed.get_last_lr()
    assert sched.get_last_lr()[0] == pytest.approx(1e-4 if style != "inverse_sqrt" else
                                                   max(1e-3 * math.sqrt(20 / 600), 1e-4))
