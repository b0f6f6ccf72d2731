"""preprocess_data.py: every input format, several keys, workers, throughput output, clear errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import zstandard

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer_from
from tests.tokenizer.tokenizer_files import SAMPLE_TEXTS, make_hf_tokenizer_files
from tests.tools.tool_runner import load_tool, run_tool

DOCS = [
    {"text": f"document {i}: " + SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)] * (1 + i % 3), "title": f"title {i}"}
    for i in range(60)
] + [{"text": "", "title": "empty text"}]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_tokenizer_files(tmp_path_factory.mktemp("tok"))["tokenizer_json"]


@pytest.fixture(scope="module")
def preprocess():
    return load_tool("tools/datasets/preprocess_data.py")


def _lines(docs: list[dict]) -> bytes:
    return "".join(json.dumps(d) + "\n" for d in docs).encode()


def _expected(tok_file: Path, texts: list[str], eod: bool) -> list[list[int]]:
    tok = build_tokenizer_from("HFTokenizer", str(tok_file))
    return [tok.tokenize(t) + ([tok.eod] if eod and t else []) for t in texts]


def _read(prefix: str) -> list[list[int]]:
    ds = MMapIndexedDataset(prefix)
    return [ds.document(i).tolist() for i in range(ds.num_documents)]


@pytest.mark.parametrize("workers", [1, 2])
def test_formats_keys_and_order(tmp_path: Path, tok_file: Path, preprocess, workers: int, capsys) -> None:
    (tmp_path / "a.jsonl").write_bytes(_lines(DOCS[:20]))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(_lines(DOCS[20:40])))
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_lines(DOCS[40:])))
    out = tmp_path / "out" / "ds"
    rc = preprocess.main(
        [
            "--input",
            str(tmp_path / "a.jsonl"),
            f"{tmp_path / 'b.jsonl.gz'},{tmp_path / 'c.jsonl.zst'}",
            "--output-prefix",
            str(out),
            "--jsonl-keys",
            "text",
            "title",
            "--tokenizer-type",
            "HFTokenizer",
            "--vocab-file",
            str(tok_file),
            "--append-eod",
            "--workers",
            str(workers),
            "--batch-size",
            "7",
            "--log-interval",
            "10",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr()
    assert "docs/s" in printed.out and "tokens/s" in printed.out
    assert _read(f"{out}_text_document") == _expected(tok_file, [d["text"] for d in DOCS], eod=True)
    assert _read(f"{out}_title_document") == _expected(tok_file, [d["title"] for d in DOCS], eod=True)
    assert MMapIndexedDataset(f"{out}_text_document").dtype == np.uint16


def test_plain_text_glob_ftfy_num_docs(tmp_path: Path, tok_file: Path, preprocess) -> None:
    texts = ["first file\nwith two lines\n", "second file ﬁ ligature and mojibake: schÃ¶n\n", "third"]
    for i, t in enumerate(texts):
        (tmp_path / f"f{i}.txt").write_text(t, encoding="utf-8")
    out = tmp_path / "plain"
    rc = preprocess.main(
        [
            "--input",
            str(tmp_path / "f*.txt"),
            "--output-prefix",
            str(out),
            "--tokenizer-type",
            "HFTokenizer",
            "--vocab-file",
            str(tok_file),
            "--ftfy",
            "--num-docs",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    import ftfy

    assert _read(f"{out}_text_document") == _expected(tok_file, [ftfy.fix_text(t) for t in texts[:2]], eod=False)
    assert "schön" in ftfy.fix_text(texts[1])


def test_char_level_tokenizer_without_vocab(tmp_path: Path, preprocess) -> None:
    (tmp_path / "a.jsonl").write_bytes(_lines([{"text": "abc"}, {"text": "é"}]))
    out = tmp_path / "c"
    assert (
        preprocess.main(
            [
                "--input",
                str(tmp_path / "a.jsonl"),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "CharLevelTokenizer",
                "--append-eod",
                "--no-progress",
            ]
        )
        == 0
    )
    assert _read(f"{out}_text_document") == [[97, 98, 99, 0], [0xC3, 0xA9, 0]]


def test_errors_name_the_problem(tmp_path: Path, tok_file: Path) -> None:
    proc = run_tool(
        "tools/datasets/preprocess_data.py",
        "--input",
        str(tmp_path / "missing.jsonl"),
        "--output-prefix",
        str(tmp_path / "x"),
        "--tokenizer-type",
        "HFTokenizer",
        "--vocab-file",
        str(tok_file),
    )
    assert proc.returncode == 2 and "--input file not found" in proc.stderr and "missing.jsonl" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no text key"}\n')
    proc = run_tool(
        "tools/datasets/preprocess_data.py",
        "--input",
        str(bad),
        "--output-prefix",
        str(tmp_path / "x"),
        "--tokenizer-type",
        "HFTokenizer",
        "--vocab-file",
        str(tok_file),
        "--workers",
        "2",
    )
    assert proc.returncode == 2 and "no key 'text'" in proc.stderr
    proc = run_tool(
        "tools/datasets/preprocess_data.py",
        "--input",
        str(bad),
        "--output-prefix",
        str(tmp_path / "x"),
        "--tokenizer-type",
        "HFTokenizer",
        "--vocab-file",
        str(tmp_path / "no.json"),
    )
    assert proc.returncode == 2 and "vocab_file file not found" in proc.stderr


def test_failed_run_leaves_no_dataset(tmp_path: Path, tok_file: Path, preprocess) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(_lines(DOCS[:30]) + b"{broken json\n")
    out = tmp_path / "o"
    assert (
        preprocess.main(
            [
                "--input",
                str(bad),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "HFTokenizer",
                "--vocab-file",
                str(tok_file),
                "--workers",
                "2",
                "--batch-size",
                "4",
            ]
        )
        == 2
    )
    assert list(tmp_path.glob("o_*")) == []


@pytest.mark.parametrize("content,found", [
    (b"", "no documents"),
    (b'{"text": ""}\n{"text": ""}\n', "2 documents but no tokens (every text empty)"),
])
def test_empty_input_is_an_error_naming_it(tmp_path: Path, tok_file: Path, content: bytes, found: str) -> None:
    """Exit 0 with '0 documents' would leave a dataset that only fails later, in training."""
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(content)
    proc = run_tool("tools/datasets/preprocess_data.py", "--input", str(empty), "--output-prefix",
                    str(tmp_path / "out"), "--tokenizer-type", "HFTokenizer", "--vocab-file", str(tok_file))
    assert proc.returncode == 2, proc.stderr
    assert f"error: --input {empty} (jsonl keys text): {found}; nothing written to {tmp_path / 'out'}_text_document" \
           in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.glob("out_*")) == []
