"""Tokenizer training helpers: long documents are cut at line ends without losing text."""

from __future__ import annotations

from megatron.tokenizer.training import split_long_texts


def test_split_long_texts_keeps_all_text() -> None:
    text = "".join(f"line {i}\n" for i in range(1000))
    pieces = list(split_long_texts([text, "short"], chunk_chars=100))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "short"
    assert all(len(p) <= 100 for p in pieces) and all(p.endswith("\n") for p in pieces[:-1])
    assert list(split_long_texts(["x" * 250], chunk_chars=100)) == ["x" * 100, "x" * 100, "x" * 50]
