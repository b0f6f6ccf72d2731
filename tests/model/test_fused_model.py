"""Each fusion flag gives the same logits and gradients as the unfused model with the same weights.

The fused models run the real Triton kernels on CPU through Triton's interpreter. Its mode is fixed
when triton is first imported in a process, and other tests of the suite may import triton first in
the other mode, so the fused runs happen in a fresh subprocess (this file run as a script, with
TRITON_INTERPRET=1) that saves logits, gradients and kernel call counts; the tests here compare them.
The tensor-parallel paths (TP=2, with and without sequence parallelism) are checked the same way in
two gloo processes, each setting TRITON_INTERPRET=1 before anything imports triton. Also: a flag that
cannot run (no GPU, no interpreter; or no triton at all) fails the model build with
one error naming the flag, and the unfused model builds and runs with triton not importable.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch

from megatron.model.gpt2_model import build_model
from megatron.mpu import ParallelState, SingleProcessState
from megatron.errors import ConfigError
from tests.accelerator import deepspeed_accelerator_env
from tests.distributed_helpers import run_distributed
from tests.model.helpers import random_batch
from tests.model.kv_helpers import incremental_logits
from tests.model.helpers import tiny_config
from tests.model.tp_helpers import expected_local, gather_vocab

REPO = Path(__file__).resolve().parents[2]
UPPER = "scaled_upper_triang_masked_softmax_fusion"
MASKED = "scaled_masked_softmax_fusion"
ALL_FLAGS = ("layernorm_fusion", "rope_fusion", UPPER, MASKED, "bias_gelu_fusion", "bias_dropout_fusion")

# case: (model options, fusion flags turned on, FusedOps fields that must have run fused).
CASES: Dict[str, tuple] = {
    "layernorm_fusion": (dict(norm="layernorm", use_qk_layernorm=True), ("layernorm_fusion",), ("layer_norm",)),
    "rmsnorm_fusion": (dict(norm="rmsnorm", use_qk_layernorm=True), ("rmsnorm_fusion",), ("rms_norm",)),
    "rope_fusion": (dict(pos_emb="rotary", rotary_pct=0.5, num_kv_heads=2), ("rope_fusion",), ("rotary",)),
    UPPER: (dict(apply_query_key_layer_scaling=True), (UPPER,), ("upper_triang_masked_softmax",)),
    MASKED: (dict(sliding_window_width=5), (MASKED,), ("masked_softmax",)),
    f"{MASKED}-alibi": (dict(pos_emb="alibi"), (MASKED,), ("masked_softmax",)),
    "bias_gelu_fusion": (dict(activation="gelu"), ("bias_gelu_fusion",), ("bias_gelu",)),
    "bias_dropout_fusion": (dict(), ("bias_dropout_fusion",), ("bias_dropout_add",)),
    "use_flashattn_swiglu": (dict(activation="swiglu"), ("use_flashattn_swiglu",), ("swiglu",)),
    "all-gpt_j_residual": (
        dict(pos_emb="rotary", use_qk_layernorm=True, gpt_j_residual=True),
        ALL_FLAGS,
        ("layer_norm", "rotary", "upper_triang_masked_softmax", "bias_gelu", "bias_dropout_add"),
    ),
}
# Triton's interpreter runs each kernel program in Python: one short sequence keeps the fused runs to seconds.
INTERPRETED = dict(batch=1, seq=8)
# Decoding token by token through a KV cache (queries shorter than keys: the masked softmax).
DECODE_CASE = "all-kv-cache"
DECODE_OPTIONS = dict(pos_emb="rotary", rotary_pct=0.5)
# Hidden dropout through the fused bias_dropout_add: drawn from torch's RNG, off in eval.
DROPOUT_CASE = "bias_dropout_fusion-hidden_dropout"


def _randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights of order one (norm gains around 1, nonzero biases), so the activations are far from
    the small-input regime where different functions (e.g. exact vs tanh GeLU) agree anyway."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.3
            param.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))


def _run(model: torch.nn.Module) -> Dict[str, Any]:
    inputs, labels = random_batch(**INTERPRETED)
    logits = model(inputs)
    model.loss_fn(logits, labels).backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _twins(options: dict, flags: tuple) -> tuple:
    """(unfused model, fused model with the unfused one's weights)."""
    plain = build_model(tiny_config(**options), SingleProcessState())
    _randomize(plain)
    fused = build_model(tiny_config(**options, **{flag: True for flag in flags}), SingleProcessState())
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def _counting(fn: Callable, counts: Dict[str, int], field: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[field] = counts.get(field, 0) + 1
        return fn(*args, **kwargs)

    return wrapper


def _worker(out_path: str) -> None:
    """Subprocess body (TRITON_INTERPRET=1 is set by the caller): run every case unfused and fused."""
    from megatron import fused_kernels

    counts: Dict[str, int] = {}
    for field, (flag, fused, reference) in list(fused_kernels.KERNELS.items()):
        fused_kernels.KERNELS[field] = (flag, _counting(fused, counts, field), reference)
    results = {}
    for case, (options, flags, _) in CASES.items():
        plain, fused = _twins(options, flags)
        counts.clear()
        results[case] = {"plain": _run(plain), "fused": _run(fused), "calls": dict(counts)}
    plain, fused = _twins(DECODE_OPTIONS, ALL_FLAGS)
    inputs, _ = random_batch(**INTERPRETED)
    counts.clear()
    with torch.no_grad():
        plain_logits = plain(inputs)
        fused.eval()
        step_logits = incremental_logits(fused, inputs[0], prompt=5)
    results[DECODE_CASE] = {"plain": plain_logits, "fused": step_logits, "calls": dict(counts)}
    # One transformer layer, whose only randomness is the fused bias-dropout-add of its two residuals.
    plain, fused = _twins(dict(hidden_dropout=0.3), ("bias_dropout_fusion",))
    plain.eval()
    runs = {}
    with torch.no_grad():
        hidden_and_mask = plain.embedding(tuple(inputs))
        for name, seed in (("seed5", 5), ("seed5_again", 5), ("seed6", 6)):
            torch.manual_seed(seed)
            runs[name] = fused.layers[0](hidden_and_mask)[0]
        fused.eval()
        runs["eval"], runs["plain_eval"] = fused.layers[0](hidden_and_mask)[0], plain.layers[0](hidden_and_mask)[0]
    results[DROPOUT_CASE] = runs
    torch.save(results, out_path)


def _subprocess_env(**changes: str | None) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **deepspeed_accelerator_env())
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.fixture(scope="module")
def fused_results(tmp_path_factory) -> Dict[str, Any]:
    """Run :func:`_worker` once in a fresh interpreter with Triton's interpreter on; load its results."""
    out = tmp_path_factory.mktemp("fused") / "results.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.model.test_fused_model", str(out)], cwd=REPO,
        env=_subprocess_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"fused worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fused_flag_matches_unfused_logits_and_grads(fused_results, case):
    result = fused_results[case]
    for field in CASES[case][2]:
        assert result["calls"].get(field, 0) > 0, f"{case}: the fused {field} never ran ({result['calls']})"
    plain, fused = result["plain"], result["fused"]
    torch.testing.assert_close(fused["logits"], plain["logits"], rtol=1e-5, atol=1e-5, msg=f"{case} logits")
    assert fused["grads"].keys() == plain["grads"].keys()
    for name, want in plain["grads"].items():
        torch.testing.assert_close(fused["grads"][name], want, rtol=1e-4, atol=1e-5, msg=f"{case} grad {name}")


@pytest.mark.slow
def test_fused_kv_cache_decoding_matches_unfused_full_forward(fused_results):
    result = fused_results[DECODE_CASE]
    for field in ("layer_norm", "rotary", "masked_softmax", "bias_gelu", "bias_dropout_add"):
        assert result["calls"].get(field, 0) > 0, f"the fused {field} never ran while decoding"
    torch.testing.assert_close(result["fused"], result["plain"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_fused_hidden_dropout_follows_torch_rng_and_is_off_in_eval(fused_results):
    runs = fused_results[DROPOUT_CASE]
    torch.testing.assert_close(runs["seed5_again"], runs["seed5"], rtol=0, atol=0)
    assert not torch.allclose(runs["seed6"], runs["seed5"], atol=1e-3)
    assert not torch.allclose(runs["seed5"], runs["eval"], atol=1e-3)
    torch.testing.assert_close(runs["eval"], runs["plain_eval"], rtol=1e-5, atol=1e-5)


def test_bias_fusions_keep_the_bias_in_the_linear_where_the_flag_runs_pytorch(monkeypatch):
    """Where a bias fusion's flag runs PyTorch's implementation (CUDA tensors, megatron.fused_kernels.cuda_choice)
    the layers take the unfused path, bias inside the linear's GEMM, so the flag costs nothing over flag off:
    the same logits and gradients, bit for bit, and the fused ops never called."""
    from megatron.model import mlp, transformer

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the flags build here; no kernel runs below
    for module in (mlp, transformer):
        monkeypatch.setattr(module, "runs_triton", lambda op, x: False)
    plain, fused = _twins(dict(activation="gelu"), ("bias_gelu_fusion", "bias_dropout_fusion"))

    def never(*args, **kwargs):
        raise AssertionError("a bias fusion ran where its flag runs PyTorch's implementation")

    for layer in fused.layers:
        layer.mlp.bias_gelu, layer.bias_dropout_add = never, never
    torch.manual_seed(0)
    want = _run(plain)
    torch.manual_seed(0)
    got = _run(fused)
    torch.testing.assert_close(got["logits"], want["logits"], rtol=0, atol=0)
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=0, msg=name)


def test_comparison_tolerance_detects_a_different_gelu():
    """The tolerances above are tight enough to tell the exact GeLU from the tanh one on these weights."""
    plain, other = _twins(dict(activation="gelu"), ())
    for layer in other.layers:
        layer.mlp.activation = functools.partial(torch.nn.functional.gelu, approximate="tanh")
    want, got = _run(plain), _run(other)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)


def test_rotary_kernel_layout_equals_apply_rotary():
    """The model rotates q/k in [batch, seq, heads, dim] (the kernel's layout); the result must equal
    positional.apply_rotary on [batch, heads, seq, dim], the layout it had before."""
    from megatron.fused_kernels import rotary_reference
    from megatron.model.positional import RotaryEmbedding, apply_rotary

    x = torch.randn(2, 7, 3, 8, generator=torch.Generator().manual_seed(1))
    cos, sin = RotaryEmbedding(4, 10000.0)(torch.arange(3, 10))
    torch.testing.assert_close(rotary_reference(x, cos, sin).transpose(1, 2), apply_rotary(x.transpose(1, 2), cos, sin),
                               rtol=0, atol=0)


@pytest.mark.parametrize(
    "options, flag",
    [
        (dict(norm="rmsnorm"), "layernorm_fusion"),
        (dict(norm="scalenorm"), "rmsnorm_fusion"),
        (dict(pos_emb="learned"), "rope_fusion"),
        (dict(activation="swiglu"), "bias_gelu_fusion"),
    ],
)
def test_flag_without_its_op_is_a_config_error(options, flag):
    with pytest.raises(ConfigError, match=flag):
        build_model(tiny_config(**options, **{flag: True}), SingleProcessState())


@pytest.mark.parametrize("flag", [UPPER, MASKED])
def test_softmax_fusion_with_only_flash_layers_builds_unfused(flag):
    """Flash attention computes its own softmax: the flag is accepted (GPT-NeoX's Pythia configs set it) and
    the model neither uses nor requires the fused softmax (no triton needed), whatever the machine."""
    from megatron.fused_kernels import scaled_masked_softmax_reference, scaled_upper_triang_masked_softmax_reference
    from megatron.model.fused import model_fused_ops

    args = tiny_config(attention_config=["flash", "flash"], **{flag: True})
    ops = model_fused_ops(args)
    assert ops.upper_triang_masked_softmax is scaled_upper_triang_masked_softmax_reference
    assert ops.masked_softmax is scaled_masked_softmax_reference
    model = build_model(args, SingleProcessState())
    inputs, _ = random_batch()
    assert torch.isfinite(model(inputs)).all()


TP_CONFIGS = [
    (dict(pos_emb="rotary", num_kv_heads=2, use_qk_layernorm=True, sequence_parallel=True), ALL_FLAGS),
    (dict(pos_emb="alibi", norm="rmsnorm", gpt_j_residual=True),
     ("rmsnorm_fusion", MASKED, "bias_gelu_fusion", "bias_dropout_fusion")),
]


def _tp_compare(rank: int, world_size: int) -> None:
    """Fused TP=2 model (weights sharded from a randomized TP=1 model) vs the unfused TP=1 model."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the first fused op imports triton in this process
    inputs, labels = random_batch(**INTERPRETED)
    for options, flags in TP_CONFIGS:
        args = tiny_config(model_parallel_size=2, **options)
        ref = build_model(args, SingleProcessState())
        _randomize(ref)
        ref_logits = ref(inputs)
        ref_loss = ref.loss_fn(ref_logits, labels)
        ref_loss.backward()
        state = ParallelState(pipe_parallel_size=0, model_parallel_size=2)
        model = build_model(tiny_config(model_parallel_size=2, **options, **{f: True for f in flags}), state)
        with torch.no_grad():
            for name, (want, mine) in expected_local(ref, model, rank, 2, grads=False).items():
                mine.copy_(want)
        logits = model(inputs)
        loss = model.loss_fn(logits, labels)
        loss.backward()
        msg = f"{options} {flags}"
        torch.testing.assert_close(gather_vocab(logits, state.get_model_parallel_group()), ref_logits,
                                   rtol=1e-5, atol=1e-5, msg=msg)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=msg)
        for name, (want, got) in expected_local(ref, model, rank, 2, grads=True).items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{msg} grad {name}")
        state.destroy()


@pytest.mark.slow
def test_fused_tp2_matches_unfused_tp1():
    run_distributed(_tp_compare, world_size=2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["all-gpt_j_residual", f"{MASKED}-alibi", "rmsnorm_fusion"])
def test_fused_flags_compiled_on_cuda_match_unfused(case, monkeypatch):
    """On a GPU the same comparison with the compiled kernels (TRITON_INTERPRET off)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    options, flags, _ = CASES[case]
    plain, fused = (model.cuda() for model in _twins(options, flags))
    inputs, labels = (tuple(t.cuda() for t in part) for part in random_batch())
    results = []
    for model in (plain, fused):
        logits = model(inputs)
        model.loss_fn(logits, labels).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-4, msg=f"{case} grad {name}")


NO_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    {prelude}
    from megatron.model.gpt2_model import build_model
    from megatron.mpu import SingleProcessState
    from megatron.errors import ConfigError
    from tests.model.helpers import random_batch
    from tests.model.helpers import tiny_config

    model = build_model(tiny_config(pos_emb="rotary"), SingleProcessState())
    model(random_batch()[0]).sum().backward()
    print("unfused model ran; triton imported:", sys.modules.get("triton") is not None)
    try:
        build_model(tiny_config(pos_emb="rotary", {flag}=True), SingleProcessState())
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    sys.exit(0)
    """
)


def _run_script(prelude: str, flag: str) -> subprocess.CompletedProcess:
    code = NO_DEVICE_SCRIPT.format(prelude=prelude, flag=flag)
    env = _subprocess_env(TRITON_INTERPRET=None, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_flag_on_without_gpu_or_interpreter_is_one_clear_error():
    proc = _run_script("", "rope_fusion")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unfused model ran; triton imported: False" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("Invalid NeoX configuration:"), proc.stderr[-3000:]
    assert "'rope_fusion'" in message and "TRITON_INTERPRET=1" in message and "GPU" in message


@pytest.mark.slow
def test_without_triton_unfused_model_runs_and_flag_names_the_package():
    # sys.modules["triton"] = None makes triton unimportable (and invisible to importlib.util.find_spec).
    proc = _run_script("sys.modules['triton'] = None", "bias_gelu_fusion")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "unfused model ran; triton imported: False" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert "'bias_gelu_fusion'" in message and "'triton' package is not installed" in message
    assert "requirements/requirements-triton.txt" in message


if __name__ == "__main__":
    _worker(sys.argv[1])
