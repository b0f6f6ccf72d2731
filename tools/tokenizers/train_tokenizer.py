"""Train a byte-level BPE tokenizer (HFTokenizer format) from jsonl / jsonl.gz / jsonl.zst / text files.

python tools/tokenizers/train_tokenizer.py --input data.jsonl --output out/tokenizer.json --vocab-size 8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.document_readers import expand_input_paths, iter_texts  # noqa: E402
from megatron.tokenizer.training import DEFAULT_SPECIAL_TOKENS, save_tokenizer, train_byte_level_bpe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, nargs="+", help="files, globs or comma-separated lists")
    p.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--jsonl-key", default="text", help="key holding the text in jsonl inputs")
    p.add_argument(
        "--special-tokens",
        nargs="*",
        default=list(DEFAULT_SPECIAL_TOKENS),
        help="special tokens, lowest ids first; the first is the end-of-document token",
    )
    p.add_argument("--gpt2-files", action="store_true", help="also write vocab.json + merges.txt beside it")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = expand_input_paths(args.input)
    start = time.perf_counter()
    tok = train_byte_level_bpe(
        iter_texts(paths, args.jsonl_key), args.vocab_size, args.special_tokens, args.min_frequency
    )
    written = save_tokenizer(tok, args.output, args.gpt2_files)
    print(
        f"trained vocab of {tok.get_vocab_size()} on {len(paths)} file(s) in {time.perf_counter() - start:.1f}s; "
        f"wrote {', '.join(map(str, written))}"
    )


if __name__ == "__main__":
    main()
