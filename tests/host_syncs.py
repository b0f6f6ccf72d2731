"""Counting, on CPU, the calls that make a CUDA host wait for its device (a test's proxy for
``torch.cuda.set_sync_debug_mode``, which exists only with a GPU).

On a GPU a host sync is any call that needs a device value on the host: ``.item()`` / ``int()`` / ``float()`` /
``bool()`` of a tensor (all through ``aten._local_scalar_dense``), ``torch.equal``, ``.tolist()`` / ``.cpu()`` /
``.numpy()``, and the operators whose output size depends on the data (``nonzero`` and boolean indexing,
``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``). On CPU they cost nothing
and no debug mode reports them, so ``HostSyncCounter`` sees the aten ones through a TorchDispatchMode and the Python
ones (``tolist`` / ``cpu`` / ``numpy``, which do not reach the dispatcher for a CPU tensor) by wrapping the methods
while it is active. Each call is attributed to the innermost frame in the project's ``megatron`` package
(``file:line``, as the GPU check prints them), or ``other`` for calls from torch / DeepSpeed alone.
"""
from __future__ import annotations

import collections
import os
import sys
from typing import Counter, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megatron") + os.sep

_SYNCING_OPS = {"_local_scalar_dense", "equal", "nonzero", "masked_select", "unique", "_unique", "_unique2",
                "unique_dim", "unique_consecutive", "bincount"}
"""aten operators (by their overload packet's name) that wait for the device on CUDA."""

_SYNCING_METHODS = ("tolist", "cpu", "numpy")


def _where() -> str:
    """file:line (relative to the repository) of the innermost project frame of the caller's stack."""
    frame: Optional[object] = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PROJECT):
            return f"{os.path.relpath(path, os.path.dirname(os.path.dirname(_PROJECT)))}:{frame.f_lineno}"
        frame = frame.f_back
    return "other"


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.by_site`` ({file:line: count}) and ``syncs.total``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_site: Counter[str] = collections.Counter()
        self._saved = {}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Nothing is compiled under this mode, so torch need not wrap ``__torch_dispatch__`` in dynamo's disable,
        whose first call imports torch._dynamo (seconds, on a 2-core machine)."""
        return False

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def project_sites(self) -> Counter[str]:
        """The counts of the sites inside the project's package (without ``other``)."""
        return collections.Counter({site: n for site, n in self.by_site.items() if site != "other"})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNCING_OPS or (name == "repeat_interleave" and func._overloadname == "Tensor"
                                    and kwargs.get("output_size") is None):
            self.by_site[_where()] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        for method in _SYNCING_METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor, *args, _original=original, **kwargs):
                self.by_site[_where()] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved.clear()
        return super().__exit__(*exc)
