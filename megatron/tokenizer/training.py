"""Train a byte-level BPE tokenizer with the `tokenizers` library and save it as tokenizer.json."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|padding|>")
TRAINING_CHUNK_CHARS = 1 << 20


def split_long_texts(texts: Iterable[str], chunk_chars: int = TRAINING_CHUNK_CHARS) -> Iterator[str]:
    """Cut very long documents (e.g. enwik8, one 100 MB file) at line ends so the trainer's memory stays flat."""
    for text in texts:
        start = 0
        while len(text) - start > chunk_chars:
            cut = text.rfind("\n", start, start + chunk_chars) + 1
            if cut <= start:
                cut = start + chunk_chars
            yield text[start:cut]
            start = cut
        yield text[start:]


def train_byte_level_bpe(
    texts: Iterable[str],
    vocab_size: int = 8192,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a GPT-2 style byte-level BPE; the special tokens get the lowest ids (eod = 0 by default)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(split_long_texts(texts), trainer=trainer)
    return tok


def save_tokenizer(tok: Tokenizer, output: str | Path, gpt2_files: bool = False) -> list[Path]:
    """Save as tokenizer.json at `output` (a file path); with gpt2_files also vocab.json + merges.txt beside it."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    written = [out]
    if gpt2_files:
        written += [Path(p) for p in tok.model.save(str(out.parent))]
    return written
