"""Tokenize documents into a token dataset and an aligned label dataset with -100 on masked tokens.

Everything up to and including the last occurrence of --mask-before-token in a document is masked
(a document without it is masked entirely); the rest is trained on.

    python tools/datasets/preprocess_data_with_mask.py --input qa.jsonl --output-prefix data/qa \
        --tokenizer-type HFTokenizer --vocab-file data/tokenizer.json --mask-before-token "Answer:" --append-eod

writes data/qa_text_document.bin/.idx and data/qa_text_label.bin/.idx; use them as train_data_paths and
train_label_data_paths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.document_readers import expand_input_paths, iter_documents  # noqa: E402
from megatron.errors import DataError  # noqa: E402
from megatron.data.indexed_dataset import best_fitting_dtype  # noqa: E402
from megatron.data.label_encoders import MaskedTextEncoderSpec  # noqa: E402
from megatron.data.preprocessing import (  # noqa: E402
    run_cli,
    runtime_args,
    tokenizer_args,
    vocab_size_of,
)
from megatron.errors import TokenizerError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runtime_args(p)
    p.add_argument("--jsonl-keys", nargs="+", default=["text"])
    p.add_argument(
        "--mask-before-token",
        required=True,
        help="text marking where the trained part starts (masked itself, as is all before it)",
    )
    tokenizer_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.ftfy:
            raise DataError("--ftfy is not supported by preprocess_data_with_mask.py; fix the text beforehand.")
        paths = expand_input_paths(args.input)
        vocab = vocab_size_of(args.tokenizer_type, args.vocab_file, args.merge_file)
        spec = MaskedTextEncoderSpec(
            args.tokenizer_type,
            args.vocab_file,
            args.merge_file,
            tuple(args.jsonl_keys),
            args.mask_before_token,
            args.append_eod,
            best_fitting_dtype(vocab),
        )
        run_cli(args, spec, iter_documents(paths, args.jsonl_keys))
    except (DataError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
