"""Shared helpers for the fused-kernel tests: a config with fusion flags, inputs, and dtype-aware comparison."""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.model.config import ModelConfig

# The fusion flags at their reference defaults (all off).
FUSION_FLAG_DEFAULTS = {
    "scaled_upper_triang_masked_softmax_fusion": False,
    "scaled_masked_softmax_fusion": False,
    "rope_fusion": False,
    "layernorm_fusion": False,
    "rmsnorm_fusion": False,
    "bias_gelu_fusion": False,
    "bias_dropout_fusion": False,
    "use_flashattn_swiglu": False,
}

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def flags_config(**flags: bool) -> ModelConfig:
    """A tiny ModelConfig with these fusion flags on (FusedOps reads only the flags)."""
    unknown = set(flags) - set(FUSION_FLAG_DEFAULTS)
    if unknown:
        raise KeyError(f"flags_config: not fusion flags {sorted(unknown)}")
    return ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=1, seq_length=4, **flags)


def randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Deterministic leaf tensor (requires grad) already rounded to ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randn(*shape, generator=generator) * scale
    return data.to(dtype).to(device).requires_grad_()


def as_fp32_leaf(t: torch.Tensor) -> torch.Tensor:
    """The same values in fp32 on CPU, as a fresh leaf: the exact-math input of the reference."""
    return t.detach().float().cpu().requires_grad_()


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    """Compare a fused result in ``dtype`` with the fp32 reference.

    fp32: the interpreter and torch agree to ~1e-6, so 1e-5 relative. bf16 / fp16: the result is
    stored with 8 / 11 bits of mantissa (and the interpreter truncates), so allow 1 ulp (at 1.0) relative
    to the tensor's scale. A wrong formula misses by orders of magnitude.
    """
    assert actual.dtype == dtype, f"{name}: dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    actual32 = actual.detach().float().cpu()
    expected32 = expected.detach().float().cpu()
    scale = max(expected32.abs().max().item(), 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(actual32, expected32, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
    else:
        one_ulp = torch.finfo(dtype).eps
        torch.testing.assert_close(
            actual32, expected32, rtol=one_ulp, atol=one_ulp * scale, msg=lambda m: f"{name}: {m}"
        )


def grads(output: torch.Tensor, inputs: Sequence[torch.Tensor], grad_output: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of <output, grad_output> with respect to inputs."""
    return list(torch.autograd.grad(output, list(inputs), grad_output.to(output.dtype).to(output.device)))
