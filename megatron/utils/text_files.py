"""Reading the text and JSON files a user or a checkpoint hands the project (configs, prompts, JSONL documents,
neox_args.json) so that a careless or hostile file gets one sentence naming it, never a raw traceback:

* not UTF-8 (a Latin-1 export, a binary file under a .jsonl name): the file, the byte offset and line of the
  first byte that does not decode, and how to convert it;
* nested deeper than the reader can follow (a JSON file of 200,000 `[`): named as damaged, instead of
  Python's RecursionError.

Each function takes the caller's exception type (`error`), so a config problem stays a ConfigError and a data
problem a DataError."""

import json
from typing import Any, Callable, Optional

ErrorFactory = Callable[[str], Exception]

CONVERT_HINT = "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8)"


def not_utf8_message(source: str, exc: UnicodeDecodeError, data: Optional[bytes] = None, base_offset: int = 0,
                     base_line: int = 1) -> str:
    """`source` is not UTF-8: where (byte offset from the start of the file, and line when `data`, the bytes
    `exc` was raised on, is given) and which byte."""
    offset = base_offset + exc.start
    bad = exc.object[exc.start:exc.start + 1] if isinstance(exc.object, (bytes, bytearray)) else b""
    newline = b"\n"
    line = f", line {base_line + data.count(newline, 0, exc.start)}" if data is not None else ""
    byte = f" (0x{bad.hex()})" if bad else ""
    return f"{source} is not UTF-8 text: the byte{byte} at byte offset {offset}{line} does not decode; {CONVERT_HINT}"


def decode_utf8(data: bytes, source: str, error: ErrorFactory = ValueError, base_offset: int = 0,
                base_line: int = 1) -> str:
    """`data` (read from `source`, starting at byte `base_offset`, line `base_line`) as text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(not_utf8_message(source, exc, data, base_offset, base_line)) from None


def read_utf8(path: str, error: ErrorFactory = ValueError) -> str:
    """The whole of text file `path`; not UTF-8 raises `error` naming the byte offset."""
    with open(path, "rb") as handle:
        return decode_utf8(handle.read(), path, error)


def utf8_problem(path: str) -> Optional[str]:
    """Why `path` cannot be read as UTF-8 text, or None (for the pre-launch checks, which gather problems)."""
    try:
        read_utf8(path)
    except ValueError as exc:
        return str(exc)
    return None


def too_deep_message(source: str) -> str:
    return (f"{source} is nested deeper than the reader can follow (thousands of levels of [ or {{); no file this "
            f"project writes or reads is nested like this: the file is damaged or hostile")


def parse_json(text: str, source: str, error: ErrorFactory = ValueError) -> Any:
    """json.loads with the two ways a file defeats it named: not JSON (with line and column), nested too deep."""
    try:
        return json.loads(text)
    except RecursionError:
        raise error(too_deep_message(source)) from None
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None


def read_json(path: str, error: ErrorFactory = ValueError) -> Any:
    """The JSON value of file `path` (UTF-8), every failure as `error` naming the file."""
    return parse_json(read_utf8(path, error), path, error)
