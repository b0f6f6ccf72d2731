"""A tiny chat, preference and evaluation set made offline from Python's standard library, for the worked
SFT -> DPO -> eval example (configs/post_training/, tools/datasets/make_chat_example.py).

Each example asks what a stdlib function does; the answer is the first line of its docstring. SFT trains on the
answers; a DPO pair prefers a function's own docstring to another function's; the lm-eval task (multiple choice:
the right docstring among four) asks the same of functions held out from both.
"""
from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from megatron.data.corpora import stdlib_source_files

CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
"""One header line per turn (the chat-template tool ends each conversation with the end-of-document token)."""


@dataclass(frozen=True)
class Documented:
    name: str       # module.function
    summary: str    # the docstring's first line


def documented_functions(limit: int, root: str | None = None) -> List[Documented]:
    """Up to ``limit`` stdlib functions with a one-line docstring summary of 20-100 characters, names unique."""
    found: Dict[str, Documented] = {}
    for path in stdlib_source_files(root):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        module = path.parent.name if path.stem == "__init__" else path.stem
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                summary = doc.strip().splitlines()[0].strip() if doc else ""
                name = f"{module}.{node.name}"
                if 20 <= len(summary) <= 100 and name not in found:
                    found[name] = Documented(name, summary)
        if len(found) >= limit:
            break
    return list(found.values())[:limit]


def question(item: Documented) -> str:
    return f"What does the Python function {item.name} do?"


def _conversation(item: Documented, answer: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": question(item)}, {"role": "assistant", "content": answer}]


def write_docstring_chat(directory: Path, eval_count: int = 100, limit: int = 3000, seed: int = 0) -> Dict[str, Path]:
    """sft.jsonl (messages), pairs.jsonl (chosen / rejected), tasks/docstring_mc.{yaml,jsonl} (functions held out
    of both training sets) and tasks/docstring_mc_seen.{yaml,jsonl} (trained ones) in ``directory``; returns their
    paths."""
    items = documented_functions(limit)
    if len(items) < eval_count + 10:
        raise ValueError(f"only {len(items)} documented stdlib functions found; need more than {eval_count + 10}")
    rng = random.Random(seed)
    rng.shuffle(items)
    held_out, train = items[:eval_count], items[eval_count:]
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"sft": directory / "sft.jsonl", "pairs": directory / "pairs.jsonl"}
    with open(paths["sft"], "w", encoding="utf-8") as sft, open(paths["pairs"], "w", encoding="utf-8") as pairs:
        for i, item in enumerate(train):
            sft.write(json.dumps({"messages": _conversation(item, item.summary)}) + "\n")
            other = train[(i + 1 + rng.randrange(len(train) - 1)) % len(train)]
            pairs.write(json.dumps({"chosen": _conversation(item, item.summary),
                                    "rejected": _conversation(item, other.summary)}) + "\n")
    tasks = directory / "tasks"
    tasks.mkdir(exist_ok=True)
    # held out of training, and (to see what the training did) as many of the trained functions
    for name, chosen in (("docstring_mc", held_out), ("docstring_mc_seen", train[:eval_count])):
        paths[name] = _write_task(tasks, name, chosen, rng)
    return paths


def _write_task(directory: Path, name: str, items: List[Documented], rng: random.Random) -> Path:
    """An lm-eval multiple-choice task: each function's own summary among three others of the set."""
    rows = []
    for i, item in enumerate(items):
        choices = [item.summary] + [items[(i + k) % len(items)].summary for k in (1, 2, 3)]
        rng.shuffle(choices)
        # the prompt as the chat template renders it, up to where the assistant's answer starts
        rows.append({"prompt": f"<|user|>\n{question(item)}\n<|assistant|>\n", "choices": choices,
                     "label": choices.index(item.summary)})
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    task = {"task": name, "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data.resolve())}}, "output_type": "multiple_choice",
            "doc_to_text": "{{prompt}}", "doc_to_choice": "{{choices}}", "doc_to_target": "label",
            "target_delimiter": "", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}
    path = directory / f"{name}.yaml"
    path.write_text(json.dumps(task, indent=1), encoding="utf-8")  # JSON is YAML
    return path


def write_tokenizer_folder(directory: Path, tokenizer_json: Path, eos_token: str = "<|endoftext|>") -> Path:
    """A Hugging Face tokenizer folder: the given tokenizer.json and a tokenizer_config.json with the chat
    template (what --tokenizer-path of tools/datasets/preprocess_data_with_chat_template.py reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_bytes(Path(tokenizer_json).read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return directory
