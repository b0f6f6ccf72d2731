"""Concatenate several indexed datasets (.bin/.idx of the same dtype) into one, in the order given.

    python tools/datasets/merge_datasets.py --inputs data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document
    python tools/datasets/merge_datasets.py --input-dir data/shards --output-prefix data/all_text_document
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.errors import DataError  # noqa: E402
from megatron.data.indexed_dataset import MMapIndexedDataset, merge_indexed_datasets  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--inputs", nargs="+", help="dataset prefixes (without .bin/.idx), merged in this order")
    src.add_argument("--input-dir", help="merge every *.idx/.bin pair in this directory, sorted by name")
    p.add_argument("--output-prefix", required=True)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.input_dir:
            prefixes = [str(p.with_suffix("")) for p in sorted(Path(args.input_dir).glob("*.idx"))]
            if not prefixes:
                raise DataError(f"--input-dir '{args.input_dir}' holds no .idx files.")
        else:
            prefixes = args.inputs
        merge_indexed_datasets(prefixes, args.output_prefix)
        merged = MMapIndexedDataset(args.output_prefix)
        print(
            f"merged {len(prefixes)} datasets into {args.output_prefix}: "
            f"{merged.num_documents} documents, {merged.num_tokens} tokens"
        )
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
