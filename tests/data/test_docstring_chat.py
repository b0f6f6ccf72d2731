"""The worked post-training example's data (megatron/data/docstring_chat.py, tools/datasets/make_chat_example.py):
conversations from documented functions, preference pairs whose rejected answer is another function's, and a
multiple-choice lm-eval task on functions held out of both; the chat template renders what the task prompts."""
from __future__ import annotations

import json
from pathlib import Path

from megatron.data.docstring_chat import (CHAT_TEMPLATE, documented_functions, write_docstring_chat,
                                          write_tokenizer_folder)
from tests.tokenizer.tokenizer_files import make_hf_tokenizer_files
from tests.tools.tool_runner import load_tool


def _fake_stdlib(root: Path, count: int) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text('def top():\n    """Return the top of the package stack, always."""\n')
    lines = []
    for i in range(count):
        lines.append(f'def f{i}(x):\n    """Return x plus the number {i}, as an integer value.\n\n    More.\n    """\n')
    lines.append('def _private():\n    """Not exported, so never asked about at all."""\n')
    lines.append('def short():\n    """Too short."""\n')
    (root / "mod.py").write_text("".join(lines))


def test_documented_functions_take_public_functions_with_a_summary_line(tmp_path):
    _fake_stdlib(tmp_path, 5)
    found = {d.name: d.summary for d in documented_functions(100, root=str(tmp_path))}
    assert found == {"mod.f0": "Return x plus the number 0, as an integer value.",
                     **{f"mod.f{i}": f"Return x plus the number {i}, as an integer value." for i in range(1, 5)},
                     "pkg.top": "Return the top of the package stack, always."}


def test_sets_pairs_and_held_out_task(tmp_path, monkeypatch):
    import megatron.data.docstring_chat as module

    _fake_stdlib(tmp_path / "lib", 60)
    monkeypatch.setattr(module, "documented_functions",
                        lambda limit: documented_functions(limit, root=str(tmp_path / "lib")))
    paths = write_docstring_chat(tmp_path / "out", eval_count=20)
    sft = [json.loads(line) for line in paths["sft"].read_text().splitlines()]
    pairs = [json.loads(line) for line in paths["pairs"].read_text().splitlines()]
    rows = [json.loads(line) for line in (tmp_path / "out" / "tasks" / "docstring_mc.jsonl").read_text().splitlines()]
    assert len(sft) == len(pairs) == 61 - 20 and len(rows) == 20
    trained = {m["messages"][0]["content"] for m in sft}
    for row in rows:
        assert row["prompt"].split("\n")[1] not in trained  # held out
        assert len(set(row["choices"])) == 4 and 0 <= row["label"] < 4
    for pair in pairs:
        assert pair["chosen"][0] == pair["rejected"][0] and pair["chosen"][1] != pair["rejected"][1]
    task = json.loads(paths["docstring_mc"].read_text())
    assert task["output_type"] == "multiple_choice" and task["target_delimiter"] == ""
    seen_file = tmp_path / "out" / "tasks" / "docstring_mc_seen.jsonl"
    seen = [json.loads(line) for line in seen_file.read_text().splitlines()]
    assert len(seen) == 20 and all(row["prompt"].split("\n")[1] in trained for row in seen)


def test_the_template_renders_the_prompt_the_task_asks(tmp_path):
    from transformers import AutoTokenizer

    files = make_hf_tokenizer_files(tmp_path)
    folder = write_tokenizer_folder(tmp_path / "tok", files["tokenizer_json"])
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|endoftext|>"
    turn = [{"role": "user", "content": "What does the Python function os.getcwd do?"}]
    rendered = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|user|>\nWhat does the Python function os.getcwd do?\n<|assistant|>\n"


def test_the_tool_names_the_missing_tokenizer(tmp_path, capsys):
    assert load_tool("tools/datasets/make_chat_example.py").main(["-d", str(tmp_path)]) == 2
    assert "prepare_data.py" in capsys.readouterr().err
