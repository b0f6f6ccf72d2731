"""Tokenize jsonl / jsonl.gz / jsonl.zst / text files into Megatron indexed datasets.

    python tools/datasets/preprocess_data.py --input data/*.jsonl --output-prefix data/mydata \
        --tokenizer-type HFTokenizer --vocab-file data/tokenizer.json --append-eod --workers 2

writes data/mydata_text_document.bin/.idx (one per --jsonl-keys key) and prints documents/s and tokens/s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.document_readers import expand_input_paths, iter_documents  # noqa: E402
from megatron.errors import DataError, TokenizerError  # noqa: E402
from megatron.data.preprocessing import (  # noqa: E402
    TextEncoderSpec,
    run_cli,
    runtime_args,
    tokenizer_args,
    vocab_size_of,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runtime_args(p)
    p.add_argument("--jsonl-keys", nargs="+", default=["text"], help="jsonl keys to tokenize (one dataset each)")
    tokenizer_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        paths = expand_input_paths(args.input)
        vocab_size = vocab_size_of(args.tokenizer_type, args.vocab_file, args.merge_file)
        spec = TextEncoderSpec(
            args.tokenizer_type,
            args.vocab_file,
            args.merge_file,
            tuple(args.jsonl_keys),
            args.append_eod,
            args.ftfy,
            vocab_size,
        )
        run_cli(args, spec, iter_documents(paths, args.jsonl_keys))
    except (DataError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
