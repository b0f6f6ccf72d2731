"""Mamba: the selective scan (its step form, the CPU default; its matmul form, and the stable chunked form that one falls
back to for large steps) equals the per-step recurrence (outputs, last state and gradients; fp32 and bf16), the causal convolution continues from
its state, fp32 parameters, and the GPU flags' refusal."""

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.model.mamba import (SCAN_FORMS, causal_conv1d, matmul_chunk, selective_scan,
                                  selective_scan_reference)
from megatron.mpu import SingleProcessState
from megatron.errors import ConfigError
from tests.model.helpers import random_batch, tiny_config

FP32_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
BF16_TOLERANCE = dict(rtol=8e-3, atol=1e-5)
"""bf16 inputs: the chunked scan computes in fp32 and rounds its output, and each input's gradient, to bf16
once (2^-9 relative each, measured <= 4e-3 with the fp32 sums' own differences); they are compared with the
fp32 reference run on the same bf16-valued inputs and cotangents. fp32: both forms in fp32, measured <= 8e-6."""


def scan_inputs(b=2, s=45, d=6, n=4, dtype=torch.float32, seed=0, step_bias=0.0):
    g = torch.Generator().manual_seed(seed)
    tensors = dict(u=torch.randn(b, s, d, generator=g), delta=torch.randn(b, s, d, generator=g),
                   A=-torch.rand(d, n, generator=g) * 8 - 0.1, B=torch.randn(b, s, n, generator=g),
                   C=torch.randn(b, s, n, generator=g), D=torch.randn(d, generator=g),
                   z=torch.randn(b, s, d, generator=g), delta_bias=torch.randn(d, generator=g) + step_bias,
                   initial_state=torch.randn(b, d, n, generator=g))
    return {k: v.to(dtype).requires_grad_() for k, v in tensors.items()}


def run(fn, inputs, **kwargs):
    """(y, last state, input gradients) with fixed random cotangents on y and the state: a loss linear in the
    outputs, so the gradients compared are the scan's own (a loss like sin(y) would add cos(y)'s rounding at
    |y| ~ 100s, which neither form controls)."""
    y, state = fn(**inputs, **kwargs)
    g = torch.Generator().manual_seed(99)
    # bf16-valued cotangents: the gradient reaching a bf16 output is rounded to bf16 on its way back, and the
    # fp32 reference must see the same one
    dy, dstate = (torch.randn(t.shape, generator=g).bfloat16().float() for t in (y, state))
    ((y.float() * dy).sum() + (state.float() * dstate).sum()).backward()
    return y, state, {k: v.grad for k, v in inputs.items()}


@pytest.mark.parametrize("form", SCAN_FORMS)
@pytest.mark.parametrize("step_bias", [0.0, 20.0], ids=["ordinary_steps", "huge_steps"])
def test_scan_equals_the_per_step_reference_fp32(step_bias, form):
    """45 steps in chunks (matmul form) or blocks (step form) of 16, a partial last one, from a random state; huge steps
    (softplus(~20) x A down to -8) decay to 0 without overflow: the step form and the matmul form's stable
    fallback only multiply decays <= 1. Outputs, last state and every gradient (u, delta, A, B, C, D, z, the
    step bias, the initial state)."""
    ref = run(selective_scan_reference, scan_inputs(step_bias=step_bias))
    got = run(selective_scan, scan_inputs(step_bias=step_bias), chunk_size=16, form=form)
    worst = {"y": (got[0] - ref[0]).abs().max().item(), "state": (got[1] - ref[1]).abs().max().item(),
             **{name: (got[2][name] - grad).abs().max().item() for name, grad in ref[2].items()}}
    print(form, "scan, largest differences:", worst)
    torch.testing.assert_close(got[0], ref[0], **FP32_TOLERANCE)
    torch.testing.assert_close(got[1], ref[1], **FP32_TOLERANCE)
    for name, grad in ref[2].items():
        assert torch.isfinite(got[2][name]).all(), name
        torch.testing.assert_close(got[2][name], grad, **FP32_TOLERANCE, msg=name)


@pytest.mark.parametrize("chunk", [16, 4])
def test_matmul_scan_equals_the_per_step_reference_fp32(chunk):
    """Steps of a trained model's size (softplus(~N(-3, 1)) ~ 0.05 x, A down to -8): the matmul form runs at the
    chunk asked for, over 45 steps (a partial last chunk) from a random state; outputs, last state and every
    gradient within 1e-5 of the per-step recurrence."""
    inputs = scan_inputs(step_bias=-3.0)
    delta = torch.nn.functional.softplus(inputs["delta"] + inputs["delta_bias"])
    assert matmul_chunk(delta, inputs["A"], chunk) == chunk
    ref = run(selective_scan_reference, scan_inputs(step_bias=-3.0))
    got = run(selective_scan, inputs, chunk_size=chunk, form="matmul")
    worst = {"y": (got[0] - ref[0]).abs().max().item(), "state": (got[1] - ref[1]).abs().max().item(),
             **{name: (got[2][name] - grad).abs().max().item() for name, grad in ref[2].items()}}
    print("matmul scan, largest differences:", worst)
    torch.testing.assert_close(got[0], ref[0], **FP32_TOLERANCE)
    torch.testing.assert_close(got[1], ref[1], **FP32_TOLERANCE)
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name], grad, **FP32_TOLERANCE, msg=name)


def test_large_steps_take_the_stable_scan():
    """Steps too large for the log-space factors at any chunk (softplus(~20) x A down to -8) leave the matmul
    form: matmul_chunk says so (the huge-steps case above checks the result)."""
    inputs = scan_inputs(step_bias=20.0)
    delta = torch.nn.functional.softplus(inputs["delta"] + inputs["delta_bias"])
    assert matmul_chunk(delta, inputs["A"], 16) is None
    assert matmul_chunk(delta[:, :1] * 0.01, inputs["A"], 16) == 16  # the same A with small steps: it fits


@pytest.mark.parametrize("form", SCAN_FORMS)
def test_scan_equals_the_per_step_reference_bf16(form):
    inputs = scan_inputs(dtype=torch.bfloat16)
    as_fp32 = {k: v.detach().float().requires_grad_() for k, v in inputs.items()}
    ref = run(selective_scan_reference, as_fp32)
    got = run(selective_scan, inputs, form=form)
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0].float(), ref[0], **BF16_TOLERANCE)
    torch.testing.assert_close(got[1], ref[1], **FP32_TOLERANCE)  # the state stays fp32
    for name, grad in ref[2].items():
        torch.testing.assert_close(got[2][name].float(), grad, **BF16_TOLERANCE, msg=name)


@pytest.mark.parametrize("form", SCAN_FORMS)
def test_chunk_size_does_not_change_the_result(form):
    """Chunks (matmul form) or blocks (step form) of 1 step and of more than the 45 steps give one result."""
    a = run(selective_scan, scan_inputs(), chunk_size=1, form=form)
    b = run(selective_scan, scan_inputs(), chunk_size=64, form=form)
    torch.testing.assert_close(a[0], b[0], **FP32_TOLERANCE)
    torch.testing.assert_close(a[1], b[1], **FP32_TOLERANCE)
    for name, grad in a[2].items():
        torch.testing.assert_close(b[2][name], grad, **FP32_TOLERANCE, msg=name)


def test_causal_conv_continues_from_its_state():
    g = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(2, 9, 5, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, generator=g)
    whole, _ = causal_conv1d(x, weight, bias)
    first, tail = causal_conv1d(x[:, :6], weight, bias)
    second, tail = causal_conv1d(x[:, 6:8], weight, bias, tail)  # 2 steps: the decoding path (s <= width)
    third, _ = causal_conv1d(x[:, 8:], weight, bias, tail)
    torch.testing.assert_close(torch.cat([first, second, third], dim=1), whole)
    without_bias, _ = causal_conv1d(x[:, :2], weight, None)
    torch.testing.assert_close(without_bias, whole[:, :2] - bias)
    # the first output sees three zeros before the sequence: the definition of a causal convolution
    torch.testing.assert_close(whole[:, 0], x[:, 0] * weight[:, 0, -1] + bias)
    # the multiply-adds (CPU) are torch's depthwise convolution over the zero-padded sequence
    conv = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), weight, bias, groups=5)
    torch.testing.assert_close(whole, conv.transpose(1, 2))


@pytest.mark.parametrize("with_bias", [True, False])
def test_causal_conv_gradients_equal_torch_conv1d(with_bias):
    """Training's convolution (from zeros, its own backward on CPU) against torch's depthwise convolution over the
    zero-padded sequence: output and the gradients of the input (a strided view, as the mixer's x of [x | z]),
    the taps and the bias, in float64."""
    g = torch.Generator().manual_seed(2)
    xz = torch.randn(2, 9, 10, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    params = [xz, weight] + ([bias] if with_bias else [])
    x = xz[..., :5]
    out, _ = causal_conv1d(x, weight, bias)
    expected = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (3, 0)), weight, bias,
                                          groups=5).transpose(1, 2)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, params, cotangent), torch.autograd.grad(expected, params, cotangent)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("keep", [True, False])
def test_selective_fp32_params_keeps_A_and_D_in_fp32(keep):
    config = tiny_config(attention_config=[[["mamba"], 2]], precision="bfloat16", mamba_selective_fp32_params=keep)
    model = build_model(config, SingleProcessState())
    dtypes = {name.rsplit(".", 1)[-1]: p.dtype for name, p in model.named_parameters()}
    assert dtypes["A_log"] == dtypes["D"] == (torch.float32 if keep else torch.bfloat16)
    assert dtypes["weight"] == torch.bfloat16
    inputs, labels = random_batch()
    loss = model.loss_fn(model(inputs), labels)
    loss.backward()
    assert torch.isfinite(loss)


def test_bias_settings_add_the_biases():
    plain = build_model(tiny_config(attention_config=[[["mamba"], 2]], mamba_use_bias_in_conv=False),
                        SingleProcessState())
    biased = build_model(tiny_config(attention_config=[[["mamba"], 2]], mamba_use_bias_in_linears=True),
                         SingleProcessState())
    plain_names = {n for n, _ in plain.named_parameters()}
    biased_names = {n for n, _ in biased.named_parameters()}
    assert "sequential.2.mixer.conv1d.bias" not in plain_names and "sequential.2.mixer.in_proj.bias" not in plain_names
    assert {"sequential.2.mixer.in_proj.bias", "sequential.2.mixer.x_proj.bias", "sequential.2.mixer.out_proj.bias",
            "sequential.2.mixer.conv1d.bias"} <= biased_names


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("flag", ["mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion"])
def test_kernel_flags_are_refused_without_cuda(flag):
    with pytest.raises(ConfigError, match=f"{flag}=true needs a CUDA GPU"):
        build_model(tiny_config(attention_config=[[["mamba"], 2]], **{flag: True}), SingleProcessState())


def test_rules_of_mamba_layers():
    assert "mamba_inner_func_fusion=true with model_parallel_size=2 is not supported" in " ".join(
        tiny_config(attention_config=[[["mamba"], 2]], model_parallel_size=2, mamba_inner_func_fusion=True).problems())
    assert "sequential" not in " ".join(tiny_config(attention_config=[[["mamba"], 2]]).problems())
    assert any("sequence_parallel with mamba layers is not supported yet" in p for p in
               tiny_config(attention_config=[[["mamba"], 2]], model_parallel_size=2,
                           sequence_parallel=True).problems())


def test_causal_conv_fusion_needs_rank_widths_that_are_multiples_of_8():
    """causal_conv1d's CUDA kernel refuses a channel-last input whose channels are not a multiple of 8: refused
    when the config is read, naming the keys and the fix, only when mamba_causal_conv_fusion is on."""
    def problems(**options):
        return " ".join(tiny_config(attention_config=[[["mamba"], 2]], **options).problems())

    message = "mamba_causal_conv_fusion=true needs Mamba's inner width per tensor-parallel rank to be a multiple of 8"
    refused = problems(intermediate_size=44, mamba_causal_conv_fusion=True)
    assert message in refused and "44 / model_parallel_size=1 = 44" in refused
    assert "or set mamba_causal_conv_fusion to false" in refused
    assert message in problems(intermediate_size=72, model_parallel_size=2, mamba_causal_conv_fusion=True)  # 36
    assert message not in problems(intermediate_size=80, model_parallel_size=2, mamba_causal_conv_fusion=True)
    assert message not in problems(intermediate_size=44)  # the PyTorch convolution takes any width
    assert message not in problems(intermediate_size=44, mamba_selective_scan_fusion=True)


def test_heads_only_constrain_attention_layers():
    """A pure-Mamba model has no heads (GPT-NeoX's mamba-1.4B keeps 12 with hidden 2048); a hybrid's attention
    layers still need them to divide hidden_size and the tensor-parallel ranks."""
    assert tiny_config(attention_config=[[["mamba"], 2]], num_attention_heads=3, model_parallel_size=2).problems() == []
    problems = tiny_config(attention_config=["mamba", "global"], num_attention_heads=3, model_parallel_size=2).problems()
    assert "hidden_size=32 must be divisible by num_attention_heads=3" in problems
    assert "num_attention_heads=3 must be divisible by model_parallel_size=2" in problems


@pytest.mark.parametrize("flag", ["mamba_selective_scan_fusion", "mamba_causal_conv_fusion", "mamba_inner_func_fusion"])
def test_kernel_flags_name_the_requirements_file_where_the_package_is_missing(flag):
    """With CUDA but without mamba-ssm / causal-conv1d (checked as a GPU worker would, on this machine that
    has neither package), the problem names the package and the requirements file."""
    import importlib.util

    from megatron.model.mamba import MAMBA_KERNELS, mamba_kernel_problems

    package = MAMBA_KERNELS[flag][0].split(".")[0]
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    [problem] = mamba_kernel_problems(tiny_config(attention_config=[[["mamba"], 2]], **{flag: True}),
                                      cuda_available=True)
    assert problem.startswith(f"{flag}=true needs {package}.") and "requirements/requirements-mamba.txt" in problem
