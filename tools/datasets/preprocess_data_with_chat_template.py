"""Tokenize chat JSONL into tokens and labels (-100 where no loss is taken), with GPT-NeoX's flags and file names.

Each `--jsonl-keys` key (default `messages`; `chosen` / `rejected` for preference pairs) holds a list of
{"role", "content"} turns and becomes `{prefix}_{key}_document.bin/.idx` and `{prefix}_{key}_label_document.bin/.idx`.

With `--tokenizer-path` (a Hugging Face tokenizer folder whose tokenizer_config.json carries the Jinja chat
template, or `--chat-template TEXT_OR_FILE`) the conversation is rendered by transformers' apply_chat_template,
as GPT-NeoX's tool does (megatron/data/chat_template.py):

    python tools/datasets/preprocess_data_with_chat_template.py --input pairs.jsonl \
        --output-prefix data/pairwise/dpo_train --tokenizer-path hf_tokenizer/ --jsonl-keys chosen rejected --only-last

  --only-last      train on the last turn only (DPO pairs)
  --for-rm         train on nothing but the final EOS, the token a reward model scores
  --no-mask        train on every token
  --reward-key K   also write {prefix}_{key}_reward_document (KTO); --binary-reward: true/false -> +1/-1

Without --tokenizer-path the framework's own template is used with --tokenizer-type / --vocab-file
(megatron/data/label_encoders.py: "<|ROLE|>\\n" + content + "\\n", assistant turns end with the eod token;
--only-last-turn, --role-format).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.chat_template import ChatTemplateEncoderSpec, load_chat_tokenizer  # noqa: E402
from megatron.data.document_readers import expand_input_paths, is_jsonl, iter_json_records  # noqa: E402
from megatron.errors import DataError  # noqa: E402
from megatron.data.indexed_dataset import best_fitting_dtype  # noqa: E402
from megatron.data.label_encoders import DEFAULT_ROLE_FORMAT, ChatEncoderSpec  # noqa: E402
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
    p.add_argument("--jsonl-keys", nargs="+", default=["messages"], help="keys holding message lists")
    p.add_argument("--only-last", "--only-last-turn", dest="only_last", action="store_true",
                   help="train only on the last (assistant) turn")
    g = tokenizer_args(p, required=False)
    g.add_argument("--tokenizer-path", default=None,
                   help="Hugging Face tokenizer folder; its chat template renders the conversations")
    g.add_argument("--chat-template", default=None, help="Jinja chat template (text or a file), replacing the "
                                                         "tokenizer's (--tokenizer-path)")
    g.add_argument("--generation-role", default="assistant", help="the role whose turns are trained on")
    g.add_argument("--for-rm", action="store_true", help="train only on the final EOS (reward-model data)")
    g.add_argument("--no-mask", action="store_true", help="train on every token")
    g.add_argument("--reward-key", default=None, help="key of a per-record reward, written as {key}_reward_document")
    g.add_argument("--binary-reward", action="store_true", help="the reward is true/false: written as +1/-1")
    p.add_argument("--role-format", default=DEFAULT_ROLE_FORMAT,
                   help="built-in template (no --tokenizer-path): header before each message; {role} is filled in")
    return p.parse_args(argv)


def _spec(args: argparse.Namespace):
    if args.tokenizer_path:
        if args.tokenizer_type or args.vocab_file:
            raise DataError("give either --tokenizer-path (Hugging Face folder with a chat template) or "
                            "--tokenizer-type/--vocab-file (built-in template), not both")
        tok = load_chat_tokenizer(args.tokenizer_path, args.chat_template)  # fail here, not in a worker
        return ChatTemplateEncoderSpec(args.tokenizer_path, tuple(args.jsonl_keys), args.chat_template,
                                       args.generation_role, args.only_last, args.for_rm, args.no_mask,
                                       args.reward_key, args.binary_reward, best_fitting_dtype(len(tok)))
    if not args.tokenizer_type:
        raise DataError("name a tokenizer: --tokenizer-path HF_FOLDER (its chat template), or --tokenizer-type "
                        "and --vocab-file (the built-in template)")
    unsupported = [flag for flag, on in (("--chat-template", args.chat_template), ("--for-rm", args.for_rm),
                                         ("--no-mask", args.no_mask), ("--reward-key", args.reward_key))
                   if on]
    if unsupported or args.generation_role != "assistant":
        raise DataError(f"{', '.join(unsupported) or '--generation-role'} needs --tokenizer-path (a Hugging Face "
                        f"tokenizer folder); the built-in template supports --only-last and --role-format")
    if len(args.jsonl_keys) != 1:
        raise DataError("the built-in template reads one --jsonl-keys key; use --tokenizer-path for several")
    vocab = vocab_size_of(args.tokenizer_type, args.vocab_file, args.merge_file)
    return ChatEncoderSpec(args.tokenizer_type, args.vocab_file, args.merge_file, args.jsonl_keys[0],
                           args.role_format, args.only_last, best_fitting_dtype(vocab))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.ftfy or args.append_eod:
            raise DataError("--ftfy and --append-eod do not apply to chat data (assistant turns already end with eod).")
        paths = expand_input_paths(args.input)
        bad = [p for p in paths if not is_jsonl(p)]
        if bad:
            raise DataError(f"chat input must be JSON lines (.jsonl[.gz|.zst]); got '{bad[0]}'.")
        run_cli(args, _spec(args), iter_json_records(paths))
    except (DataError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
