"""tools/tokenizers/train_tokenizer.py trains a usable HFTokenizer from jsonl and text files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron.tokenizer import build_tokenizer
from tests.neox_arguments.helpers import tiny
from tests.tokenizer.tokenizer_files import SAMPLE_TEXTS

REPO = Path(__file__).resolve().parents[2]


def test_train_tokenizer_cli(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in SAMPLE_TEXTS))
    txt = tmp_path / "b.txt"
    txt.write_text("plain text document\n" * 5)
    out = tmp_path / "tok" / "tokenizer.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools/tokenizers/train_tokenizer.py"),
            "--input",
            f"{jsonl},{txt}",
            "--output",
            str(out),
            "--vocab-size",
            "320",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    tok = build_tokenizer(tiny(tokenizer_type="HFTokenizer", vocab_file=str(out)))
    assert tok.vocab_size == 320 and tok.eod == 0
    assert tok.detokenize(tok.tokenize("plain text document")) == "plain text document"
