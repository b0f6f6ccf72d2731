"""Reading one YAML config's text the way GPT-NeoX users write it: flow style, `-` or `_` in keys, `1e-5` as a
number, and a key set twice refused (PyYAML silently keeps the last). Used for the run's config files
(megatron.neox_arguments.loading) and for the configs/*.yml a GPT-NeoX checkpoint carries (megatron.checkpoint).

Aliases (`*name`) are YAML's, and PyYAML shares the aliased object, so a few hundred bytes can describe a value of
billions of nodes ("billion laughs") that only explodes later, when the config is copied or encoded for the
workers (3.5 GB, then MemoryError). The composed document is therefore measured as it would be written out,
and refused above MAX_EXPANDED_NODES or when an alias refers to itself; a document nested deeper than MAX_DEPTH is
refused by name too (PyYAML's own recursion would end in a RecursionError)."""

import re
from typing import Any, Dict, List, Tuple

import yaml

from megatron.errors import ConfigError


MAX_EXPANDED_NODES = 1_000_000  # the largest config in configs/ has ~1,000 nodes; a run's config is not a data set
MAX_DEPTH = 100  # configs nest 3 or 4 levels (deepspeed dicts); PyYAML's recursion would fail near 1,000, slowly


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated inside one mapping (PyYAML keeps the last silently) and a document
    whose aliases expand beyond MAX_EXPANDED_NODES or into a cycle, or that nests deeper than MAX_DEPTH."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                raise yaml.constructor.ConstructorError(
                    None, None, f"values nested more than {MAX_DEPTH} levels deep; a config is never nested like "
                    f"this: the file is damaged or not a config", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node


def _children(node: yaml.Node) -> List[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose written-out size exceeds MAX_EXPANDED_NODES or that contains a cycle (an alias
    inside its own anchor). Iterative, each distinct node sized once, so a bomb is measured in microseconds."""
    size: Dict[int, int] = {}
    on_stack = set()
    stack: List[Tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_stack.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in _children(node))
            if size[key] > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None, None, f"its aliases (*name) expand to more than {MAX_EXPANDED_NODES:,} values (a "
                    f"\"billion laughs\" document); write the values out, or use fewer nested aliases",
                    node.start_mark)
            continue
        if key in size:
            continue
        if key in on_stack:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias (*name) refers to the value that contains it (a recursive value); a config "
                "value must be finite", node.start_mark)
        on_stack.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


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
    except RecursionError:
        raise ConfigError([f"{source}: nested deeper than the YAML reader can follow (thousands of levels); a "
                           f"config is never nested like this: the file is damaged or not a config"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        kind = "YAML value refused" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise ConfigError([f"{source}: {kind}{where}: {problem}"]) from None
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
