"""Importing optional packages only when the feature that needs them is switched on.

A missing extra must never break `import megatron...`; it is one clear error naming the flag that
asked for it and the requirements file that installs it."""

import importlib
from types import ModuleType


class MissingOptionalDependency(ImportError):
    """An optional package is needed by a switched-on feature and is not installed."""


def require(module: str, flag: str, extra: str) -> ModuleType:
    """Import `module` for the feature `flag`; `extra` names requirements/requirements-<extra>.txt."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingOptionalDependency(
            f"{flag} needs the Python package '{module.split('.')[0]}', which is not installed ({exc}). "
            f"Install it with: pip install -r requirements/requirements-{extra}.txt") from None
