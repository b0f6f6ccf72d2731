"""The interface every tokenizer implements, so model, data and generation code never care which one it is."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

from megatron.errors import TokenizerError


class AbstractTokenizer(ABC):
    """Maps text to token ids and back; exposes the vocabulary and the end-of-document id."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for the embedding)."""

    @property
    @abstractmethod
    def vocab(self) -> dict[str, int]:
        """Token string -> id."""

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> token string."""
        return {i: t for t, i in self.vocab.items()}

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Encode text to ids (no special tokens added)."""

    @abstractmethod
    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Decode ids back to text."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id of the end-of-document token appended between documents."""

    @property
    def eod_id(self) -> int:
        """Alias of `eod` (older code uses this name)."""
        return self.eod

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts; subclasses backed by fast batch encoders override this."""
        return [self.tokenize(t) for t in texts]


def require_file(path: str | None, option: str, tokenizer_type: str) -> Path:
    """Return `path` as a Path, or raise a TokenizerError naming the option and the missing file."""
    if not path:
        raise TokenizerError(
            f"tokenizer_type={tokenizer_type} needs `{option}`: set it to the path of the tokenizer file."
        )
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(
            f"{option} file not found: '{path}' (tokenizer_type={tokenizer_type}). "
            f"Check the path, or create the files with tools/datasets/prepare_data.py or "
            f"tools/tokenizers/train_tokenizer.py."
        )
    return p
