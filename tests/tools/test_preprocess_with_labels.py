"""preprocess_data_with_mask.py and preprocess_data_with_chat_template.py: tokens and aligned labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer_from
from tests.tokenizer.tokenizer_files import make_hf_tokenizer_files
from tests.tools.tool_runner import load_tool


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_tokenizer_files(tmp_path_factory.mktemp("tok"))["tokenizer_json"]


def with_eod_marks(tok, ids: list[int]) -> str:
    """The text of ``ids`` with '<|endoftext|>' where the eod tokens are (HFTokenizer's detokenize drops it,
    as GPT-NeoX's does)."""
    text, piece = "", []
    for i in ids:
        if i == tok.eod:
            text, piece = text + tok.detokenize(piece) + "<|endoftext|>", []
        else:
            piece.append(i)
    return text + tok.detokenize(piece)


def _docs(prefix: str) -> list[list[int]]:
    ds = MMapIndexedDataset(prefix)
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


@pytest.mark.parametrize("workers", [1, 2])
def test_mask_before_token(tmp_path: Path, tok_file: Path, workers: int) -> None:
    texts = ["Question: what is 2+2? Answer: four", "no marker here", "Answer: a Answer: b"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tool = load_tool("tools/datasets/preprocess_data_with_mask.py")
    out = tmp_path / "m"
    assert (
        tool.main(
            [
                "--input",
                str(tmp_path / "in.jsonl"),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "HFTokenizer",
                "--vocab-file",
                str(tok_file),
                "--mask-before-token",
                " Answer:",
                "--append-eod",
                "--workers",
                str(workers),
                "--no-progress",
            ]
        )
        == 0
    )
    tok = build_tokenizer_from("HFTokenizer", str(tok_file))
    tokens, labels = _docs(f"{out}_text_document"), _docs(f"{out}_text_label")
    assert MMapIndexedDataset(f"{out}_text_label").dtype == np.int32
    for text, t, lab in zip(texts, tokens, labels):
        assert t == tok.tokenize(text) + [tok.eod] and len(lab) == len(t)
        trained = [x for x in lab if x != -100]
        if " Answer:" in text:
            tail = text.rsplit(" Answer:", 1)[1]
            assert with_eod_marks(tok, trained) == tail + "<|endoftext|>"
            assert lab[-len(trained) :] == t[-len(trained) :]
        else:
            assert trained == []


def test_chat_template_trains_only_assistant_turns(tmp_path: Path, tok_file: Path) -> None:
    chats = [
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "goodbye"},
            ]
        },
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    tool = load_tool("tools/datasets/preprocess_data_with_chat_template.py")
    tok = build_tokenizer_from("HFTokenizer", str(tok_file))
    for only_last, expected in ((False, ["hello", "goodbye"]), (True, ["goodbye"])):
        out = tmp_path / f"c{only_last}"
        argv = [
            "--input",
            str(tmp_path / "chat.jsonl"),
            "--output-prefix",
            str(out),
            "--tokenizer-type",
            "HFTokenizer",
            "--vocab-file",
            str(tok_file),
            "--no-progress",
        ]
        assert tool.main(argv + (["--only-last-turn"] if only_last else [])) == 0
        (tokens,), (labels,) = _docs(f"{out}_messages_document"), _docs(f"{out}_messages_label_document")
        assert with_eod_marks(tok, tokens) == (
            "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello<|endoftext|>"
            "<|user|>\nbye\n<|assistant|>\ngoodbye<|endoftext|>"
        )
        spans, cur = [], []
        for t, lab in zip(tokens, labels):
            if lab == -100:
                if cur:
                    spans.append(cur)
                cur = []
            else:
                assert lab == t
                cur.append(t)
        spans.append(cur) if cur else None
        assert [with_eod_marks(tok, s) for s in spans] == [e + "<|endoftext|>" for e in expected]


def test_chat_rejects_bad_records(tmp_path: Path, tok_file: Path, capsys) -> None:
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": "not a list"}) + "\n")
    tool = load_tool("tools/datasets/preprocess_data_with_chat_template.py")
    assert (
        tool.main(
            [
                "--input",
                str(tmp_path / "bad.jsonl"),
                "--output-prefix",
                str(tmp_path / "x"),
                "--tokenizer-type",
                "HFTokenizer",
                "--vocab-file",
                str(tok_file),
                "--workers",
                "2",
            ]
        )
        == 2
    )
    assert "list of {'role', 'content'}" in capsys.readouterr().err
