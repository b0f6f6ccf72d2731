"""Each tokenizer type builds from local files, round-trips text, and exposes the common interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.tokenizer.build_tokenizer import build_tokenizer_from
from megatron.tokenizer import TOKENIZER_TYPES, AbstractTokenizer, build_tokenizer
from megatron.errors import TokenizerError
from tests.neox_arguments.helpers import tiny
from tests.tokenizer.tokenizer_files import (
    ROUND_TRIP_TEXTS,
    make_hf_tokenizer_files,
    make_sentencepiece_model,
    make_tiktoken_file,
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tok")
    out = make_hf_tokenizer_files(d)
    out["tiktoken"] = make_tiktoken_file(d)
    out["spm"] = make_sentencepiece_model(d)
    return out


def _args_for(kind: str, files: dict[str, Path]):
    if kind == "GPT2BPETokenizer":
        return tiny(tokenizer_type=kind, vocab_file=str(files["vocab"]), merge_file=str(files["merges"]))
    if kind == "HFTokenizer":
        return tiny(tokenizer_type=kind, vocab_file=str(files["tokenizer_json"]))
    if kind == "HFGPT2Tokenizer":
        return tiny(tokenizer_type=kind, vocab_file=str(files["tokenizer_json"]))
    if kind == "SPMTokenizer":
        return tiny(tokenizer_type=kind, vocab_file=str(files["spm"]))
    if kind == "TiktokenTokenizer":
        return tiny(tokenizer_type=kind, vocab_file=str(files["tiktoken"]))
    return tiny(tokenizer_type=kind)


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_round_trip_and_interface(kind: str, files: dict[str, Path]) -> None:
    args = _args_for(kind, files)
    before = dict(vars(args))
    tok = build_tokenizer(args)
    assert vars(args) == before, "build_tokenizer must not mutate neox_args"
    assert isinstance(tok, AbstractTokenizer)
    for text in ROUND_TRIP_TEXTS:
        ids = tok.tokenize(text)
        assert ids and all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
        assert tok.eod not in ids
    assert tok.tokenize_batch(ROUND_TRIP_TEXTS) == [tok.tokenize(t) for t in ROUND_TRIP_TEXTS]
    assert tok.eod == tok.eod_id and 0 <= tok.eod < tok.vocab_size
    if kind != "CharLevelTokenizer":
        assert len(tok.vocab) == tok.vocab_size
        assert tok.inv_vocab[tok.eod] == ("</s>" if kind == "SPMTokenizer" else "<|endoftext|>")


def test_bpe_compresses_text(files: dict[str, Path]) -> None:
    tok = build_tokenizer(_args_for("HFTokenizer", files))
    text = "The quick brown fox jumps over the lazy dog."
    assert len(tok.tokenize(text)) < len(text.encode()) / 2


def test_gpt2_files_and_tokenizer_json_agree(files: dict[str, Path]) -> None:
    a = build_tokenizer(_args_for("GPT2BPETokenizer", files))
    b = build_tokenizer(_args_for("HFTokenizer", files))
    for text in ROUND_TRIP_TEXTS:
        assert a.tokenize(text) == b.tokenize(text)
    assert a.eod == b.eod


def test_tiktoken_uses_merges(files: dict[str, Path]) -> None:
    tok = build_tokenizer(_args_for("TiktokenTokenizer", files))
    assert tok.tokenize(" the") == [258]  # 256 bytes, then "th", "the", " the"
    assert tok.eod == 263 and tok.vocab_size == 264  # 263 ranks + eod


@pytest.mark.parametrize("spelling", ["hftokenizer", "HFTOKENIZER", "HfTokenizer"])
def test_tokenizer_type_in_any_case(spelling: str, files: dict[str, Path]) -> None:
    """GPT-NeoX's build_tokenizer compares the type without regard to case: the config stores the declared
    spelling, and the preprocessing tools' builder accepts any case too."""
    assert tiny(tokenizer_type=spelling).tokenizer_type == "HFTokenizer"
    tok = build_tokenizer_from(spelling, str(files["tokenizer_json"]))
    assert tok.name == "HFTokenizer" and tok.tokenize("hello world") == build_tokenizer(
        _args_for("HFTokenizer", files)).tokenize("hello world")


def test_unknown_tokenizer_type_names_the_choices() -> None:
    with pytest.raises(TokenizerError, match="tokenizer_type='Nope'.*HFTokenizer"):
        build_tokenizer_from("Nope")  # the preprocessing tools' path; configs are refused at validation


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HFTokenizer", "SPMTokenizer", "TiktokenTokenizer"])
def test_missing_vocab_file_names_the_path(kind: str, tmp_path: Path) -> None:
    missing = tmp_path / "absent.file"
    args = tiny(tokenizer_type=kind, vocab_file=str(missing), merge_file=str(missing))
    with pytest.raises(TokenizerError, match="vocab_file file not found: '.*absent.file'"):
        build_tokenizer(args)


def test_unset_vocab_file_names_the_option() -> None:
    with pytest.raises(TokenizerError, match="needs `vocab_file`"):
        build_tokenizer(tiny(tokenizer_type="HFTokenizer"))
    with pytest.raises(TokenizerError, match="Hub at run time is not supported"):
        build_tokenizer(tiny(tokenizer_type="HFGPT2Tokenizer"))


def test_corrupt_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        build_tokenizer(tiny(tokenizer_type="HFTokenizer", vocab_file=str(bad)))


# What GPT-NeoX's tokenizer of each type calls to detokenize (megatron/tokenizer/tokenizer.py there), built
# from the same files: the oracle for whether `<|endoftext|>` survives.
def _gpt_neox_decoder(kind: str, files: dict[str, Path]):
    if kind == "HFTokenizer":  # tokenizers.Tokenizer.decode, default skip_special_tokens=True
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(files["tokenizer_json"])).decode
    if kind == "GPT2BPETokenizer":  # transformers' GPT2Tokenizer(vocab, merges).decode
        from transformers import GPT2Tokenizer

        return GPT2Tokenizer(str(files["vocab"]), str(files["merges"]), errors="replace").decode
    if kind == "HFGPT2Tokenizer":  # transformers' GPT2TokenizerFast.decode
        from transformers import GPT2TokenizerFast

        return GPT2TokenizerFast(tokenizer_file=str(files["tokenizer_json"])).decode
    if kind == "SPMTokenizer":  # sentencepiece's decode
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(files["spm"])).decode
    raise KeyError(kind)


@pytest.mark.parametrize("kind,keeps_eod", [("HFTokenizer", False), ("GPT2BPETokenizer", True),
                                            ("HFGPT2Tokenizer", True), ("SPMTokenizer", False),
                                            ("TiktokenTokenizer", True)])
def test_detokenize_drops_or_keeps_the_eod_token_as_gpt_neox_does(kind: str, keeps_eod: bool,
                                                                  files: dict[str, Path]) -> None:
    tok = build_tokenizer(_args_for(kind, files))
    text = "hello world"
    ids = tok.tokenize(text) + [tok.eod] + tok.tokenize(" again") + [tok.eod]
    eod_text = tok.inv_vocab[tok.eod]
    expected = f"{text}{eod_text} again{eod_text}" if keeps_eod else f"{text} again"
    assert tok.detokenize(ids) == expected
    if kind != "TiktokenTokenizer":  # GPT-NeoX's tiktoken type loads a named encoding, not a local file
        assert tok.detokenize(ids) == _gpt_neox_decoder(kind, files)(ids)


def test_hf_tokenizer_detokenize_drops_every_special_token(files: dict[str, Path]) -> None:
    tok = build_tokenizer(_args_for("HFTokenizer", files))
    padding = tok.vocab["<|padding|>"]
    assert tok.detokenize([padding] + tok.tokenize("hi") + [tok.eod, padding]) == "hi"


def test_char_level_detokenize_drops_the_eod_byte() -> None:
    """GPT-NeoX's CharLevelTokenizer maps every id below 32 to a space (the eod 0 and newlines alike); here
    the eod (0) is dropped and newlines round-trip."""
    tok = build_tokenizer(tiny(tokenizer_type="CharLevelTokenizer"))
    assert tok.detokenize(tok.tokenize("a\nb") + [tok.eod]) == "a\nb"
