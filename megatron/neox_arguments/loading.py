"""Reading GPT-NeoX YAML files and merging them into one flat dict of arguments.

GPT-NeoX configs are flow-style YAML (JSON-like, with `#` comments, trailing commas, True/False) and
spell keys with `-` or `_`. Several files are merged; a key set in two files is an error naming both,
because silently letting the later file win hides mistakes in long config stacks."""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from megatron.errors import ConfigError
from megatron.utils.text_files import read_utf8
from megatron.utils.yaml_text import normalize_key, parse_yaml_text

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
        try:
            text = read_utf8(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
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
