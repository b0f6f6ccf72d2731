"""Tokenizer files on both sides of a conversion.

Ours -> Hugging Face: config.json's eos_token_id and bos_token_id are the run's end-of-document token, for
every tokenizer type (GPT-NeoX's converter sets both to the tokenizer's eod). A ``tokenizer.json`` named by
the config (HFTokenizer, or HFGPT2Tokenizer given a tokenizer.json) is written with transformers'
PreTrainedTokenizerFast.save_pretrained, so the folder has tokenizer.json and tokenizer_config.json with
that token as eos. Hugging Face -> ours: the folder's tokenizer.json (HFTokenizer) or tokenizer.model
(SPMTokenizer) is copied next to the checkpoint and named in the YAML config.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, Dict, Mapping, Optional

from megatron.checkpoint_conversion.common import transformers_module
from megatron.errors import ConversionError, TokenizerError
from megatron.tokenizer import build_tokenizer_from

JSON_TOKENIZERS = ("HFTokenizer", "HFGPT2Tokenizer")


def run_tokenizer(args: Mapping[str, Any]) -> Optional[Any]:
    """The tokenizer the run trained with, or None (with a note) when its config names no tokenizer files."""
    kind = args.get("tokenizer_type") or "GPT2BPETokenizer"
    if kind != "CharLevelTokenizer" and not args.get("vocab_file"):
        print(f"note: tokenizer_type={kind!r} without a vocab_file: config.json gets no eos_token_id / "
              f"bos_token_id (set them yourself)", file=sys.stderr)
        return None

    try:
        return build_tokenizer_from(kind, args.get("vocab_file"), args.get("merge_file"))
    except TokenizerError as exc:
        raise ConversionError(f"{exc} (the run's tokenizer gives config.json its eos_token_id; fix vocab_file in "
                              f"the config, or run from the directory it is relative to)") from None


def special_token_ids(tokenizer: Any) -> Dict[str, int]:
    """config.json's eos_token_id and bos_token_id: the end-of-document token, as GPT-NeoX's converter sets
    them (pad_token_id, which a reward model's *ForSequenceClassification needs, is --pad-token-id)."""
    return {"eos_token_id": int(tokenizer.eod), "bos_token_id": int(tokenizer.eod)}


def write_hf_tokenizer(args: Mapping[str, Any], tokenizer: Any, out_dir: str, max_length: int) -> bool:
    """Write tokenizer.json and tokenizer_config.json with the run's ``tokenizer``; False (and a note saying
    why) when the config names no tokenizer.json."""
    kind = args.get("tokenizer_type")
    vocab_file = args.get("vocab_file")
    if kind not in JSON_TOKENIZERS or not vocab_file or not str(vocab_file).endswith(".json") or \
            args.get("merge_file"):
        print(f"note: tokenizer_type={kind!r} with vocab_file={vocab_file!r} is not a tokenizer.json; no "
              f"tokenizer files written (add the tokenizer to {out_dir} yourself)", file=sys.stderr)
        return False
    PreTrainedTokenizerFast = transformers_module().PreTrainedTokenizerFast

    eos = tokenizer.inv_vocab[tokenizer.eod]
    tok = PreTrainedTokenizerFast(tokenizer_file=vocab_file, eos_token=eos, bos_token=eos,
                                  model_max_length=int(max_length))
    tok.save_pretrained(out_dir)
    _portable_tokenizer_class(os.path.join(out_dir, "tokenizer_config.json"))
    return True


def _portable_tokenizer_class(config_path: str) -> None:
    """transformers 5 names the class TokenizersBackend, which 4.x cannot load; PreTrainedTokenizerFast is
    the same tokenizer under a name both read."""
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)


def copy_hf_tokenizer(hf_dir: str, out_dir: str) -> Optional[Dict[str, Any]]:
    """Copy the folder's tokenizer next to the checkpoint; returns the tokenizer settings for the YAML
    config and its vocabulary size, or None when the folder has no tokenizer this framework reads."""
    for name, kind in (("tokenizer.json", "HFTokenizer"), ("tokenizer.model", "SPMTokenizer")):
        source = os.path.join(hf_dir, name)
        if os.path.isfile(source):
            os.makedirs(out_dir, exist_ok=True)
            target = os.path.abspath(os.path.join(out_dir, name))
            shutil.copyfile(source, target)

            try:
                size = build_tokenizer_from(kind, target).vocab_size
            except TokenizerError as exc:
                print(f"note: {source} cannot serve as this framework's tokenizer ({exc}); the config names none",
                      file=sys.stderr)
                return None
            return {"tokenizer_type": kind, "vocab_file": target, "vocab_size": size}
    return None
