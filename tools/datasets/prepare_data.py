"""Prepare a named corpus for training: text -> byte-level BPE tokenizer -> indexed dataset.

    python tools/datasets/prepare_data.py                 # offline default: Python's standard library
    python tools/datasets/prepare_data.py -d data enwik8  # online corpora, or --input a downloaded file

For corpus NAME this writes DATA_DIR/NAME/tokenizer.json (HFTokenizer, end-of-document token
"<|endoftext|>") and DATA_DIR/NAME/NAME_text_document.bin/.idx. Outputs that exist are reused.
Pass --vocab-file/--tokenizer-type to use an existing tokenizer instead of training one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.corpora import (  # noqa: E402
    OFFLINE_CORPORA,
    ONLINE_CORPORA,
    download,
    iter_stdlib_texts,
    unpack_if_archive,
)
from megatron.data.document_readers import expand_input_paths, iter_documents, iter_texts, write_jsonl  # noqa: E402
from megatron.errors import DataError, TokenizerError  # noqa: E402
from megatron.data.indexed_dataset import dataset_exists  # noqa: E402
from megatron.data.preprocessing import TextEncoderSpec, vocab_size_of, write_indexed_datasets  # noqa: E402
from megatron.tokenizer import TOKENIZER_TYPES  # noqa: E402
from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = list(OFFLINE_CORPORA) + sorted(ONLINE_CORPORA)
    p.add_argument(
        "name",
        nargs="?",
        default="stdlib",
        choices=names,
        metavar="NAME",
        help=f"corpus: {', '.join(names)} (default stdlib, needs no network)",
    )
    p.add_argument("-d", "--data-dir", default="./data", help="output directory (default ./data)")
    p.add_argument(
        "--input",
        nargs="+",
        default=None,
        help="local file(s) for an online corpus instead of downloading (jsonl[.gz|.zst], text, .zip)",
    )
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained BPE (default 8192)")
    p.add_argument("--tokenizer-type", default="HFTokenizer", choices=TOKENIZER_TYPES)
    p.add_argument("--vocab-file", default=None, help="use this tokenizer instead of training one")
    p.add_argument("--merge-file", default=None)
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--force", action="store_true", help="rebuild outputs even if they exist")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def corpus_inputs(args: argparse.Namespace, corpus_dir: Path) -> list[str]:
    """Input files for the corpus: the stdlib jsonl (written once), a local --input, or a download."""
    if args.name == "stdlib":
        jsonl = corpus_dir / "stdlib.jsonl"
        if args.force or not jsonl.is_file():
            tmp = jsonl.with_suffix(".jsonl.part")
            write_jsonl(tmp, iter_stdlib_texts())
            tmp.replace(jsonl)
        return [str(jsonl)]
    if args.input:
        local = expand_input_paths(args.input)
    else:
        local = [str(download(ONLINE_CORPORA[args.name], corpus_dir))]
    return [str(p) for f in local for p in unpack_if_archive(Path(f), corpus_dir)]


def prepare(args: argparse.Namespace) -> Path:
    """Run the whole preparation; returns the dataset prefix."""
    start = time.perf_counter()
    corpus_dir = Path(args.data_dir) / args.name
    corpus_dir.mkdir(parents=True, exist_ok=True)
    inputs = corpus_inputs(args, corpus_dir)
    vocab_file, merge_file, tokenizer_type = args.vocab_file, args.merge_file, args.tokenizer_type
    if vocab_file is None and tokenizer_type != "CharLevelTokenizer":
        if tokenizer_type != "HFTokenizer":
            raise TokenizerError(
                f"--tokenizer-type {tokenizer_type} needs --vocab-file; only HFTokenizer is trained here."
            )
        vocab_file = str(corpus_dir / "tokenizer.json")
        if args.force or not Path(vocab_file).is_file():
            tok = train_byte_level_bpe(iter_texts(inputs), vocab_size=args.vocab_size)
            save_tokenizer(tok, vocab_file)
            print(f"trained tokenizer ({tok.get_vocab_size()} tokens) -> {vocab_file}")
        else:
            print(f"reusing {vocab_file}")
    prefix = corpus_dir / args.name
    dataset = Path(f"{prefix}_text_document")
    if args.force or not dataset_exists(dataset):
        spec = TextEncoderSpec(
            tokenizer_type,
            vocab_file,
            merge_file,
            ("text",),
            append_eod=True,
            vocab_size=vocab_size_of(tokenizer_type, vocab_file, merge_file),
        )
        write_indexed_datasets(
            iter_documents(inputs, ("text",)), spec, str(prefix), args.workers, progress=not args.no_progress
        )
    else:
        print(f"reusing {dataset}.bin/.idx")
    print(f"done in {time.perf_counter() - start:.1f}s: data_path {dataset}, vocab_file {vocab_file}")
    return dataset


def main(argv: list[str] | None = None) -> int:
    try:
        prepare(parse_args(argv))
    except (DataError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
