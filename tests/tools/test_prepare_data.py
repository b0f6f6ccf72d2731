"""prepare_data.py: the offline stdlib corpus end to end, reuse on rerun, online corpora offline."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from megatron.data.corpora import ONLINE_CORPORA, stdlib_source_files
from megatron.errors import DataError
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer_from
from tests.tools.tool_runner import load_tool, run_tool


def test_stdlib_corpus_end_to_end_and_reuse(tmp_path: Path) -> None:
    proc = run_tool("tools/datasets/prepare_data.py", "-d", str(tmp_path), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    d = tmp_path / "stdlib"
    tok = build_tokenizer_from("HFTokenizer", str(d / "tokenizer.json"))
    assert tok.vocab_size == 8192 and tok.inv_vocab[tok.eod] == "<|endoftext|>"
    ds = MMapIndexedDataset(d / "stdlib_text_document")
    with open(d / "stdlib.jsonl", encoding="utf-8") as fh:
        first = [json.loads(next(fh))["text"] for _ in range(3)]
    assert ds.num_documents > 500 and ds.num_tokens > 1_000_000
    for i, text in enumerate(first):
        assert ds.document(i).tolist() == tok.tokenize(text) + [tok.eod]
    mtimes = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    proc = run_tool("tools/datasets/prepare_data.py", "-d", str(tmp_path), "--no-progress")
    assert proc.returncode == 0 and "reusing" in proc.stdout
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == mtimes


def test_stdlib_files_are_sorted_and_exclude_tests() -> None:
    files = stdlib_source_files()
    assert files and all(f.suffix == ".py" for f in files)
    assert not any(part in {"site-packages", "test", "tests"} for f in files for part in f.parts[-3:-1])
    assert len(files) == len(set(files)) and files == stdlib_source_files()


def test_online_corpus_offline_names_url_and_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def offline(*args, **kwargs):
        raise urllib.error.URLError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    prepare = load_tool("tools/datasets/prepare_data.py")
    assert prepare.main(["-d", str(tmp_path), "enwik8"]) == 2
    err = capsys.readouterr().err
    assert ONLINE_CORPORA["enwik8"].url in err and "--input" in err and "by hand" in err


def test_online_corpus_from_local_zip(tmp_path: Path) -> None:
    zpath = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(zpath, "w") as zf:
        zf.writestr("enwik8", "<mediawiki> some wiki text </mediawiki>\n" * 200)
    proc = run_tool(
        "tools/datasets/prepare_data.py",
        "-d",
        str(tmp_path / "data"),
        "enwik8",
        "--input",
        str(zpath),
        "--vocab-size",
        "300",
        "--workers",
        "1",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    ds = MMapIndexedDataset(tmp_path / "data" / "enwik8" / "enwik8_text_document")
    tok = build_tokenizer_from("HFTokenizer", str(tmp_path / "data" / "enwik8" / "tokenizer.json"))
    assert tok.detokenize(ds.document(0).tolist()[:-1]) == "<mediawiki> some wiki text </mediawiki>\n" * 200


def test_tar_archive_is_refused_clearly(tmp_path: Path) -> None:
    from megatron.data.corpora import unpack_if_archive

    with pytest.raises(DataError, match="tar archive; extract it by hand"):
        unpack_if_archive(tmp_path / "x.tar.gz", tmp_path)
