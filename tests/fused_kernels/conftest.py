"""Fixtures for the fused-kernel tests.

Without a GPU the kernels run on CPU tensors through Triton's interpreter, whose mode is fixed
when triton is first imported: so, on such machines, import triton.language here (at collection,
before any test) with TRITON_INTERPRET=1, then restore the variable; each CPU test sets it again
for its own duration. On a GPU machine the same checks run compiled on CUDA (`gpu` marker).
"""
import importlib
import os
import sys

import pytest
import torch

from megatron.fused_kernels.triton_support import triton_installed

CUDA = torch.cuda.is_available()


def _import_triton_in_interpreter_mode() -> None:
    if CUDA or not triton_installed() or "triton" in sys.modules:
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.language")
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


_import_triton_in_interpreter_mode()

# CPU (interpreter) where there is no GPU, CUDA (compiled, skipped without a GPU) always.
DEVICES = ([] if CUDA else ["cpu"]) + [pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> str:
    """The device to test on; TRITON_INTERPRET is on only for the CPU run and only during the test."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return request.param
