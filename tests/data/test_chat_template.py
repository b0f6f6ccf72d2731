"""megatron/data/chat_template.py through tools/datasets/preprocess_data_with_chat_template.py --tokenizer-path:
GPT-NeoX's flags and file names, labels checked against transformers' own rendering of each prefix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from tests.data.chat_helpers import TEMPLATE, hf_folder
from tests.tools.tool_runner import load_tool

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "goodbye"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("tok"))


def run(tmp_path: Path, folder: Path, records: list[dict], *flags: str) -> int:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_tool("tools/datasets/preprocess_data_with_chat_template.py").main(
        ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"),
         "--tokenizer-path", str(folder), "--no-progress", *flags])


def read(tmp_path: Path, name: str) -> list[list]:
    ds = MMapIndexedDataset(str(tmp_path / f"out_{name}"))
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


def trained_text(tok, tokens: list[int], labels: list[int]) -> str:
    assert all(lab in (-100, t) for t, lab in zip(tokens, labels))
    return tok.decode([t for t, lab in zip(tokens, labels) if lab != -100])


@pytest.mark.parametrize("only_last", [False, True])
def test_labels_cover_the_assistant_turns(tmp_path: Path, folder: Path, only_last: bool) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert run(tmp_path, folder, [{"messages": CHAT}], *(["--only-last"] if only_last else [])) == 0
    (tokens,), (labels,) = read(tmp_path, "messages_document"), read(tmp_path, "messages_label_document")
    assert tokens == list(tok.apply_chat_template(CHAT, tokenize=True)["input_ids"]) + [tok.eos_token_id]
    expected = ("" if only_last else "hello\n") + "goodbye\n<|endoftext|>"
    assert trained_text(tok, tokens, labels) == expected
    assert MMapIndexedDataset(str(tmp_path / "out_messages_label_document")).dtype == np.int32


def test_pairs_rm_and_rewards(tmp_path: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    prompt = [{"role": "user", "content": "2+2?"}]
    record = {"chosen": prompt + [{"role": "assistant", "content": "4"}],
              "rejected": prompt + [{"role": "assistant", "content": "5"}], "good": True}
    assert run(tmp_path, folder, [record], "--jsonl-keys", "chosen", "rejected", "--for-rm",
               "--reward-key", "good", "--binary-reward") == 0
    for key in ("chosen", "rejected"):
        (tokens,), (labels,) = read(tmp_path, f"{key}_document"), read(tmp_path, f"{key}_label_document")
        assert tokens[-2:] == [tok.eos_token_id] * 2
        assert labels == [-100] * (len(tokens) - 1) + [tok.eos_token_id]
        assert read(tmp_path, f"{key}_reward_document") == [[1]]


def test_missing_template_is_one_clear_error(tmp_path: Path, capsys) -> None:
    bare = hf_folder(tmp_path, template=None)
    assert run(tmp_path, bare, [{"messages": CHAT}]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--chat-template" in err
    assert run(tmp_path, bare, [{"messages": CHAT}], "--chat-template", TEMPLATE) == 0


@pytest.mark.attack("a tokenizer folder whose tokenizer_config.json has auto_map (custom tokenizer code), "
                    "preprocessed with the answer 'y' to transformers' prompt")
def test_a_tokenizer_asking_for_its_own_code_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    custom = hf_folder(tmp_path)
    marker = tmp_path / "ran"
    (custom / "tokenization_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\nclass CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((custom / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    code = run(tmp_path, custom, [{"messages": CHAT}])
    assert not marker.exists(), "the folder's code ran"
    assert code == 2
    err = capsys.readouterr().err
    assert f"{custom / 'tokenizer_config.json'} has auto_map (AutoTokenizer)" in err, err
    assert not marker.exists() and not list(tmp_path.glob("out_*"))
