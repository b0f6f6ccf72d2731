"""Encoders that produce a token dataset plus an aligned label dataset (-100 where no loss is taken).

MaskedTextEncoderSpec   plain documents; everything up to and including the last occurrence of a marker
                        string (e.g. "<|assistant|>") is masked.
ChatEncoderSpec         chat records {"messages": [{"role": ..., "content": ...}, ...]} rendered with a
                        simple template; loss only on assistant turns (optionally only the last one).

The chat template (this framework's own; `transformers` chat templates are not used):
    for every message:  ROLE_FORMAT.format(role=role)  then  content  then  "\\n"
    assistant turns end with the tokenizer's end-of-document token instead of "\\n".
The role headers, user/system turns and separators are masked; assistant content and its end token
are trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.errors import DataError
from megatron.tokenizer import build_tokenizer_from

IGNORE_INDEX = -100
DEFAULT_ROLE_FORMAT = "<|{role}|>\n"


def find_last_subsequence(seq: list[int], sub: list[int]) -> int:
    """Start of the last occurrence of `sub` in `seq`, or -1."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i : i + n] == sub:
            return i
    return -1


@dataclass(frozen=True)
class MaskedTextEncoderSpec:
    tokenizer_type: str
    vocab_file: str | None
    merge_file: str | None
    keys: tuple[str, ...]
    mask_before: str
    append_eod: bool = False
    token_dtype: type = np.int32

    def output_dtypes(self) -> dict[str, type]:
        out: dict[str, type] = {}
        for k in self.keys:
            out[f"{k}_document"] = self.token_dtype
            out[f"{k}_label"] = np.int32
        return out

    def build(self) -> Callable[[list[dict[str, Any]]], list[dict[str, np.ndarray]]]:
        tok = build_tokenizer_from(self.tokenizer_type, self.vocab_file, self.merge_file)
        marker = tok.tokenize(self.mask_before)
        if not marker:
            raise DataError(f"--mask-before-token {self.mask_before!r} tokenizes to nothing.")

        def encode(docs: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
            out = []
            for doc in docs:
                enc: dict[str, np.ndarray] = {}
                for key in self.keys:
                    ids = tok.tokenize(str(doc[key]))
                    if ids and self.append_eod:
                        ids.append(tok.eod)
                    labels = np.asarray(ids, dtype=np.int64)
                    at = find_last_subsequence(ids, marker)
                    cut = at + len(marker) if at >= 0 else len(ids)  # no marker: nothing to learn from
                    labels[:cut] = IGNORE_INDEX
                    enc[f"{key}_document"] = np.asarray(ids, dtype=self.token_dtype)
                    enc[f"{key}_label"] = labels.astype(np.int32)
                out.append(enc)
            return out

        return encode


@dataclass(frozen=True)
class ChatEncoderSpec:
    tokenizer_type: str
    vocab_file: str | None
    merge_file: str | None
    key: str = "messages"
    role_format: str = DEFAULT_ROLE_FORMAT
    only_last_turn: bool = False
    token_dtype: type = np.int32

    def output_dtypes(self) -> dict[str, type]:
        return {f"{self.key}_document": self.token_dtype, f"{self.key}_label_document": np.int32}

    def build(self) -> Callable[[list[dict[str, Any]]], list[dict[str, np.ndarray]]]:
        tok = build_tokenizer_from(self.tokenizer_type, self.vocab_file, self.merge_file)
        newline = tok.tokenize("\n")

        def encode_one(record: dict[str, Any]) -> dict[str, np.ndarray]:
            messages = record.get(self.key)
            if not isinstance(messages, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages
            ):
                raise DataError(f"chat record needs '{self.key}': a list of {{'role', 'content'}} objects.")
            assistant_turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            trained = set(assistant_turns[-1:] if self.only_last_turn else assistant_turns)
            ids: list[int] = []
            labels: list[int] = []
            for i, m in enumerate(messages):
                header = tok.tokenize(self.role_format.format(role=m["role"]))
                content = tok.tokenize(str(m["content"]))
                tail = [tok.eod] if m["role"] == "assistant" else newline
                ids += header + content + tail
                labels += [IGNORE_INDEX] * len(header)
                if i in trained:
                    labels += content + tail
                else:
                    labels += [IGNORE_INDEX] * (len(content) + len(tail))
            return {
                f"{self.key}_document": np.asarray(ids, dtype=self.token_dtype),
                f"{self.key}_label_document": np.asarray(labels, dtype=np.int32),
            }

        return lambda docs: [encode_one(d) for d in docs]
