"""Which lm-eval tasks ``eval_tasks`` names, and the TaskManager that finds them.

An entry of eval_tasks is either
  * a task or group name from lm-eval's registry (``lambada_openai``; its data comes from the Hugging
    Face hub, so it needs the network or a filled datasets cache), or
  * a path to a task YAML file (the task named by its ``task:`` key), or
  * a path to a directory: every task YAML in it (recursively; the ``task:`` key of each file whose
    ``task`` is a single name; group files are not expanded).
Paths are read as include paths of lm-eval's TaskManager. When every entry is a path, lm-eval's ~14k
built-in tasks are not indexed at all (include_defaults=False), which also keeps the run offline.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import List, Optional, Sequence

import yaml

from megatron.errors import DataError
from megatron.utils.text_files import read_utf8


class EvalTaskError(DataError):
    """An eval_tasks entry that cannot be resolved, or a task whose data cannot be loaded; the message names it
    and what to do (a DataError, so train.py's evaluation during training reports it the same way)."""


class _LenientLoader(yaml.SafeLoader):
    """Reads lm-eval task YAML (which may hold ``!function`` tags) for its ``task`` key only."""


_LenientLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@dataclasses.dataclass
class TaskSelection:
    names: List[str]
    include_paths: List[str]
    needs_registry: bool


def _task_name(path: str) -> str:
    """The ``task:`` name of task YAML ``path`` ("" when it has none); a file that is not YAML is named."""
    text = read_utf8(path, lambda problem: EvalTaskError(f"eval_tasks: task file {problem}"))
    try:
        config = yaml.load(text, Loader=_LenientLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise EvalTaskError(f"eval_tasks: task file {path} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise EvalTaskError(f"eval_tasks: task file {path} is nested thousands of levels deep; it is damaged or not "
                            f"a task file") from None
    name = config.get("task") if isinstance(config, dict) else None
    return name if isinstance(name, str) else ""


def _looks_like_path(entry: str) -> bool:
    return entry.endswith((".yaml", ".yml")) or os.sep in entry or os.path.exists(entry)


def resolve_tasks(entries: Sequence[str]) -> TaskSelection:
    """Task names and include paths for the eval_tasks entries (see module docstring)."""
    if not entries:
        raise EvalTaskError("eval_tasks is empty: name lm-eval tasks (e.g. --eval_tasks lambada_openai) or "
                            "paths to task YAML files / directories of them")
    names: List[str] = []
    include: List[str] = []
    registry = False
    for entry in entries:
        entry = str(entry)
        if not _looks_like_path(entry):
            names.append(entry)
            registry = True
            continue
        path = os.path.abspath(entry)
        if os.path.isfile(path):
            name = _task_name(path)
            if not name:
                raise EvalTaskError(f"eval_tasks entry {entry!r}: the YAML file has no 'task: NAME' key")
            names.append(name)
            include.append(os.path.dirname(path))
        elif os.path.isdir(path):
            found = sorted(filter(None, (_task_name(os.path.join(root, f)) for root, _, files in os.walk(path)
                                         for f in files if f.endswith((".yaml", ".yml")))))
            if not found:
                raise EvalTaskError(f"eval_tasks entry {entry!r}: the directory holds no task YAML files "
                                    "(files with a 'task: NAME' key)")
            names += found
            include.append(path)
        else:
            raise EvalTaskError(f"eval_tasks entry {entry!r}: no such file or directory (an entry is an lm-eval "
                                "task name, a task YAML file, or a directory of task YAML files)")
    return TaskSelection(names=list(dict.fromkeys(names)), include_paths=list(dict.fromkeys(include)),
                         needs_registry=registry)


def task_manager(selection: TaskSelection):
    """lm-eval's TaskManager for the selection; unknown names raise EvalTaskError listing close ones."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=selection.include_paths or None,
                          include_defaults=selection.needs_registry)
    known = set(manager.all_tasks)
    missing = [n for n in selection.names if n not in known]
    if missing:
        hints = {n: difflib.get_close_matches(n, known, n=3) for n in missing}
        detail = "; ".join(f"{n!r}" + (f" (did you mean {', '.join(h)}?)" if h else "") for n, h in hints.items())
        raise EvalTaskError(f"eval_tasks: unknown lm-eval task(s) {detail}")
    return manager


def task_load_problem(manager, name: str) -> Optional[str]:
    """Why lm-eval cannot build task ``name`` (its YAML, its data), in one sentence naming it, or None. lm-eval reads
    a task's data when it builds the task: a data file that is missing, a hub data set while offline."""
    try:
        build = getattr(manager, "load", None) or manager.load_task_or_group  # lm-eval 0.4.13 renamed it
        build([name])
    except Exception as exc:  # anything lm-eval or datasets raise while building the task: named, not a traceback
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        if isinstance(exc, ConnectionError) or "offline" in text.lower():
            return (f"eval_tasks: task {name!r} cannot load its data: {first}. Its data set is on the Hugging Face "
                    f"hub and this run is offline (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE, which eval.py sets unless "
                    f"the environment does): run once with HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 on a machine with "
                    f"the network to fill the datasets cache, or point the task at local data files")
        if isinstance(exc, FileNotFoundError):
            return (f"eval_tasks: task {name!r}: a data file it names is missing ({first}); fix the task YAML's "
                    f"dataset_path / dataset_kwargs, or restore the file")
        return f"eval_tasks: lm-eval cannot build task {name!r}: {type(exc).__name__}: {first}"
    return None


def first_task_problem(manager, names: Sequence[str]) -> Optional[str]:
    """task_load_problem of the first of ``names`` that lm-eval cannot build, or None."""
    return next(filter(None, (task_load_problem(manager, name) for name in names)), None)
