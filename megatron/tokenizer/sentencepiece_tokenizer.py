"""tokenizer_type=SPMTokenizer: a SentencePiece model file (vocab_file)."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer, require_file
from megatron.errors import TokenizerError


class SentencePieceTokenizer(AbstractTokenizer):
    """SentencePiece model; eod is the model's eos id, else the piece '<|endoftext|>'."""

    def __init__(self, vocab_file: str | None) -> None:
        super().__init__("SPMTokenizer")
        path = require_file(vocab_file, "vocab_file", "SPMTokenizer")
        try:
            import sentencepiece as spm
        except ImportError as exc:
            raise TokenizerError(
                "tokenizer_type=SPMTokenizer needs the `sentencepiece` package: "
                "pip install -r requirements/requirements-sentencepiece.txt"
            ) from exc
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(path))
        except Exception as exc:  # sentencepiece raises OSError/RuntimeError on malformed models
            raise TokenizerError(f"vocab_file '{path}' is not a valid SentencePiece model: {exc}") from exc
        self._vocab = {self._sp.IdToPiece(i): i for i in range(self._sp.GetPieceSize())}
        eod = self._sp.eos_id()
        if eod < 0:
            eod = self._vocab.get("<|endoftext|>", -1)
        if eod < 0:
            raise TokenizerError(
                f"SPMTokenizer: '{path}' has neither an eos id nor a '<|endoftext|>' piece; train it with eos_id >= 0."
            )
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    def tokenize(self, text: str) -> list[int]:
        return self._sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.Encode(list(texts))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._sp.DecodeIds([int(i) for i in token_ids])

    @property
    def eod(self) -> int:
        return self._eod
