"""Refusing a local Hugging Face folder that asks for its own Python code.

A folder whose config.json or tokenizer_config.json has `auto_map` names classes in Python files of the folder
(or of a Hub repository): transformers runs that code when told `trust_remote_code=True`, and asks on a terminal
otherwise. This project's tools load folders with `trust_remote_code=False` and refuse such a folder first, with a
message naming the file (issue 32: no tool reads remote code)."""
from __future__ import annotations

import json
import os
from typing import Optional

CODE_NAMING_FILES = ("config.json", "tokenizer_config.json")
"""The files of a Hugging Face folder whose `auto_map` makes transformers import code."""


def remote_code_problem(folder: str) -> Optional[str]:
    """Why ``folder`` cannot be loaded without running its own code (a file of CODE_NAMING_FILES with `auto_map`),
    or None. A file that is not JSON is left to the loader, which names it."""
    for name in CODE_NAMING_FILES:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as handle:
                content = json.loads(handle.read())
        except (OSError, ValueError):
            continue
        if isinstance(content, dict) and content.get("auto_map"):
            classes = ", ".join(sorted(map(str, content["auto_map"])))
            return (f"{path} has auto_map ({classes}): the folder's model or tokenizer is custom Python code, "
                    f"which this project never runs (trust_remote_code is off); use a folder of a model "
                    f"transformers implements itself (GPTNeoX, Llama, Mistral, Mamba), or remove auto_map if the "
                    f"folder's classes are transformers' own")
    return None
