"""Building DeepSpeed's JIT-compiled CUDA ops (FusedAdam) whatever TORCH_CUDA_ARCH_LIST says.

DeepSpeed 0.19's JIT builder (op_builder/builder.py, CUDAOpBuilder.compute_capability_args) reads
TORCH_CUDA_ARCH_LIST and parses every entry as ``<major>.<minor>[+PTX]`` with int(). PyTorch accepts more: the
architecture-specific and family suffixes ``9.0a`` (sm_90a) and ``10.0f``, and names such as ``Hopper``; CUDA
images set such lists (the first H200 run of this project had a ``9.0a`` entry), and DeepSpeed then dies with
``ValueError: invalid literal for int() with base 10: '0a'``. Its plain ops (FusedAdam's multi-tensor Adam) need
none of those features, so while DeepSpeed builds an op the list is rewritten into one it parses: suffixes
dropped, names left out, and, where nothing is left, the variable unset (DeepSpeed then builds for the visible
devices' own capabilities). The user's value is restored afterwards."""

import contextlib
import logging
import os
import re
from typing import Iterator, MutableMapping, Optional

ARCH_LIST_VARIABLE = "TORCH_CUDA_ARCH_LIST"

_ENTRY = re.compile(r"^(\d+)\.(\d+)[a-z]?(\+PTX)?$")
"""<major>.<minor>, an optional one-letter suffix (a: architecture-specific, f: family), an optional +PTX."""

_log = logging.getLogger(__name__)


def deepspeed_arch_list(value: str) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST ``value`` as DeepSpeed 0.19's builder can parse it (``;``-separated ``X.Y`` /
    ``X.Y+PTX``, in order, without repeats), or None where no entry is a numbered architecture (then the
    variable should be unset). ``"8.0 9.0a+PTX"`` -> ``"8.0;9.0+PTX"``, ``"Hopper"`` -> None."""
    kept = []
    for entry in value.replace(" ", ";").split(";"):
        match = _ENTRY.match(entry.strip())
        if match is None:
            continue
        cleaned = f"{int(match.group(1))}.{int(match.group(2))}{match.group(3) or ''}"
        if cleaned not in kept:
            kept.append(cleaned)
    return ";".join(kept) or None


@contextlib.contextmanager
def arch_list_deepspeed_can_parse(environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Within the block TORCH_CUDA_ARCH_LIST is what ``deepspeed_arch_list`` makes of it (unset where nothing
    parsable is left); afterwards the original value, whatever happened inside."""
    original = environ.get(ARCH_LIST_VARIABLE)
    if original is None or not original.strip():
        yield
        return
    cleaned = deepspeed_arch_list(original)
    if cleaned == original.strip():
        yield
        return
    _log.info("building DeepSpeed's op with %s=%s (it cannot parse %r)", ARCH_LIST_VARIABLE,
              cleaned if cleaned is not None else "<unset: the devices' own capabilities>", original)
    try:
        if cleaned is None:
            del environ[ARCH_LIST_VARIABLE]
        else:
            environ[ARCH_LIST_VARIABLE] = cleaned
        yield
    finally:
        environ[ARCH_LIST_VARIABLE] = original
