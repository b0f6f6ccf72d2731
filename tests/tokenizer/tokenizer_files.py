"""Build tiny tokenizer files of every supported kind in a temporary directory (no downloads)."""

from __future__ import annotations

import base64
from pathlib import Path

from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe

SAMPLE_TEXTS = [
    "def main():\n    return 'hello world'\n",
    "The quick brown fox jumps over the lazy dog. The end.",
    "import os\nfor i in range(10):\n    print(i, os.sep)\n",
    "Unicode: café, naïve, 東京, emoji 🙂 and tabs\tand\nnewlines",
] * 20

ROUND_TRIP_TEXTS = [
    "hello world",
    "def f(x):\n    return x * 2  # comment\n",
    "café naïve 東京 🙂",
    "  leading and trailing spaces  ",
]


def make_hf_tokenizer_files(directory: Path, vocab_size: int = 400) -> dict[str, Path]:
    """Train a byte-level BPE; return paths of tokenizer.json, vocab.json and merges.txt."""
    tok = train_byte_level_bpe(SAMPLE_TEXTS, vocab_size=vocab_size)
    save_tokenizer(tok, directory / "tokenizer.json", gpt2_files=True)
    return {
        "tokenizer_json": directory / "tokenizer.json",
        "vocab": directory / "vocab.json",
        "merges": directory / "merges.txt",
    }


def make_tiktoken_file(directory: Path) -> Path:
    """All 256 bytes plus a few merges, as 'base64(token) rank' lines."""
    tokens = [bytes([b]) for b in range(256)] + [b"th", b"the", b" the", b"he", b"ll", b"llo", b" w"]
    path = directory / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return path


def make_sentencepiece_model(directory: Path, vocab_size: int = 400) -> Path:
    """Train a tiny BPE SentencePiece model that round-trips exactly (byte fallback, identity normaliser)."""
    import sentencepiece as spm

    prefix = directory / "spm"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SAMPLE_TEXTS),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        split_by_whitespace=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return Path(f"{prefix}.model")
