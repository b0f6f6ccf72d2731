"""Generating configs/neox_arguments.md from the field docstrings of the argument groups.

The docstrings under each field are the single source of the documentation; a test regenerates the file
and fails when the committed copy is stale. Regenerate with `python -m megatron.neox_arguments.docs`."""

import ast
import dataclasses
import inspect
import os
import re
import textwrap
from typing import Dict, List

from megatron.neox_arguments.arguments import ARGUMENT_GROUPS

DOC_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "neox_arguments.md")


def field_docstrings(cls: type) -> Dict[str, str]:
    """{field name: the string literal that follows it in the class body}."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: Dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(annotation) -> str:
    return re.sub(r"\btyping\.", "", str(annotation)) if not isinstance(annotation, type) else annotation.__name__


def render() -> str:
    """The whole markdown reference."""
    lines: List[str] = ["# NeoX arguments", "",
                        "Generated from the field docstrings in `megatron/neox_arguments/` by "
                        "`python -m megatron.neox_arguments.docs`; do not edit by hand.", "",
                        "Keys may be written with `-` or `_` (`train-iters` is `train_iters`).", ""]
    for cls in ARGUMENT_GROUPS:
        docs = field_docstrings(cls)
        lines += [f"## {cls.__name__}", "", " ".join((cls.__doc__ or "").split()), ""]
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        own = [f for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})]
        for field in own:
            lines += [f"- **{field.name}**: {_type_name(hints[field.name])}", "",
                      f"    Default = {field.default!r}", "",
                      f"    {docs.get(field.name, '')}", ""]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    with open(DOC_PATH, "w", encoding="utf-8") as handle:
        handle.write(render())
    print(f"wrote {os.path.normpath(DOC_PATH)}")


if __name__ == "__main__":
    main()
