"""Reading GPT-NeoX YAML files and merging them into one flat dict of arguments.

GPT-NeoX configs are flow-style YAML (JSON-like, with `#` comments, trailing commas, True/False) and
spell keys with `-` or `_`. Several files are merged; a key set in two files is an error naming both,
because silently letting the later file win hides mistakes in long config stacks."""

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

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


CONFIG_SUFFIXES = (".yml", ".yaml", ".json")


def resolve_config_paths(names: Sequence[str], conf_dir: Optional[str] = None) -> List[str]:
    """deepy.py's config file arguments as paths: relative to conf_dir (-d) when given, and a name without a
    suffix read as NAME.yml (`125M local_setup` is `125M.yml local_setup.yml`), as GPT-NeoX's deepy.py reads
    them; a file that exists under the name as given is taken as it is."""
    paths = []
    for name in names:
        path = os.path.join(conf_dir, name) if conf_dir else name
        if not path.endswith(CONFIG_SUFFIXES) and not os.path.isfile(path):
            path += ".yml"
        paths.append(path)
    return paths


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


def read_config_files(paths: Sequence[str]) -> Tuple[Dict[str, Any], Dict[str, str], Dict[str, str]]:
    """Merge YAML files. Returns (values, origin of each key, raw text of each file by file name)."""
    values: Dict[str, Any] = {}
    origin: Dict[str, str] = {}
    texts: Dict[str, str] = {}
    problems: List[str] = []
    for path in paths:
        if not os.path.isfile(path):
            problems.append(f"config file not found: {path}")
            continue
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        name = os.path.basename(path)
        texts[name if name not in texts else path] = text
        try:
            data = parse_yaml_text(text, path)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        for key, value in data.items():
            if key in values:
                problems.append(f"'{key}' is set in both {origin[key]} and {path}; set it in one file only")
                continue
            values[key] = value
            origin[key] = path
    if problems:
        raise ConfigError(problems)
    return values, origin, texts


def merge_overrides(values: Dict[str, Any], overrides: Mapping[str, Any] | None) -> Dict[str, Any]:
    """Command-line style overrides win over file values (that is their purpose, so no duplicate error)."""
    merged = dict(values)
    for key, value in (overrides or {}).items():
        merged[normalize_key(key)] = value
    return merged
