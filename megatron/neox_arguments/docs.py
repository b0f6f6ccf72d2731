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

from megatron.neox_arguments.derivation import ACTIVATION_CHECKPOINTING_MIRRORS, FP16_MIRRORS, ZERO_MIRRORS
from megatron.neox_arguments.groups import ARGUMENT_GROUPS
from megatron.neox_arguments.no_ops import NO_OP_ARGUMENTS

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


def notes() -> Dict[str, str]:
    """{field name: a sentence appended to its documentation}: the mirrors (one setting written in two places)
    and the arguments accepted without effect."""
    result: Dict[str, str] = {}
    for section, mirrors in (("fp16", FP16_MIRRORS), ("zero_optimization", ZERO_MIRRORS),
                             ("activation_checkpointing", ACTIVATION_CHECKPOINTING_MIRRORS)):
        for name, key in mirrors:
            result[name] = (f"The same setting as `{section}.{key}`: set either (both only to the same value); "
                            f"the other is derived.")
    result["clip_grad"] = ("The same setting as `gradient_clipping`: set either (both only to the same value); the "
                           "other is derived.")
    result["gradient_clipping"] = "The same setting as `clip_grad`."
    result["dynamic_loss_scale"] = "Derived: true when loss_scale is 0 (fp16 only); setting it must agree."
    for name, reason in NO_OP_ARGUMENTS.items():
        result[name] = f"No effect here: {reason}"
    return result


def render() -> str:
    """The whole markdown reference."""
    lines: List[str] = ["# NeoX arguments", "",
                        "Generated from the field docstrings in `megatron/neox_arguments/` by "
                        "`python -m megatron.neox_arguments.docs`; do not edit by hand.", "",
                        "Keys may be written with `-` or `_` (`train-iters` is `train_iters`).", ""]
    extra = notes()
    for cls in ARGUMENT_GROUPS:
        docs = field_docstrings(cls)
        lines += [f"## {cls.__name__}", "", " ".join((cls.__doc__ or "").split()), ""]
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        own = [f for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})]
        for field in own:
            lines += [f"- **{field.name}**: {_type_name(hints[field.name])}", "",
                      f"    Default = {field.default!r}", "",
                      f"    {docs.get(field.name, '')}", ""]
            if field.name in extra:
                lines += [f"    {extra[field.name]}", ""]

    lines += ["## Arguments accepted without effect", "",
              "Every other argument changes behaviour or is refused when set (\"not supported yet\"); these are "
              "accepted for compatibility with GPT-NeoX configs and do nothing here "
              "(`megatron/neox_arguments/no_ops.py`):", ""]
    lines += [f"- **{name}**: {reason}" for name, reason in NO_OP_ARGUMENTS.items()]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    with open(DOC_PATH, "w", encoding="utf-8") as handle:
        handle.write(render())
    print(f"wrote {os.path.normpath(DOC_PATH)}")


if __name__ == "__main__":
    main()
