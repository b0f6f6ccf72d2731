"""`deepy.py ... --set KEY=VALUE`: one run's change to the config without editing its YAML files.

KEY is an argument's name (`train_iters`, `-` or `_`) or a path into a dict-valued argument with dots
(`optimizer.params.lr`); VALUE is read as it would be after `KEY:` in a YAML file (`3e-4` a number, `[1, 2]` a
list, `null` None). The values go into the merged config before validation, so they are checked exactly as the
files' values are, and each problem names its `--set KEY`. They are recorded beside the run's files in every
checkpoint (COMMAND_LINE_OVERRIDES_FILE, the whole value of each argument they touched), so the saved config says
what the run used."""

import copy
import re
from typing import Any, Dict, List, Mapping, Sequence, Set, Tuple

import yaml

from megatron.errors import ConfigError
from megatron.utils.yaml_text import COMMAND_LINE_OVERRIDES_FILE, normalize_key, parse_yaml_value

SET_FLAG = "--set"


def parse_set_options(options: Sequence[str]) -> List[Tuple[List[str], Any, str]]:
    """Each `KEY=VALUE` as (path of KEY, its top-level name normalised; the parsed VALUE; the flag as the user
    wrote it, `--set KEY`, for messages). Raises ConfigError listing every malformed option and every KEY given
    twice."""
    parsed: List[Tuple[List[str], Any, str]] = []
    problems: List[str] = []
    seen: Dict[Tuple[str, ...], str] = {}
    for option in options:
        key, equals, text = option.partition("=")
        key = key.strip()
        path = key.split(".")
        if not equals or not all(path):
            problems.append(f"{SET_FLAG} {option!r}: write {SET_FLAG} KEY=VALUE, e.g. {SET_FLAG} train_iters=100 or "
                            f"{SET_FLAG} optimizer.params.lr=3e-4")
            continue
        path[0] = normalize_key(path[0])
        flag = f"{SET_FLAG} {key}"
        try:
            value = parse_yaml_value(text, flag)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        clash = _overlapping(tuple(path), seen)
        if clash is not None:
            problems.append(f"{flag} and {seen[clash]} set the same value; give it once")
            continue
        seen[tuple(path)] = flag
        parsed.append((path, value, flag))
    if problems:
        raise ConfigError(problems)
    return parsed


def _overlapping(path: Tuple[str, ...], seen: Mapping[Tuple[str, ...], str]):
    """A path given before that is `path`, or contains it, or lies inside it."""
    for other in seen:
        shorter = min(len(other), len(path))
        if other[:shorter] == path[:shorter]:
            return other
    return None


def apply_set_options(values: Dict[str, Any], origin: Dict[str, str], defaults: Mapping[str, Any],
                      options: Sequence[str]) -> Set[str]:
    """Put each `--set` option's value into `values` (the merged files' arguments, changed in place; a dotted
    path changes one entry of the dict the files or, failing them, the default give) and name it in `origin`.
    Returns the top-level arguments touched. Raises ConfigError when a path runs through something not a dict."""
    touched: Set[str] = set()
    problems: List[str] = []
    for path, value, flag in parse_set_options(options):
        top = path[0]
        if len(path) == 1:
            values[top] = value
        else:
            container = copy.deepcopy(values.get(top, defaults.get(top)))
            if container is None:
                container = {}
            problem = _set_inside(container, path, value, flag)
            if problem:
                problems.append(problem)
                continue
            values[top] = container
        origin[top] = flag
        touched.add(top)
    if problems:
        raise ConfigError(problems)
    return touched


def _set_inside(container: Any, path: List[str], value: Any, flag: str) -> str:
    """Set path[1:] inside `container` (the value of path[0]); '' when done, else why not."""
    node = container
    for depth, part in enumerate(path[1:], start=1):
        if not isinstance(node, dict):
            where = ".".join(path[:depth])
            return f"{flag}: {where} is {node!r}, not a dict, so it has no entry '{part}'; set {where} itself"
        if depth == len(path) - 1:
            node[part] = value
        else:
            node = node.setdefault(part, {})
    return ""


def overrides_file_text(values: Mapping[str, Any], touched: Set[str], options: Sequence[str]) -> str:
    """COMMAND_LINE_OVERRIDES_FILE's text: the options as given, then the whole value of each argument they
    touched (checkpoint readers merge it after the run's files, so it wins as the options did)."""
    header = [f"# {COMMAND_LINE_OVERRIDES_FILE}: deepy.py's {SET_FLAG} options of this run, which replaced the "
              f"values of the YAML files beside this one:"]
    header += [f"#   {SET_FLAG} {option}" for option in options]
    return "\n".join(header) + "\n" + yaml.safe_dump({key: values[key] for key in sorted(touched)},
                                                     default_flow_style=False, sort_keys=True)


def name_set_options(problems: Sequence[str], options: Sequence[str]) -> List[str]:
    """`problems` with the `--set` options behind each one named, where the problem is about an argument they set
    and does not name them already (a type error does; a rule about a dict's entry, a derived value or a
    combination names the argument only)."""
    flags: Dict[str, List[str]] = {}
    for path, _, flag in parse_set_options(options):
        flags.setdefault(path[0], []).append(flag)
    named = []
    for problem in problems:
        behind = [flag for top, group in flags.items() if re.search(rf"(^|\W){re.escape(top)}(\W|$)", problem)
                  for flag in group if flag not in problem]
        named.append(f"{problem} (from {', '.join(behind)})" if behind else problem)
    return named
