"""tokenizer_type=CharLevelTokenizer: UTF-8 bytes as ids, for tests and byte-level experiments."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer

CHAR_LEVEL_VOCAB_SIZE = 512


class CharLevelTokenizer(AbstractTokenizer):
    """Each UTF-8 byte is its own id (1..255); id 0 (NUL) is the end-of-document token.

    The vocabulary is 512 wide as in GPT-NeoX, leaving room above the bytes; ids outside 1..255 are
    dropped when decoding, and invalid UTF-8 is replaced rather than raising.
    """

    def __init__(self, vocab_size: int = CHAR_LEVEL_VOCAB_SIZE) -> None:
        super().__init__("CharLevelTokenizer")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return bytes(int(i) for i in token_ids if 0 < int(i) < 256).decode("utf-8", errors="replace")

    @property
    def eod(self) -> int:
        return 0
