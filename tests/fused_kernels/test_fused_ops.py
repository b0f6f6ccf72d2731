"""FusedOps: flags pick fused or reference ops (on CUDA the implementation measured faster), missing
Triton is one clear error, importing the package does not import triton, and a small transformer block
built from all fused ops gives the same output and gradients as the same block built from the references."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import megatron.fused_kernels as fk
from megatron.fused_kernels import CUDA_CHOICE, KERNELS, PYTORCH, TRITON, FusedOps, flag_implementation, triton_support
from megatron.fused_kernels.cuda_choice import PytorchOnCuda, runs_triton
from tests.fused_kernels.helpers import FUSION_FLAG_DEFAULTS, flags_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_flag_has_a_kernel():
    assert sorted(flag for flag, _, _ in KERNELS.values()) == sorted(FUSION_FLAG_DEFAULTS)


def test_flags_off_give_references():
    ops = FusedOps.from_args(flags_config())
    for name, (_, _, reference) in KERNELS.items():
        assert getattr(ops, name) is reference, name
    assert ops.cross_entropy is fk.cross_entropy_reference


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_flag_selects_only_its_kernel(device, name):
    flag = KERNELS[name][0]
    ops = FusedOps.from_args(flags_config(**{flag: True}))
    for other, (_, fused, reference) in KERNELS.items():
        want = flag_implementation(other, fused, reference) if other == name else reference
        assert getattr(ops, other) == want, other


def test_fused_cross_entropy_option(device):
    ops = FusedOps.from_args(flags_config(), fused_cross_entropy=True)
    assert ops.cross_entropy == flag_implementation("cross_entropy", fk.cross_entropy, fk.cross_entropy_reference)


def test_flag_runs_the_measured_choice_on_cuda_and_triton_elsewhere():
    assert set(CUDA_CHOICE) == set(KERNELS) | {"cross_entropy"}
    for name, (_, fused, reference) in KERNELS.items():
        chosen = flag_implementation(name, fused, reference)
        if CUDA_CHOICE[name].runs == TRITON:
            assert chosen is fused, name
        else:
            assert CUDA_CHOICE[name].runs == PYTORCH and chosen == PytorchOnCuda(fused, reference), name
    calls = []
    dispatch = PytorchOnCuda(lambda x, *a: calls.append(("triton", a)), lambda x, *a: calls.append(("pytorch", a)))
    dispatch(SimpleNamespace(is_cuda=True), 1)
    dispatch(torch.zeros(1), 2)
    assert calls == [("pytorch", (1,)), ("triton", (2,))]
    assert not runs_triton(dispatch, SimpleNamespace(is_cuda=True)) and runs_triton(dispatch, torch.zeros(1))
    assert runs_triton(fk.rotary, SimpleNamespace(is_cuda=True))


def test_kernel_candidates_give_both_implementations_and_what_the_flag_runs():
    candidates = {c.op: c for c in fk.kernel_candidates()}
    assert list(candidates) == [*KERNELS, "cross_entropy"]
    for name, (flag, fused, reference) in KERNELS.items():
        c = candidates[name]
        assert (c.flag, c.triton, c.pytorch, c.on_cuda) == (flag, fused, reference, CUDA_CHOICE[name].runs)
        assert c.flag_runs_on_cuda() is (fused if c.on_cuda == TRITON else reference)
        assert "Triton" in c.measured and "ms" in c.measured
    assert candidates["cross_entropy"].triton is fk.cross_entropy


def test_missing_triton_names_flag_and_requirements_file(monkeypatch):
    monkeypatch.setattr(triton_support, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="rope_fusion.*requirements/requirements-triton.txt"):
        FusedOps.from_args(flags_config(rope_fusion=True))
    FusedOps.from_args(flags_config())  # flags off need no triton


def test_no_gpu_and_no_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="'layernorm_fusion', 'bias_gelu_fusion'.*no CUDA device"):
        FusedOps.from_args(flags_config(layernorm_fusion=True, bias_gelu_fusion=True))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fk.layer_norm(torch.randn(2, 4), None, None, 1e-5)


def test_import_does_not_import_triton():
    code = "import sys, megatron.fused_kernels; assert 'triton' not in sys.modules, 'triton imported'"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO_ROOT}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _block(ops: FusedOps, params: dict, x: torch.Tensor, targets: torch.Tensor, explicit_mask: bool) -> torch.Tensor:
    """A pre-norm GPT block (rotary causal attention + SwiGLU/GeLU MLP) and its LM loss; the causal
    softmax is the upper-triangular one, or the masked one with an explicit causal mask."""
    batch, seq, hidden = x.shape
    heads, head_dim = 2, hidden // 2
    h = ops.layer_norm(x, params["ln_w"], params["ln_b"], 1e-5)
    q, k, v = (h @ params["qkv"]).view(batch, seq, heads, 3 * head_dim).split(head_dim, dim=-1)
    cos, sin = fk.rotary_tables(seq, 4, device=x.device)
    q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
    if explicit_mask:
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(diagonal=1)
        probs = ops.masked_softmax(scores, future[None, None], head_dim**-0.5)
    else:
        probs = ops.upper_triang_masked_softmax(scores, head_dim**-0.5)
    context = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, hidden)
    x = ops.bias_dropout_add(context @ params["proj"], params["proj_b"], x, 0.0, True)
    h = ops.rms_norm(x, params["rms_w"], None, 1e-8)
    up, gate = (h @ params["fc"]).chunk(2, dim=-1)
    h = ops.bias_gelu(ops.swiglu(gate, up), params["act_b"], "tanh")
    x = ops.bias_dropout_add(h @ params["out"], None, x, 0.0, True)
    logits = x.reshape(batch * seq, hidden) @ params["head"]
    return ops.cross_entropy(logits, targets).mean()


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_block_of_fused_ops_matches_reference_block(device, explicit_mask):
    generator = torch.Generator().manual_seed(0)
    hidden, ffn, vocab = 12, 10, 29
    shapes = {
        "ln_w": (hidden,), "ln_b": (hidden,), "qkv": (hidden, 3 * hidden), "proj": (hidden, hidden),
        "proj_b": (hidden,), "rms_w": (hidden,), "fc": (hidden, 2 * ffn), "act_b": (ffn,),
        "out": (ffn, hidden), "head": (hidden, vocab),
    }
    params = {name: (torch.randn(*shape, generator=generator) * 0.3).to(device).requires_grad_()
              for name, shape in shapes.items()}
    x = torch.randn(2, 6, hidden, generator=generator).to(device)
    targets = torch.randint(0, vocab, (12,), generator=generator).to(device)
    losses, gradients = [], []
    for ops in (FusedOps.fused(), FusedOps.reference()):
        loss = _block(ops, params, x, targets, explicit_mask)
        losses.append(loss.detach())
        gradients.append(torch.autograd.grad(loss, list(params.values())))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for name, fused_grad, reference_grad in zip(params, *gradients):
        torch.testing.assert_close(fused_grad, reference_grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
