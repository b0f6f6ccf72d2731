"""Tokenize chat JSONL ({"messages": [{"role": ..., "content": ...}, ...]} per line) into tokens and labels,
with the loss only on assistant turns.

The template is this framework's own (see megatron/data/label_encoders.py): each message is
"<|ROLE|>\\n" + content + "\\n", and assistant turns end with the end-of-document token instead of the
newline. Role headers and non-assistant turns get label -100.

    python tools/datasets/preprocess_data_with_chat_template.py --input chats.jsonl --output-prefix data/chat \
        --tokenizer-type HFTokenizer --vocab-file data/tokenizer.json

writes data/chat_messages_document.bin/.idx and data/chat_messages_label.bin/.idx.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.document_readers import expand_input_paths, is_jsonl, iter_json_records  # noqa: E402
from megatron.data.errors import DataError  # noqa: E402
from megatron.data.indexed_dataset import best_fitting_dtype  # noqa: E402
from megatron.data.label_encoders import DEFAULT_ROLE_FORMAT, ChatEncoderSpec  # noqa: E402
from megatron.data.preprocessing import (  # noqa: E402
    run_cli,
    runtime_args,
    tokenizer_args,
    vocab_size_of,
)
from megatron.tokenizer import TokenizerError  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runtime_args(p)
    p.add_argument("--jsonl-keys", nargs=1, default=["messages"], help="key holding the message list")
    p.add_argument("--role-format", default=DEFAULT_ROLE_FORMAT, help="header before each message; {role} is filled in")
    p.add_argument("--only-last-turn", action="store_true", help="train only on the last assistant turn")
    tokenizer_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.ftfy or args.append_eod:
            raise DataError("--ftfy and --append-eod do not apply to chat data (assistant turns already end with eod).")
        paths = expand_input_paths(args.input)
        bad = [p for p in paths if not is_jsonl(p)]
        if bad:
            raise DataError(f"chat input must be JSON lines (.jsonl[.gz|.zst]); got '{bad[0]}'.")
        vocab = vocab_size_of(args.tokenizer_type, args.vocab_file, args.merge_file)
        spec = ChatEncoderSpec(
            args.tokenizer_type,
            args.vocab_file,
            args.merge_file,
            args.jsonl_keys[0],
            args.role_format,
            args.only_last_turn,
            best_fitting_dtype(vocab),
        )
        run_cli(args, spec, iter_json_records(paths))
    except (DataError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
