"""Reading one YAML config's text the way GPT-NeoX users write it: flow style, `-` or `_` in keys, `1e-5` as a
number, and a key set twice refused (PyYAML silently keeps the last). Used for the run's config files
(megatron.neox_arguments.loading) and for the configs/*.yml a GPT-NeoX checkpoint carries (megatron.checkpoint)."""

import re
from typing import Any, Dict

import yaml

from megatron.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated inside one mapping (PyYAML keeps the last silently)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: Dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
        seen[key] = 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
# YAML 1.1 reads `1e-5` and `1.0e5` as strings; GPT-NeoX users write learning rates that way and mean numbers.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


COMMAND_LINE_OVERRIDES_FILE = "command_line_overrides.yml"  # beside the run's YAML files in a checkpoint's configs/


def normalize_key(key: str) -> str:
    """`train-iters` and `train_iters` name the same argument."""
    return key.replace("-", "_")


def parse_yaml_text(text: str, source: str) -> Dict[str, Any]:
    """Parse one config's text into a dict with normalised top-level keys; `source` names it in errors."""
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{source}: YAML syntax error{where}: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: a config file must be a mapping of argument names to values, "
                           f"got a {type(data).__name__}"])
    out: Dict[str, Any] = {}
    spelled: Dict[str, str] = {}
    problems = []
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"{source}: key {key!r} is not a string")
            continue
        norm = normalize_key(key)
        if norm in out:
            problems.append(f"{source}: '{norm}' is set twice (as '{spelled[norm]}' and '{key}')")
            continue
        out[norm] = value
        spelled[norm] = key
    if problems:
        raise ConfigError(problems)
    return out


def parse_yaml_value(text: str, source: str) -> Any:
    """One value as it would read after `key:` in a config file (`3e-4` a number, `true` a bool, `[1, 2]` a list,
    `null` or nothing None, anything else a string); `source` names it in errors."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{source}: {text!r} is not a YAML value: {problem}"]) from None
