"""The documentation's shell commands cannot go stale: each is run here (the cheap ones), or mapped to the test that
runs it (which must name its script and flags), or excused with its reason (tests/docs/commands.py); a command added
to README.md, docs/ or a file they include without an entry fails, and so does an entry whose command is gone."""
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List, Optional

import pytest
import yaml

from tests.accelerator import deepspeed_accelerator_env
from tests.docs.commands import CATEGORIES, COMMANDS, OWN_DATA, Mapped, NotRun, Run, RunAsWritten
from tests.docs.extract import REPO, documented_commands, fenced_blocks

FLAG = re.compile(r"^\[?(--[A-Za-z][\w-]*)")


def coverage_problems(commands: Iterable[str]) -> List[str]:
    """Documented commands without an entry, and entries whose command is not documented."""
    documented = set(commands)
    problems = [f"{command!r} is in the documentation but not in tests/docs/commands.py: run it in tests/docs, map "
                f"it to the test that runs it, or say why no test can" for command in sorted(documented - COMMANDS.keys())]
    problems += [f"{command!r} is in tests/docs/commands.py but no longer in the documentation: remove its entry"
                 for command in sorted(COMMANDS.keys() - documented)]
    return problems


def test_every_documented_command_is_run_mapped_or_excused():
    problems = coverage_problems(command for command, _ in documented_commands())
    assert not problems, "\n".join(problems)


def test_a_new_command_without_an_entry_fails():
    commands = [command for command, _ in documented_commands()] + ["python tools/new_tool.py --input x"]
    assert coverage_problems(commands) == [
        "'python tools/new_tool.py --input x' is in the documentation but not in tests/docs/commands.py: run it in "
        "tests/docs, map it to the test that runs it, or say why no test can"]
    assert "no longer in the documentation" in coverage_problems(commands[1:])[-1]


def script_of(words: List[str]) -> Optional[Path]:
    """The repository file a command runs (deepy.py for a deepy.py launch), or None (pytest, mkdocs, ssh ...)."""
    for index, word in enumerate(words):
        if word == "-m" and index + 1 < len(words):
            module = REPO / (words[index + 1].replace(".", "/") + ".py")
            return module if module.is_file() else None
        if re.search(r"\.(py|sh)$", word) or word.startswith(("requirements/", ".ci/")):
            return REPO / word
    return None


IMPORTED = re.compile(r"^\s*from ((?:megatron|bench|tools)(?:\.\w+)*) import|^\s*import ((?:megatron|bench)(?:\.\w+)*)", re.M)


def sources(script: Path) -> str:
    """The script's text and that of the project modules it imports directly (where shared options are defined)."""
    text = script.read_text(encoding="utf-8")
    texts = [text]
    for match in IMPORTED.finditer(text):
        base = REPO / (match.group(1) or match.group(2)).replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                texts.append(candidate.read_text(encoding="utf-8"))
    return "\n".join(texts)


def flags(command: str) -> List[str]:
    return [match.group(1) for match in map(FLAG.match, command.split()) if match]


def test_documented_flags_exist_in_their_scripts():
    """Every --flag a documented command passes is one its script (deepy.py for a launch) still defines."""
    problems = []
    for command in COMMANDS:
        script = script_of(command.split())
        if script is None:
            continue
        if not script.is_file():
            problems.append(f"{command!r}: {script.relative_to(REPO)} does not exist")
            continue
        source = sources(script)
        words = command.split()
        after = " ".join(words[next(i for i, w in enumerate(words) if REPO / w == script or w == "-m") + 1:])
        problems += [f"{command!r}: {script.relative_to(REPO)} defines no {flag}" for flag in flags(after)
                     if f'"{flag}"' not in source and f"'{flag}'" not in source and flag != "--help"
                     and script.suffix == ".py"]
    assert not problems, "\n".join(problems)


def test_mapped_tests_run_their_commands():
    """Each mapped test file exists, contains the words listed for it, and names every long flag of the command
    (as a flag or as the config key of the same name)."""
    problems = []
    for command, entry in COMMANDS.items():
        if isinstance(entry, NotRun):
            if entry.category not in CATEGORIES or not entry.reason:
                problems.append(f"{command!r}: a NotRun needs a category of {CATEGORIES} and a reason")
            continue
        if isinstance(entry, RunAsWritten):
            test = REPO / entry.test
            if not test.is_file() or entry.page not in test.read_text(encoding="utf-8").replace('" / "', "/"):
                problems.append(f"{command!r}: {entry.test} does not read {entry.page}")
            continue
        if not isinstance(entry, Mapped):
            continue
        if entry.unchecked and not entry.note:
            problems.append(f"{command!r}: say in its note why {entry.unchecked} are not run")
        texts = []
        for test, words in entry.tests.items():
            path = REPO / test
            if not path.is_file():
                problems.append(f"{command!r}: {test} does not exist")
                continue
            texts.append(path.read_text(encoding="utf-8"))
            problems += [f"{command!r}: {test} does not contain {word!r}" for word in words if word not in texts[-1]]
        for flag in (flag for flag in flags(command) if flag not in entry.unchecked):
            names = {flag, flag.lstrip("-"), flag.lstrip("-").replace("-", "_")}
            if not any(name in text for name in names for text in texts):
                problems.append(f"{command!r}: no mapped test names {flag}")
    assert not problems, "\n".join(problems)


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    runs = [line for line in readme.splitlines() if line.startswith("pip install -q -e . -r requirements/")]
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert len(runs) == 1 and ci[-1] == runs[0], (runs, ci[-1])
    assert ".ci/install-cluster-packages" in ci


def _environment() -> dict:
    return {**os.environ, **deepspeed_accelerator_env(),
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def test_help_commands():
    for command, entry in COMMANDS.items():
        if isinstance(entry, Run) and entry.how == "test_help_commands":
            result = subprocess.run(command, shell=True, cwd=REPO, env=_environment(), capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 0 and result.stdout.startswith("usage:"), (command, result.stderr[-2000:])


def _readme_section(name: str) -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    return readme.split(f"--8<-- [start:{name}]")[1].split(f"--8<-- [end:{name}]")[0]


def test_own_data_recipe(tmp_path, monkeypatch):
    """README's own-data commands as written, in a folder holding a tiny my_corpus.jsonl (and links to the
    repository's scripts and configs): the tokenizer, the .bin/.idx and my_model.yml; then the keys README says to
    set, and deepy.py's checks before launch (config and files) pass for `python deepy.py train.py my_model.yml`."""
    import json

    import deepy
    from megatron.data.corpora import iter_stdlib_texts

    with open(tmp_path / "my_corpus.jsonl", "w", encoding="utf-8") as corpus:
        for _, text in zip(range(20), iter_stdlib_texts()):
            corpus.write(json.dumps({"text": text[:3000]}) + "\n")
    for name in ("tools", "configs", "megatron", "deepy.py", "train.py"):
        (tmp_path / name).symlink_to(REPO / name)
    recipe = [command for command, _ in documented_commands() if COMMANDS.get(command) == OWN_DATA]
    assert len(recipe) == 3, recipe
    for command in recipe:
        result = subprocess.run(command, shell=True, cwd=tmp_path, env=_environment(), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])

    keys = [yaml.safe_load("{" + block + "}") for _, language, block in fenced_blocks(_readme_section("own-data"))
            if language == "yaml"]
    assert len(keys) == 1 and {"data_path", "vocab_file", "tokenizer_type"} <= keys[0].keys(), keys
    config = yaml.safe_load((tmp_path / "my_model.yml").read_text(encoding="utf-8"))
    (tmp_path / "my_model.yml").write_text(yaml.safe_dump({**config, **keys[0]}), encoding="utf-8")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / (keys[0]["data_path"] + suffix)).is_file(), "README's data_path is not what it wrote"
    monkeypatch.chdir(tmp_path)
    args, _, finished = deepy.preflight(["train.py", "my_model.yml"])
    assert finished is None and args.data_path == keys[0]["data_path"] and args.vocab_file == keys[0]["vocab_file"]


def test_the_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: every page in the nav, every link and anchor resolves, every included file exists."""
    pytest.importorskip("material", reason="mkdocs-material comes with requirements/requirements-dev.txt")
    assert isinstance(COMMANDS["mkdocs build --strict -d /tmp/site"], Run)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                            cwd=REPO, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert (tmp_path / "site" / "arguments" / "index.html").read_text(encoding="utf-8").count("train_iters") > 0
