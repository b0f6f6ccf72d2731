"""Read documents from jsonl, jsonl.gz, jsonl.zst and plain-text files, in a fixed order.

Shared by the preprocessing and tokenizer-training tools so both accept the same inputs.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from megatron.errors import DataError
from megatron.utils.text_files import decode_utf8, too_deep_message

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")


def expand_input_paths(inputs: str | Sequence[str]) -> list[str]:
    """Expand files, globs and comma-separated lists into an ordered list of existing files."""
    items = [inputs] if isinstance(inputs, str) else list(inputs)
    out: list[str] = []
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            if any(c in part for c in "*?["):
                matches = sorted(glob.glob(part, recursive=True))
                if not matches:
                    raise DataError(f"--input glob '{part}' matched no files.")
                out.extend(matches)
            elif os.path.isdir(part):
                raise DataError(f"--input '{part}' is a directory; pass files or a glob such as '{part}/*.jsonl'.")
            elif not os.path.isfile(part):
                raise DataError(f"--input file not found: '{part}'.")
            else:
                out.append(part)
    if not out:
        raise DataError("--input named no files.")
    return out


def _open_bytes(path: str) -> IO[bytes]:
    """The file's (decompressed) bytes; decoded line by line by the readers, so that a byte that is not UTF-8 is
    named with its offset (of the decompressed text, for .gz / .zst) instead of a UnicodeDecodeError."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as exc:
            raise DataError(f"reading '{path}' needs the `zstandard` package: "
                            "pip install -r requirements/requirements-data.txt") from exc
        fh = open(path, "rb")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh, closefd=True))
    return open(path, "rb")


def _text_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of `path`; a line that is not UTF-8 raises DataError naming the byte."""
    offset = 0
    with _open_bytes(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            yield lineno, decode_utf8(raw, path, DataError, base_offset=offset, base_line=lineno)
            offset += len(raw)


def is_jsonl(path: str) -> bool:
    """Whether `path` is read as JSON lines (by suffix); everything else is plain text."""
    return path.endswith(JSONL_SUFFIXES)


def iter_json_records(paths: Sequence[str]) -> Iterator[dict]:
    """Yield each JSON object of each jsonl file in order; a bad line raises naming file and line."""
    for path in paths:
        for lineno, line in _text_lines(path):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}).") from exc
            except RecursionError:
                raise DataError(f"{path}:{lineno}: {too_deep_message('this line')}.") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object per line.")
            yield rec


def iter_documents(paths: Sequence[str], jsonl_keys: Sequence[str] = ("text",)) -> Iterator[dict[str, str]]:
    """Yield {key: text} per document: a jsonl line, or a whole plain-text file (under every key)."""
    for path in paths:
        if is_jsonl(path):
            for rec in iter_json_records([path]):
                doc = {}
                for key in jsonl_keys:
                    if key not in rec:
                        raise DataError(f"{path}: a record has no key '{key}' (set --jsonl-keys).")
                    doc[key] = str(rec[key])
                yield doc
        else:
            with _open_bytes(path) as fh:
                text = decode_utf8(fh.read(), path, DataError)
            yield {key: text for key in jsonl_keys}


def iter_texts(paths: Sequence[str], key: str = "text") -> Iterator[str]:
    """Yield the text of each document, for tokenizer training."""
    for doc in iter_documents(paths, (key,)):
        yield doc[key]


def write_jsonl(path: str | Path, texts: Sequence[str] | Iterator[str], key: str = "text") -> None:
    """Write one {key: text} object per line."""
    with open(path, "w", encoding="utf-8") as fh:
        for t in texts:
            fh.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
