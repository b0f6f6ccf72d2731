"""Tokenizers backed by the Hugging Face `tokenizers` library (tokenizer.json or GPT-2 vocab.json + merges.txt)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer, require_file
from megatron.errors import TokenizerError

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<eod>")


class TokenizersLibraryTokenizer(AbstractTokenizer):
    """Wraps a `tokenizers.Tokenizer`; the eod id is the first of the usual end-of-text tokens it knows.

    `skips_special_tokens`: whether detokenize drops special tokens such as `<|endoftext|>`, as the library
    GPT-NeoX decodes the same tokenizer type with does (see each subclass)."""

    skips_special_tokens = False

    def __init__(self, name: str, tokenizer: Tokenizer, source: str) -> None:
        super().__init__(name)
        self._tok = tokenizer
        self._vocab = tokenizer.get_vocab(with_added_tokens=True)
        eod = next((self._vocab[t] for t in EOD_CANDIDATES if t in self._vocab), None)
        if eod is None:
            raise TokenizerError(
                f"{name}: '{source}' has no end-of-document token (looked for {', '.join(EOD_CANDIDATES)}); "
                f"add one, e.g. train it with special token '<|endoftext|>'."
            )
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in token_ids], skip_special_tokens=self.skips_special_tokens)

    @property
    def eod(self) -> int:
        return self._eod


def _load_tokenizer_json(path: str | None, option: str, name: str) -> Tokenizer:
    p = require_file(path, option, name)
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the library raises a bare Exception on malformed JSON
        raise TokenizerError(f"{option} '{p}' is not a valid tokenizer.json for {name}: {exc}") from exc


def _load_gpt2_vocab_merges(vocab_file: str | None, merge_file: str | None, name: str) -> Tokenizer:
    vocab = require_file(vocab_file, "vocab_file", name)
    merges = require_file(merge_file, "merge_file", name)
    try:
        model = BPE.from_file(str(vocab), str(merges))
    except Exception as exc:
        raise TokenizerError(
            f"{name}: cannot read GPT-2 BPE files vocab_file='{vocab}', merge_file='{merges}': {exc}"
        ) from exc
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab_map = tok.get_vocab()
    specials = [t for t in EOD_CANDIDATES if t in vocab_map]
    tok.add_special_tokens(specials)
    return tok


class HFTokenizer(TokenizersLibraryTokenizer):
    """tokenizer_type=HFTokenizer: vocab_file is a `tokenizer.json`. Detokenizing drops its special tokens
    (`<|endoftext|>`, `<|padding|>`, ...), as GPT-NeoX's HFTokenizer does (tokenizers' decode default)."""

    skips_special_tokens = True

    def __init__(self, vocab_file: str | None) -> None:
        super().__init__("HFTokenizer", _load_tokenizer_json(vocab_file, "vocab_file", "HFTokenizer"), str(vocab_file))


class GPT2BPETokenizer(TokenizersLibraryTokenizer):
    """tokenizer_type=GPT2BPETokenizer: GPT-2 style vocab.json (vocab_file) + merges.txt (merge_file).
    Detokenizing keeps `<|endoftext|>`, as GPT-NeoX's (transformers' GPT2Tokenizer.decode) does."""

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        tok = _load_gpt2_vocab_merges(vocab_file, merge_file, "GPT2BPETokenizer")
        super().__init__("GPT2BPETokenizer", tok, str(vocab_file))


class HFGPT2Tokenizer(TokenizersLibraryTokenizer):
    """tokenizer_type=HFGPT2Tokenizer: the GPT-2 tokenizer from local files.

    GPT-NeoX downloads "gpt2" from the Hub when vocab_file is unset; this framework never downloads at
    run time, so vocab_file (a tokenizer.json, or a vocab.json together with merge_file) is required.
    Detokenizing keeps `<|endoftext|>`, as GPT-NeoX's (transformers' GPT2TokenizerFast.decode) does.
    """

    def __init__(self, vocab_file: str | None, merge_file: str | None = None) -> None:
        name = "HFGPT2Tokenizer"
        if not vocab_file:
            raise TokenizerError(
                f"{name} needs `vocab_file` (a GPT-2 tokenizer.json, or vocab.json plus `merge_file`): "
                f"downloading 'gpt2' from the Hugging Face Hub at run time is not supported."
            )
        if merge_file:
            tok = _load_gpt2_vocab_merges(vocab_file, merge_file, name)
        else:
            tok = _load_tokenizer_json(vocab_file, "vocab_file", name)
        super().__init__(name, tok, str(vocab_file))
