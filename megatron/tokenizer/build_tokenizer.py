"""Choose and build the tokenizer named by `tokenizer_type`, and pad its vocabulary for the embedding."""

from __future__ import annotations

import os
from typing import Any, List

from megatron.errors import TokenizerError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.char_level_tokenizer import CharLevelTokenizer
from megatron.tokenizer.hf_tokenizer import GPT2BPETokenizer, HFGPT2Tokenizer, HFTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.tokenizer.tiktoken_tokenizer import TiktokenTokenizer

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HFTokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
)


def tokenizer_file_problems(tokenizer_type: str, vocab_file: str | None, merge_file: str | None) -> List[str]:
    """The files `tokenizer_type` will open that are missing, each naming its option (deepy.py checks this
    before any worker starts; the tokenizers raise the same TokenizerError when they are built)."""
    tokenizer_type = {t.lower(): t for t in TOKENIZER_TYPES}.get(str(tokenizer_type).lower(), tokenizer_type)
    if tokenizer_type not in TOKENIZER_TYPES or tokenizer_type == "CharLevelTokenizer":
        return []
    needed = {"vocab_file": vocab_file}
    if tokenizer_type == "GPT2BPETokenizer" or (tokenizer_type == "HFGPT2Tokenizer" and merge_file):
        needed["merge_file"] = merge_file
    problems = []
    for option, path in needed.items():
        if not path:
            problems.append(f"tokenizer_type={tokenizer_type} needs {option}: set it to the path of the tokenizer "
                            f"file")
        elif "://" not in path and not os.path.isfile(path):
            problems.append(f"{option} file not found: '{path}' (tokenizer_type={tokenizer_type}); check the path, "
                            f"or create it with tools/datasets/prepare_data.py or tools/tokenizers/train_tokenizer.py")
    return problems


def build_tokenizer(neox_args: Any) -> AbstractTokenizer:
    """Build the tokenizer from `neox_args.tokenizer_type`, `vocab_file` and `merge_file` (not mutated)."""
    return build_tokenizer_from(neox_args.tokenizer_type, neox_args.vocab_file, neox_args.merge_file)


def build_tokenizer_from(
    tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None
) -> AbstractTokenizer:
    """Same as `build_tokenizer` from explicit values (used by the preprocessing tools). The type may be
    written in any case (`hftokenizer`), as GPT-NeoX's build_tokenizer accepts it."""
    tokenizer_type = {t.lower(): t for t in TOKENIZER_TYPES}.get(str(tokenizer_type).lower(), tokenizer_type)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HFTokenizer":
        return HFTokenizer(vocab_file)
    if tokenizer_type == "HFGPT2Tokenizer":
        return HFGPT2Tokenizer(vocab_file, merge_file)
    if tokenizer_type == "SPMTokenizer":
        return SentencePieceTokenizer(vocab_file)
    if tokenizer_type == "CharLevelTokenizer":
        return CharLevelTokenizer()
    if tokenizer_type == "TiktokenTokenizer":
        return TiktokenTokenizer(vocab_file)
    raise TokenizerError(f"tokenizer_type={tokenizer_type!r} is not known; use one of {', '.join(TOKENIZER_TYPES)}.")
