"""The schema covers the GPT-NeoX argument reference, and the generated docs are current."""

import dataclasses
import os
import re

import pytest

from megatron.neox_arguments import ARGUMENT_GROUPS, NeoXArgs, argument_types
from megatron.neox_arguments.docs import DOC_PATH, render

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "neox-arguments.md")


def reference_entries():
    """(name, type text, default text) of every argument in the GPT-NeoX reference snapshot."""
    text = open(REFERENCE, encoding="utf-8").read()
    return re.findall(r"^- \*\*(\w+)\*\*: (.*?)\n\s*\n\s*Default = (.*?)\n", text, re.M)


def test_every_reference_argument_exists_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(NeoXArgs)}
    entries = reference_entries()
    assert len(entries) > 300
    for name, _type, default in entries:
        assert name in fields, f"{name} from the reference is missing"
        value = fields[name].default
        if default == "None":
            assert value is None, name
        elif default in ("True", "False"):
            assert value is (default == "True"), name
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            assert value == float(default), name
        else:
            assert str(value) == default, name


@pytest.mark.parametrize("name,expected", [("num_layers", "int"), ("lr", "float"), ("no_weight_tying", "bool"),
                                           ("data_path", "str"), ("train_data_paths", "list"),
                                           ("optimizer", "dict"), ("norm", "Literal")])
def test_reference_types(name, expected):
    assert expected in str(argument_types()[name]) or getattr(argument_types()[name], "__name__", "") == expected


def test_neox_args_is_the_union_of_the_groups():
    union = {f.name for group in ARGUMENT_GROUPS for f in dataclasses.fields(group)}
    assert union == {f.name for f in dataclasses.fields(NeoXArgs)}


def test_every_field_has_a_docstring():
    text = render()
    for field in dataclasses.fields(NeoXArgs):
        block = text.split(f"- **{field.name}**:", 1)[1].split("\n- **", 1)[0]
        assert len(block.strip().splitlines()[-1].strip()) > 5, f"{field.name} has no docstring"


def test_generated_argument_docs_are_current():
    with open(DOC_PATH, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == render(), ("configs/neox_arguments.md is stale: run "
                                   "`python -m megatron.neox_arguments.docs` and commit the result")
