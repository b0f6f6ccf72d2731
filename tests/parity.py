"""Parity checks that show their numbers: the largest absolute and relative difference found, printed on every call
(pytest shows it with -s, and on failure), and both series in the failure message; tolerances are stated beside
the measured differences they were chosen from."""

from typing import Any

import torch


def parity(got: Any, want: Any) -> tuple:
    """(largest absolute difference, largest relative difference) of two equally shaped series."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    diff = (got - want).abs()
    relative = diff / want.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return float(diff.max()) if diff.numel() else 0.0, float(relative.max()) if diff.numel() else 0.0


def assert_parity(got: Any, want: Any, rtol: float, atol: float = 0.0, what: str = "") -> None:
    """Every |got - want| <= atol + rtol |want|; prints the measured differences, and fails with both series."""
    largest, relative = parity(got, want)
    print(f"parity {what}: max abs diff {largest:.3g}, max rel diff {relative:.3g} (rtol {rtol:g}, atol {atol:g})")
    g, w = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if not bool(((g - w).abs() <= atol + rtol * w.abs()).all()):
        raise AssertionError(f"{what}: max abs diff {largest:.3g}, max rel diff {relative:.3g} beyond rtol {rtol:g}, "
                             f"atol {atol:g}\n  got:  {g.tolist()}\n  want: {w.tolist()}")
