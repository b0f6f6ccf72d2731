"""tokenizer_type=TiktokenTokenizer: a local `.tiktoken` BPE rank file (vocab_file), encoded by `tiktoken`."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer, require_file
from megatron.errors import TokenizerError

# The pre-tokenisation regex of the cl100k family, which the published .tiktoken rank files expect.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
EOD_TOKEN = "<|endoftext|>"


class TiktokenTokenizer(AbstractTokenizer):
    """BPE ranks from a local file; '<|endoftext|>' is added after the ranks and is the eod token.

    Named encodings (e.g. 'cl100k_base') would be downloaded by tiktoken; this framework does not download
    at run time, so vocab_file must be a path to the .tiktoken file itself.
    """

    def __init__(self, vocab_file: str | None, pattern: str = CL100K_PATTERN) -> None:
        super().__init__("TiktokenTokenizer")
        if vocab_file and "://" in vocab_file:
            raise TokenizerError(
                f"TiktokenTokenizer: vocab_file '{vocab_file}' is a URL; download the .tiktoken file by hand "
                f"and set vocab_file to its local path."
            )
        path = require_file(vocab_file, "vocab_file", "TiktokenTokenizer")
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as exc:
            raise TokenizerError(
                "tokenizer_type=TiktokenTokenizer needs the `tiktoken` package: "
                "pip install -r requirements/requirements-tiktoken.txt"
            ) from exc
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as exc:
            raise TokenizerError(
                f"vocab_file '{path}' is not a valid .tiktoken file (lines of 'base64-token rank'): {exc}"
            ) from exc
        n = max(ranks.values()) + 1 if ranks else 0
        self._eod = n
        self._enc = tiktoken.Encoding(
            name=path.stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens={EOD_TOKEN: n}
        )
        self._ranks = ranks

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def vocab(self) -> dict[str, int]:
        v = {tok.decode("utf-8", errors="backslashreplace"): i for tok, i in self._ranks.items()}
        v[EOD_TOKEN] = self._eod
        return v

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts), num_threads=1)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in token_ids])

    @property
    def eod(self) -> int:
        return self._eod
