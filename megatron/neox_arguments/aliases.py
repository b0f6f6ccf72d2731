"""Older GPT-NeoX argument names, accepted with a deprecation warning and mapped to their successors.

Names that have no successor are refused with a message saying what to do instead, so that an old
config never silently loses a setting."""

import warnings
from typing import Any, Dict, List

ALIASES: Dict[str, str] = {
    "save_interval": "checkpoint_factor",
    "gas": "gradient_accumulation_steps",
}
"""Older name -> current name."""

DEEPSPEED_PASSTHROUGH_ALIASES = ("zero_allow_untested_optimizer",)
"""Older top-level names that now belong in deepspeed_extra_args (DeepSpeed still reads them)."""

REMOVED: Dict[str, str] = {
    "apply_residual_connection_post_layernorm":
        "the BERT-style post-layernorm residual was removed from GPT-NeoX and is not supported; delete the key",
    "detect_nvlink_pairs":
        "NVLink pair detection was an EleutherAI DeepSpeed-fork feature that upstream DeepSpeed does not have; "
        "delete the key (set CUDA_VISIBLE_DEVICES yourself to pair GPUs)",
    "deepscale": "deprecated since DeepSpeed was renamed; delete the key",
    "deepscale_config": "deprecated since DeepSpeed was renamed; put DeepSpeed keys in the YAML config instead",
}


class NeoXDeprecationWarning(FutureWarning):
    """Shown by default (unlike DeprecationWarning) because users need to update their configs."""


def apply_aliases(values: Dict[str, Any], origin: Dict[str, str]) -> List[str]:
    """Rewrite older names in place; return problems (both names set, or a removed name)."""
    problems: List[str] = []
    for old, new in ALIASES.items():
        if old not in values:
            continue
        where = origin.get(old, "the config")
        if new in values:
            problems.append(f"'{old}' ({where}) is the older name of '{new}', which is also set "
                            f"({origin.get(new, 'the config')}); keep only '{new}'")
            continue
        warnings.warn(f"{where}: '{old}' is deprecated, use '{new}'", NeoXDeprecationWarning, stacklevel=3)
        values[new] = values.pop(old)
        origin[new] = origin.pop(old, where)
    for old in DEEPSPEED_PASSTHROUGH_ALIASES:
        if old not in values:
            continue
        where = origin.get(old, "the config")
        extra = values.get("deepspeed_extra_args") or {}
        if not isinstance(extra, dict):
            continue  # the type check reports deepspeed_extra_args itself
        if old in extra:
            problems.append(f"'{old}' ({where}) is also set in deepspeed_extra_args; keep only one")
            continue
        warnings.warn(f"{where}: top-level '{old}' is deprecated, put it in deepspeed_extra_args",
                      NeoXDeprecationWarning, stacklevel=3)
        values["deepspeed_extra_args"] = {**extra, old: values.pop(old)}
    for old, why in REMOVED.items():
        if values.get(old):  # deepscale* are still fields (for docs); only a set value is refused
            problems.append(f"'{old}' ({origin.get(old, 'the config')}): {why}")
    return problems
