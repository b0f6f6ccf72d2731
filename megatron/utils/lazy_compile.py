"""Importing modules that call torch.compile at import time, without paying for TorchInductor then.

DeepSpeed's ZeRO checks the optimizer against its supported list, and to build that list imports its Muon
optimizer, whose module decorates three functions with torch.compile. Each decoration imports TorchInductor:
measured 2-3 s of CPU per rank on every ZeRO launch (10 s per rank on a loaded 2-core machine), for an optimizer
this project does not use. Imported through `import_with_lazy_compile`, those functions are compiled on their
first call instead, with the same arguments: nothing changes for a caller, and nothing is paid by a run that
never calls them."""

import contextlib
import functools
import importlib
import sys
from typing import Any, Callable, Iterator

import torch

DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def lazy(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_fn`` (torch.compile) that defers compiling each function to its first call."""
    def deferred(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda function: deferred(function, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred


@contextlib.contextmanager
def lazy_torch_compile() -> Iterator[None]:
    real = torch.compile
    torch.compile = lazy(real)
    try:
        yield
    finally:
        torch.compile = real


def import_with_lazy_compile(module: str) -> None:
    """Import ``module`` (if not yet imported) with torch.compile deferred to first use; a module that cannot
    be imported is left to its importer (DeepSpeed skips Muon on ImportError)."""
    if module in sys.modules:
        return
    with lazy_torch_compile():
        try:
            importlib.import_module(module)
        except ImportError:
            pass
