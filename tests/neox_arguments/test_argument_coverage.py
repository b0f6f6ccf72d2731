"""Every argument changes behaviour, is refused when set, or is on the documented list of no-ops.

"Changes behaviour" is approximated by name: the argument is read (an attribute access, a getattr / dict-key
string, or an f-string pattern such as f"{split}_data_paths") somewhere in the code that acts on the config:
megatron/ outside the schema package, the top-level scripts, tools/, and the modules of the schema package that
turn arguments into DeepSpeed's inputs (deepspeed_config.py: the DeepSpeed config; launcher.py and hostfile.py: the
runner's argv) or act in the workers (arguments.py: consume_neox_args finds the ranks, check_device). Reads in
the schema, its loading, derivation and validation do not count: an argument that only feeds another one is a
mirror (derivation.py), and the argument it mirrors must be read."""

import ast
import dataclasses
import re
from pathlib import Path
from typing import Iterable, List, Set

from megatron.neox_arguments import NeoXArgs
from megatron.neox_arguments.aliases import REMOVED
from megatron.neox_arguments.derivation import (ACTIVATION_CHECKPOINTING_MIRRORS, FP16_MIRRORS, ZERO_MIRRORS)
from megatron.neox_arguments.docs import render
from megatron.neox_arguments.no_ops import NO_OP_ARGUMENTS
from megatron.neox_arguments.validation import NOT_SUPPORTED_SETTINGS, NOT_SUPPORTED_YET

REPO = Path(__file__).resolve().parents[2]
CONSUMING_SCHEMA_MODULES = ("deepspeed_config.py", "launcher.py", "hostfile.py", "arguments.py")


def consumer_files() -> List[Path]:
    files = [p for p in (REPO / "megatron").rglob("*.py") if "neox_arguments" not in p.parts
             or p.name in CONSUMING_SCHEMA_MODULES]
    files += [p for p in REPO.glob("*.py")]
    files += list((REPO / "tools").rglob("*.py"))
    return files


def read_names(files: Iterable[Path]):
    """(attribute names read, string constants, compiled f-string patterns) in `files`."""
    attributes: Set[str] = set()
    strings: Set[str] = set()
    patterns = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                attributes.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
            elif isinstance(node, ast.JoinedStr):
                literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
                if len(re.sub(r"\W", "", literal)) >= 4:  # f"{a}_{b}" would match anything
                    patterns.append(re.compile("".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+"
                                                       for v in node.values)))
    return attributes, strings, patterns


def unread(names: Iterable[str], files: Iterable[Path]) -> List[str]:
    attributes, strings, patterns = read_names(files)
    return [n for n in names if n not in attributes and n not in strings and not any(p.fullmatch(n) for p in patterns)]


def refused_when_set() -> Set[str]:
    refused = {key for key, _switch, _message in NOT_SUPPORTED_YET}
    refused |= {name for _feature, names in NOT_SUPPORTED_SETTINGS for name in names}
    return refused | set(REMOVED)


def test_every_argument_is_read_refused_or_a_documented_no_op():
    names = [f.name for f in dataclasses.fields(NeoXArgs)]
    missing = [n for n in unread(names, consumer_files()) if n not in refused_when_set() | set(NO_OP_ARGUMENTS)]
    assert not missing, (f"arguments read nowhere outside the schema, neither refused when set nor on "
                         f"megatron/neox_arguments/no_ops.py's documented list: {missing}")


def test_the_scan_finds_an_argument_nobody_reads(tmp_path):
    source = tmp_path / "worker.py"
    source.write_text("def f(args, split):\n    args.unread_argument = 1\n    return args.read_argument, "
                      "getattr(args, 'by_string'), getattr(args, f'{split}_data_paths')\n")
    assert unread(["read_argument", "by_string", "valid_data_paths", "unread_argument"], [source]) == \
        ["unread_argument"]


def test_no_op_entries_are_real_arguments_with_reasons_and_nobody_reads_them():
    names = {f.name for f in dataclasses.fields(NeoXArgs)}
    assert set(NO_OP_ARGUMENTS) <= names
    assert all(len(reason) > 30 for reason in NO_OP_ARGUMENTS.values())
    attributes, _strings, _patterns = read_names(consumer_files())  # names like 'deepspeed' are also modules
    read = set(NO_OP_ARGUMENTS) & attributes
    assert not read, f"on the no-op list but read by the code (take them off the list): {sorted(read)}"


def test_mirrored_arguments_have_their_partner_read():
    files = consumer_files()
    for section, mirrors in (("fp16", FP16_MIRRORS), ("zero_optimization", ZERO_MIRRORS),
                             ("activation_checkpointing", ACTIVATION_CHECKPOINTING_MIRRORS)):
        assert not unread([name for name, _key in mirrors], files), section


def test_no_ops_are_documented():
    text = render()
    for name, reason in NO_OP_ARGUMENTS.items():
        assert reason in text.split(f"- **{name}**:", 1)[1].split("\n- **", 1)[0], name
