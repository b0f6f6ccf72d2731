"""Make the worked post-training example's data offline: chat, preference and evaluation sets from Python's
standard library (megatron/data/docstring_chat.py), tokenized with GPT-NeoX's chat-template tool.

    python tools/datasets/prepare_data.py                    # the stdlib corpus and its tokenizer (once)
    python tools/datasets/make_chat_example.py               # -> data/chat_example/
    python deepy.py train.py configs/cpu_tiny.yml            # pretrain (or any checkpoint of that model)
    python deepy.py train.py configs/post_training/sft_tiny.yml
    python deepy.py train.py configs/post_training/dpo_tiny.yml
    python deepy.py eval.py configs/post_training/dpo_tiny.yml --eval_tasks data/chat_example/tasks/docstring_mc.yaml

Writes DATA_DIR/chat_example/: tokenizer/ (the corpus tokenizer with a chat template), sft_* (messages, loss on
the answers), dpo_* (chosen / rejected, loss on the last turn) and tasks/docstring_mc.yaml (an lm-eval task on functions held out of training) and tasks/docstring_mc_seen.yaml
(the same on trained functions).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.docstring_chat import write_docstring_chat, write_tokenizer_folder  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-d", "--data-dir", default="./data", help="output directory (default ./data)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json to use (default DATA_DIR/stdlib/tokenizer.json, prepare_data.py's)")
    p.add_argument("--examples", type=int, default=3000, help="documented functions to read (default 3000)")
    p.add_argument("--eval-examples", type=int, default=100, help="held out for the evaluation task")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = Path(args.data_dir)
    tokenizer = Path(args.tokenizer) if args.tokenizer else data_dir / "stdlib" / "tokenizer.json"
    if not tokenizer.is_file():
        print(f"error: no tokenizer at {tokenizer}: run `python tools/datasets/prepare_data.py -d {data_dir}` first, "
              f"or pass --tokenizer", file=sys.stderr)
        return 2
    out = data_dir / "chat_example"
    folder = write_tokenizer_folder(out / "tokenizer", tokenizer)
    try:
        paths = write_docstring_chat(out, eval_count=args.eval_examples, limit=args.examples)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from importlib import util

    spec = util.spec_from_file_location("chat_tool", Path(__file__).with_name("preprocess_data_with_chat_template.py"))
    tool = util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    common = ["--tokenizer-path", str(folder), "--workers", "1"]
    for argv_ in (["--input", str(paths["sft"]), "--output-prefix", str(out / "sft"), "--jsonl-keys", "messages"],
                  ["--input", str(paths["pairs"]), "--output-prefix", str(out / "dpo"), "--jsonl-keys", "chosen",
                   "rejected", "--only-last"]):
        code = tool.main(argv_ + common)
        if code:
            return code
    print(f"wrote {out}: sft_messages_*, dpo_chosen_* / dpo_rejected_*, tasks/docstring_mc[_seen].yaml", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
