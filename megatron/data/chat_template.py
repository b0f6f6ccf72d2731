"""Tokens and label masks for chat data rendered with a Hugging Face tokenizer's Jinja chat template.

This is the `--tokenizer-path` mode of tools/datasets/preprocess_data_with_chat_template.py, with GPT-NeoX's
flags and file names. Each JSONL key (`messages`, `chosen`, `rejected`, ...) holds a list of
{"role", "content"} turns and becomes `{key}_document` (tokens) and `{key}_label_document` (int32 labels,
aligned with the tokens, not shifted: the training batch shifts them).

Labels: the conversation is rendered once and tokenized; rendering it one turn longer at a time gives where
each turn's text ends (the next turn's generation prompt counts with the turn before it). A token belongs to the
turn that holds its last character (so a word merged with the space before it belongs to the answer), and is
trained on when that turn is the generation role's, -100 otherwise. The sequence ends with the tokenizer's EOS, trained on when the last
turn is. `only_last` trains on the last turn only; `for_rm` trains on nothing but the final EOS (the
position a reward model scores); `no_mask` trains on everything. A `reward_key` adds `{key}_reward_document`:
one value per conversation (int32 +1/-1 with `binary_reward`, else float32), as KTO data needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron.errors import DataError
from megatron.utils.hf_folders import remote_code_problem

IGNORE_INDEX = -100


def load_chat_tokenizer(tokenizer_path: str, chat_template: str | None = None) -> Any:
    """transformers' AutoTokenizer from a local folder, with `chat_template` (the template text, or a file that
    holds it) replacing the folder's; a tokenizer with no template at all is a DataError."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - transformers is a requirement
        raise DataError("--tokenizer-path needs the `transformers` package (pip install transformers)") from exc
    if not os.path.isdir(tokenizer_path):
        raise DataError(f"--tokenizer-path {tokenizer_path!r} is not a folder (it must hold a Hugging Face "
                        f"tokenizer: tokenizer.json / tokenizer_config.json)")
    problem = remote_code_problem(tokenizer_path)
    if problem:
        raise DataError(f"--tokenizer-path: {problem}")
    try:  # never the folder's own code, never the Hub
        tok = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"--tokenizer-path {tokenizer_path!r}: transformers could not load a tokenizer: {exc}") from exc
    if chat_template:
        tok.chat_template = open(chat_template, encoding="utf-8").read() if os.path.isfile(chat_template) \
            else chat_template
    if not getattr(tok, "chat_template", None):
        raise DataError(f"the tokenizer in {tokenizer_path!r} has no chat template (no 'chat_template' in its "
                        f"tokenizer_config.json or chat_template.jinja); add one there or pass --chat-template "
                        f"TEMPLATE_OR_FILE")
    return tok


def _ids(rendered: Any) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list, or a BatchEncoding in newer transformers."""
    if hasattr(rendered, "keys") and "input_ids" in rendered:
        rendered = rendered["input_ids"]
    return list(rendered)


def chat_tokens_and_labels(turns: list[dict[str, Any]], tok: Any, generation_role: str = "assistant",
                           only_last: bool = False, for_rm: bool = False, no_mask: bool = False
                           ) -> tuple[list[int], list[int]]:
    """(tokens, labels) of one conversation; see the module docstring for the masking rules."""
    eos = tok.eos_token_id
    if for_rm or not no_mask:
        if eos is None:
            raise DataError("the tokenizer has no EOS token, which ends each sequence (and is what --for-rm scores); "
                            "set eos_token in its tokenizer_config.json")
    if no_mask:
        tokens = _ids(tok.apply_chat_template(turns, tokenize=True))
        return tokens, list(tokens)
    if for_rm:
        tokens = _ids(tok.apply_chat_template(turns, tokenize=True)) + [eos, eos]
        return tokens, [IGNORE_INDEX] * (len(tokens) - 1) + [eos]
    text = tok.apply_chat_template(turns, tokenize=False)
    ends: list[int] = []  # where each turn's text (with the next turn's generation prompt) ends in `text`
    for i in range(len(turns)):
        model_speaks_next = i + 1 < len(turns) and turns[i + 1]["role"] == generation_role
        prefix = tok.apply_chat_template(turns[: i + 1], tokenize=False, add_generation_prompt=model_speaks_next)
        if not text.startswith(prefix):
            raise DataError("the chat template renders a conversation's beginning differently once later turns are "
                            "added, so turns cannot be masked separately; use --no-mask or another template")
        ends.append(len(prefix))
    trained = [turn["role"] == generation_role and (not only_last or i == len(turns) - 1)
               for i, turn in enumerate(turns)]
    if not getattr(tok, "is_fast", False):
        raise DataError("masking turns needs a fast (Rust) tokenizer with offsets: give --tokenizer-path a folder "
                        "with tokenizer.json")
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens = list(encoded["input_ids"])
    labels: list[int] = []
    turn = 0
    for token, (_, stop) in zip(tokens, encoded["offset_mapping"]):
        while turn + 1 < len(ends) and stop > ends[turn]:  # a token belongs to the turn of its last character
            turn += 1
        labels.append(token if trained[turn] else IGNORE_INDEX)
    tokens.append(eos)
    labels.append(eos if labels and labels[-1] != IGNORE_INDEX else IGNORE_INDEX)
    return tokens, labels


def _turns(record: dict[str, Any], key: str) -> list[dict[str, Any]]:
    turns = record.get(key)
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and "role" in t and "content" in t for t in turns):
        raise DataError(f"chat record needs '{key}': a non-empty list of {{'role', 'content'}} objects "
                        f"(got {type(turns).__name__}); check --jsonl-keys")
    return turns


@dataclass(frozen=True)
class ChatTemplateEncoderSpec:
    """Picklable recipe for megatron.data.preprocessing (built once per worker process)."""

    tokenizer_path: str
    keys: tuple[str, ...] = ("messages",)
    chat_template: str | None = None
    generation_role: str = "assistant"
    only_last: bool = False
    for_rm: bool = False
    no_mask: bool = False
    reward_key: str | None = None
    binary_reward: bool = False
    token_dtype: type = np.int32

    def output_dtypes(self) -> dict[str, type]:
        out: dict[str, type] = {}
        for key in self.keys:
            out[f"{key}_document"] = self.token_dtype
            out[f"{key}_label_document"] = np.int32
            if self.reward_key is not None:
                out[f"{key}_reward_document"] = np.int32 if self.binary_reward else np.float32
        return out

    def _reward(self, record: dict[str, Any]) -> np.ndarray:
        if self.reward_key not in record:
            raise DataError(f"record has no reward key {self.reward_key!r} (--reward-key)")
        value = record[self.reward_key]
        if self.binary_reward:
            return np.asarray([1 if value else -1], dtype=np.int32)
        try:
            return np.asarray([float(value)], dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise DataError(f"reward {value!r} under {self.reward_key!r} is not a number; pass --binary-reward "
                            f"for true/false rewards") from exc

    def build(self) -> Callable[[list[dict[str, Any]]], list[dict[str, np.ndarray]]]:
        tok = load_chat_tokenizer(self.tokenizer_path, self.chat_template)

        def encode_one(record: dict[str, Any]) -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for key in self.keys:
                tokens, labels = chat_tokens_and_labels(_turns(record, key), tok, self.generation_role,
                                                        self.only_last, self.for_rm, self.no_mask)
                out[f"{key}_document"] = np.asarray(tokens, dtype=self.token_dtype)
                out[f"{key}_label_document"] = np.asarray(labels, dtype=np.int32)
                if self.reward_key is not None:
                    out[f"{key}_reward_document"] = self._reward(record)
            return out

        return lambda docs: [encode_one(d) for d in docs]
