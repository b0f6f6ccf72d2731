"""Optimizers: parameter groups, the config -> optimizer mapping, and SM3 / MADGRAD / Lion checked against
first (and second) steps computed by hand and on a tiny quadratic."""

import math

import pytest
import torch
from torch import nn

from megatron.optim.optimizers import (DEEPSPEED_FUSED_ADAM, MADGRAD, SM3, TORCH_FUSED_ADAM, Lion, adam_implementation,
                                       build_optimizer, parameters_device_type)
from megatron.optim.param_groups import get_param_groups
from tests.neox_arguments.helpers import tiny


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.rms = RMSNorm(4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: must appear once
        self.special = nn.Parameter(torch.zeros(4))
        self.special._no_weight_decay = True
        self.frozen = nn.Parameter(torch.zeros(4), requires_grad=False)


def _ids(params):
    return {id(p) for p in params}


def _args(kind: str, **params):
    return tiny(optimizer={"type": kind, "params": {"lr": 0.01, **params}}, weight_decay=0.1)


def test_param_groups_exclude_norms_biases_and_flagged():
    model = Toy()
    decay, no_decay = get_param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert _ids(decay["params"]) == _ids([model.embed.weight, model.linear.weight])
    assert _ids(no_decay["params"]) == _ids(
        [model.linear.bias, model.norm.weight, model.norm.bias, model.rms.scale, model.special]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == 7  # tied counted once, frozen left out


def test_zero_weight_decay_gives_one_group():
    groups = get_param_groups(Toy(), 0.0)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.0 and len(groups[0]["params"]) == 7


def test_adam_on_cpu_is_fused_adamw_with_config_values():
    opt = build_optimizer(_args("Adam", betas=[0.9, 0.95], eps=1e-6), Toy())
    assert type(opt) is torch.optim.AdamW
    assert opt.defaults["fused"] is True and opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-6
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # neox_args.weight_decay


def test_params_weight_decay_wins_and_adam_w_mode_false_is_l2_adam():
    opt = build_optimizer(_args("Adam", weight_decay=0.3, adam_w_mode=False), Toy())
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["weight_decay"] == 0.3


def test_fused_adam_matches_unfused_cpu_torch_adam():
    torch.manual_seed(0)
    models = [Toy(), Toy()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [build_optimizer(_args("Adam"), models[0]), build_optimizer(_args("CPU_TORCH_Adam"), models[1])]
    assert opts[1].defaults["fused"] is not True
    tokens = torch.tensor([[0, 1, 2, 3]])
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            hidden = model.rms.scale * model.norm(model.linear(model.embed(tokens))) + model.special
            model.head(hidden).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.equal(models[0].linear.weight, Toy().linear.weight)


def test_sgd_takes_momentum_from_params():
    opt = build_optimizer(_args("SGD", momentum=0.9, nesterov=True), Toy())
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.9 and opt.defaults["nesterov"]


def test_each_own_optimizer_is_built():
    assert type(build_optimizer(_args("SM3", momentum=0.5), Toy())) is SM3
    assert type(build_optimizer(_args("madgrad_wd"), Toy())) is MADGRAD
    assert type(build_optimizer(_args("Lion", betas=[0.9, 0.98]), Toy())) is Lion


def test_unknown_param_and_onebitadam_are_clear_errors():
    with pytest.raises(ValueError, match=r"\['momentum'\] are not accepted by optimizer type 'lion'"):
        build_optimizer(_args("Lion", momentum=0.9), Toy())
    with pytest.raises(ValueError, match="OneBitAdam.*NCCL or MPI"):  # refused when the arguments are validated
        _args("OneBitAdam")
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer(_args("Adam", bias_correction=False), Toy())


# ---- SM3 -------------------------------------------------------------------------------------------


def test_sm3_first_two_steps_by_hand():
    p = nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    opt = SM3([p], lr=0.1)
    p.grad = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    opt.step()
    # nu = g^2, update = g / |g| = sign(g)
    torch.testing.assert_close(p.detach(), torch.tensor([[0.9, 2.1], [2.9, 3.9]]))
    # row accumulators = row max of g^2 = [4, 16]; column accumulators = [9, 16]
    p.grad = torch.ones(2, 2)
    opt.step()
    # nu = min(row_i, col_j) + 1 = [[min(4, 9), min(4, 16)], [min(16, 9), min(16, 16)]] + 1 = [[5, 5], [10, 17]]
    expected = torch.tensor(
        [[0.9 - 0.1 / math.sqrt(5), 2.1 - 0.1 / math.sqrt(5)], [2.9 - 0.1 / math.sqrt(10), 3.9 - 0.1 / math.sqrt(17)]]
    )
    torch.testing.assert_close(p.detach(), expected)


def test_sm3_vector_is_adagrad_with_momentum():
    p = nn.Parameter(torch.tensor([1.0, 1.0]))
    opt = SM3([p], lr=0.1, momentum=0.5)
    p.grad = torch.tensor([2.0, -1.0])
    opt.step()  # u = sign(g) = [1, -1]; buf = 0.5 * u = [0.5, -0.5]
    torch.testing.assert_close(p.detach(), torch.tensor([0.95, 1.05]))
    p.grad = torch.tensor([2.0, 0.0])
    opt.step()  # nu = [8, 1]; u = [2/sqrt(8), 0]; buf = 0.5 * [0.5, -0.5] + 0.5 * u
    buf = torch.tensor([0.25 + 0.5 * 2 / math.sqrt(8), -0.25])
    torch.testing.assert_close(p.detach(), torch.tensor([0.95, 1.05]) - 0.1 * buf)


# ---- MADGRAD ---------------------------------------------------------------------------------------


def test_madgrad_first_step_by_hand():
    x0 = torch.tensor([1.0, -2.0])
    g = torch.tensor([0.5, -1.0])
    p = nn.Parameter(x0.clone())
    opt = MADGRAD([p], lr=0.1, momentum=0.9, weight_decay=0.01, eps=1e-6)
    p.grad = g.clone()
    opt.step()
    # lam = 0.1 * sqrt(1); s = 0.1 g; nu = 0.1 g^2; z = x0 - s / (cbrt(nu) + eps); x = 0.9 x0 + 0.1 z - lr wd x0
    expected = []
    for x, gi in ((1.0, 0.5), (-2.0, -1.0)):
        z = x - 0.1 * gi / ((0.1 * gi * gi) ** (1 / 3) + 1e-6)
        expected.append(0.9 * x + 0.1 * z - 0.1 * 0.01 * x)
    torch.testing.assert_close(p.detach(), torch.tensor(expected))
    assert expected[0] == pytest.approx(0.98190, abs=1e-4)  # 0.9 + 0.1 * (1 - 0.05 / 0.29240) - 0.001


# ---- Lion ------------------------------------------------------------------------------------------


def test_lion_first_two_steps_by_hand():
    p = nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    p.grad = torch.tensor([0.3, -0.2, 0.0])
    opt.step()
    # u = sign(0.1 g) = [1, -1, 0]; p = p * (1 - 0.05) - 0.1 u
    torch.testing.assert_close(p.detach(), torch.tensor([0.95 - 0.1, -0.95 + 0.1, 0.475]))
    # m = 0.01 g = [0.003, -0.002, 0]; next g = [-0.01, -0.05, 0.2]
    # c = 0.9 m + 0.1 g = [0.0027 - 0.001, -0.0018 - 0.005, 0.02] -> sign [1, -1, 1]
    p.grad = torch.tensor([-0.01, -0.05, 0.2])
    opt.step()
    expected = torch.tensor([0.85 * 0.95 - 0.1, -0.85 * 0.95 + 0.1, 0.475 * 0.95 - 0.1])
    torch.testing.assert_close(p.detach(), expected)


# ---- all three converge on a quadratic --------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: SM3(ps, lr=0.1, momentum=0.5),
        lambda ps: MADGRAD(ps, lr=0.05, momentum=0.9),
        lambda ps: Lion(ps, lr=0.01, betas=(0.9, 0.99)),
    ],
    ids=["sm3", "madgrad", "lion"],
)
def test_minimises_a_quadratic(make):
    torch.manual_seed(0)
    target = torch.randn(3, 4)
    p = nn.Parameter(torch.zeros(3, 4))
    opt = make([p])
    start = (p - target).square().sum().item()
    for _ in range(400):
        opt.zero_grad()
        (p - target).square().sum().backward()
        opt.step()
    assert (p - target).square().sum().item() < 0.01 * start


@pytest.mark.slow
def test_cpu_adam_matches_torch_adamw():
    """DeepSpeedCPUAdam (JIT-compiled on first use, about a minute) agrees with torch's AdamW."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 3), nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    args = _args("CPU_Adam", betas=[0.9, 0.95], eps=1e-8)
    opts = [build_optimizer(args, models[0]), build_optimizer(_args("cpu_torch_adam", betas=[0.9, 0.95]), models[1])]
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    assert isinstance(opts[0], DeepSpeedCPUAdam)
    x = torch.randn(8, 4)
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


ADAM_CHOICES = [  # (config overrides, optimizer params, device type, what `adam` becomes)
    (dict(bf16={"enabled": True}), {}, "cuda", DEEPSPEED_FUSED_ADAM),  # ZeRO 0: DeepSpeed's flat FP16_Optimizer
    (dict(precision="fp16"), {}, "cuda", DEEPSPEED_FUSED_ADAM),
    (dict(precision="fp16", pipe_parallel_size=1), {}, "cuda", DEEPSPEED_FUSED_ADAM),
    (dict(bf16={"enabled": True}, pipe_parallel_size=1), {}, "cuda", TORCH_FUSED_ADAM),  # BF16_Optimizer, flat
    (dict(bf16={"enabled": True}, zero_optimization={"stage": 1}), {}, "cuda", TORCH_FUSED_ADAM),  # ZeRO: flat
    (dict(precision="fp16", zero_optimization={"stage": 3}), {}, "cuda", TORCH_FUSED_ADAM),
    ({}, {}, "cuda", TORCH_FUSED_ADAM),  # fp32 without ZeRO: no wrapper
    ({}, dict(bias_correction=False), "cuda", DEEPSPEED_FUSED_ADAM),  # only DeepSpeed's Adam has it
    (dict(bf16={"enabled": True}), dict(amsgrad=True), "cuda", TORCH_FUSED_ADAM),  # FusedAdam has no AMSGrad
    (dict(bf16={"enabled": True}), {}, "cpu", TORCH_FUSED_ADAM),
]


@pytest.mark.parametrize("overrides, params, device_type, expected", ADAM_CHOICES)
def test_adam_is_deepspeed_fused_adam_on_cuda_where_deepspeed_fuses_its_16bit_wrapper_only_for_it(
        overrides, params, device_type, expected):
    args = tiny(optimizer={"type": "Adam", "params": {"lr": 0.01, **params}}, **overrides)
    assert adam_implementation(args, device_type) == expected


def test_a_cuda_model_whose_fused_adam_cannot_be_built_gets_torch_fused_adamw_and_one_warning(monkeypatch, caplog):
    """The choice for a CUDA-placed model through build_optimizer (the parameters' device read as CUDA); the JIT
    build failing (no nvcc here) falls back to torch's fused AdamW over the same groups, saying why in one line."""
    import megatron.optim.optimizers as optimizers

    def no_nvcc() -> None:
        raise RuntimeError("Unable to JIT load the fused_adam op due to ninja not being installed.\nmore detail")

    monkeypatch.setattr(optimizers, "parameters_device_type", lambda groups: "cuda")
    monkeypatch.setattr(optimizers, "_load_fused_adam_op", no_nvcc)
    model = Toy()
    with caplog.at_level("WARNING", logger="megatron.optim.optimizers"):
        opt = build_optimizer(tiny(optimizer={"type": "Adam", "params": {"lr": 0.01}}, weight_decay=0.1,
                                   bf16={"enabled": True}), model)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    assert sum(len(g["params"]) for g in opt.param_groups) == 7
    assert [r.getMessage() for r in caplog.records] == [
        "DeepSpeed's FusedAdam could not be built (RuntimeError: Unable to JIT load the fused_adam op due to ninja "
        "not being installed.); using torch.optim.AdamW(fused=True) instead (without ZeRO, 16-bit training then "
        "gets DeepSpeed's slower FP16_UnfusedOptimizer)"]


def test_parameters_on_several_device_types_are_refused():
    model = Toy()
    model.special = nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match=r"several device types \['cpu', 'meta'\]"):
        parameters_device_type(get_param_groups(model, 0.1))
    assert parameters_device_type(get_param_groups(Toy(), 0.1)) == "cpu"


@pytest.mark.gpu
def test_adam_on_cuda_in_bf16_without_zero_is_deepspeed_fused_adam_matching_torch():
    """Builds DeepSpeed's FusedAdam op (JIT, nvcc; TORCH_CUDA_ARCH_LIST entries such as 9.0a made parsable)."""
    from deepspeed.ops.adam import FusedAdam

    torch.manual_seed(0)
    models = [nn.Linear(16, 8).cuda(), nn.Linear(16, 8).cuda()]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        build_optimizer(tiny(optimizer={"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95]}},
                             weight_decay=0.1, bf16={"enabled": True}), models[0]),
        torch.optim.AdamW(get_param_groups(models[1], 0.1), lr=0.01, betas=(0.9, 0.95)),
    ]
    assert isinstance(opts[0], FusedAdam)
    x = torch.randn(4, 16, device="cuda")
    for _ in range(3):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pipeline_stages_with_other_param_groups_are_named_before_zero_would_hang():
    """The experts' own group exists only on stages holding an MoE layer: under ZeRO 1 / 2 that would hang DeepSpeed's
    group-by-group norm all-reduce (megatron.training.loop checks it over the pipe group: by hand, PP=2 with one MoE layer
    of 2 gives this message on both ranks instead of a hang)."""
    from megatron.model.parameter_marks import MOE_EXPERT_FLAG
    from megatron.optim.optimizers import describe_param_groups, pipeline_group_mismatch

    def stage(with_experts: bool) -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        if with_experts:
            experts = nn.Linear(4, 4, bias=False)
            setattr(experts.weight, MOE_EXPERT_FLAG, True)
            model.append(experts)
        return model

    first = describe_param_groups(get_param_groups(stage(True), 0.1, moe_param_group=True))
    second = describe_param_groups(get_param_groups(stage(False), 0.1, moe_param_group=True))
    assert first == ["decay", "no_decay", "moe_experts"] and second == ["decay", "no_decay"]
    assert pipeline_group_mismatch([first, first]) is None
    problem = pipeline_group_mismatch([first, second])
    assert "stage 0: decay, no_decay, moe_experts; stage 1: decay, no_decay" in problem
    assert "create_moe_param_group: false" in problem
    assert pipeline_group_mismatch([describe_param_groups(get_param_groups(stage(s), 0.1)) for s in (True, False)]) \
        is None
