"""Choose and build the tokenizer named by `tokenizer_type`, and pad its vocabulary for the embedding."""

from __future__ import annotations

from typing import Any

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.errors import TokenizerError

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HFTokenizer",
    "HFGPT2Tokenizer",
    "SPMTokenizer",
    "CharLevelTokenizer",
    "TiktokenTokenizer",
)


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
        from megatron.tokenizer.hf_tokenizer import GPT2BPETokenizer

        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HFTokenizer":
        from megatron.tokenizer.hf_tokenizer import HFTokenizer

        return HFTokenizer(vocab_file)
    if tokenizer_type == "HFGPT2Tokenizer":
        from megatron.tokenizer.hf_tokenizer import HFGPT2Tokenizer

        return HFGPT2Tokenizer(vocab_file, merge_file)
    if tokenizer_type == "SPMTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(vocab_file)
    if tokenizer_type == "CharLevelTokenizer":
        from megatron.tokenizer.char_level_tokenizer import CharLevelTokenizer

        return CharLevelTokenizer()
    if tokenizer_type == "TiktokenTokenizer":
        from megatron.tokenizer.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(vocab_file)
    raise TokenizerError(f"tokenizer_type={tokenizer_type!r} is not known; use one of {', '.join(TOKENIZER_TYPES)}.")
