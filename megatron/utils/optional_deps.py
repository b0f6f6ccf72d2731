"""Importing optional packages only when the feature that needs them is switched on.

A missing extra must never break `import megatron...`; it is one clear error naming the flag that
asked for it and the requirements file that installs it. `missing_feature_packages` finds, before anything is
built, the packages a config's switched-on features will import (deepy.py's pre-launch report, and each training
worker before it starts, whose environment may differ on other nodes)."""

import importlib
import importlib.util
from types import ModuleType
from typing import Any, Dict, List, Tuple


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


LOGGING_SCRIPTS = ("train.py", "eval.py")
"""Worker scripts that write metrics to tensorboard / wandb / comet (megatron.observability.training_logger)."""
MODEL_SCRIPTS = ("train.py", "generate.py", "eval.py")
"""Worker scripts that build the tokenizer."""
TOKENIZER_PACKAGES = {"SPMTokenizer": ("sentencepiece", "sentencepiece"), "TiktokenTokenizer": ("tiktoken", "tiktoken")}
"""tokenizer_type -> (the package it imports, its requirements/requirements-<extra>.txt)."""


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and bool(section.get("enabled"))


def feature_packages(args: Any, script: str) -> List[Tuple[str, str, str]]:
    """(package, the setting that needs it, its extra) for every optional package the switched-on features of
    ``args`` (NeoXArgs) need in the workers of ``script`` (train.py, eval.py, generate.py)."""
    wanted: List[Tuple[str, str, str]] = []
    if script in LOGGING_SCRIPTS:
        if args.tensorboard_dir:
            wanted.append(("tensorboard", f"tensorboard_dir={args.tensorboard_dir!r}", "tensorboard"))
        if args.use_wandb:
            wanted.append(("wandb", "use_wandb: true", "wandb"))
        if args.use_comet:
            wanted.append(("comet_ml", "use_comet: true", "comet"))
    if script == "train.py":  # DeepSpeed's monitors (its engine's config sections)
        if _enabled(args.tensorboard):
            wanted.append(("tensorboard", "the DeepSpeed section tensorboard: {enabled: true}", "tensorboard"))
        if _enabled(args.wandb):
            wanted.append(("wandb", "the DeepSpeed section wandb: {enabled: true}", "wandb"))
    if script == "train.py" and args.s3_path:  # megatron.checkpoint.s3_upload
        wanted.append(("boto3", f"s3_path={args.s3_path!r}", "s3"))
    if args.eval_tasks and script in ("eval.py", "train.py"):
        wanted.append(("lm_eval", "eval_tasks", "eval"))
    if script in MODEL_SCRIPTS and args.tokenizer_type in TOKENIZER_PACKAGES:
        package, extra = TOKENIZER_PACKAGES[args.tokenizer_type]
        wanted.append((package, f"tokenizer_type={args.tokenizer_type}", extra))
    return wanted


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (found, not imported: the launcher stays fast)."""
    return importlib.util.find_spec(package) is not None


def missing_feature_packages(args: Any, script: str) -> List[str]:
    """One message per optional package that feature_packages wants and this Python does not have, naming every
    setting that needs it and the requirements file that installs it."""
    missing: Dict[Tuple[str, str], List[str]] = {}
    for package, setting, extra in feature_packages(args, script):
        if not installed(package):
            missing.setdefault((package, extra), []).append(setting)
    problems = []
    for (package, extra), settings in missing.items():
        settings = list(dict.fromkeys(settings))
        problems.append(f"{' and '.join(settings)} need{'s' if len(settings) == 1 else ''} the Python package "
                        f"'{package}', which is not installed: pip install -r requirements/requirements-{extra}.txt "
                        f"(or turn {'it' if len(settings) == 1 else 'them'} off)")
    return problems
