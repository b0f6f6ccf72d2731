#!/usr/bin/env python
"""Preprocessing throughput: tools/datasets/preprocess_data.py (read jsonl, tokenize, write .bin/.idx)
against the limit, a bare `tokenizers` encode_batch loop over the same texts (no reading, no writing),
with 1 and 2 workers / threads.

    python bench/preprocess_throughput.py              # 20 MB of stdlib sources, BPE with 8192 tokens
    python bench/preprocess_throughput.py --size-mb 50 --repeats 3

The input is Python's standard-library sources repeated to --size-mb (offline). Each row is the median
over --repeats runs; tokens/s counts the tokens written (EOD included), and the tool's time is the whole
command (interpreter start and imports included, about a second), as a user experiences it."""

import argparse
import itertools
import os
import sys
import tempfile
import time
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, machine_description, measure_command, median, print_table  # noqa: E402

BARE_LOOP = """
import json, os, sys, time
os.environ["RAYON_NUM_THREADS"] = sys.argv[3]
os.environ["TOKENIZERS_PARALLELISM"] = "true" if sys.argv[3] != "1" else "false"
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for line in open(sys.argv[2])]
start = time.perf_counter()
tokens = 0
for i in range(0, len(texts), 256):
    tokens += sum(len(e.ids) for e in tok.encode_batch(texts[i:i + 256]))
print(json.dumps({"seconds": time.perf_counter() - start, "tokens": tokens}))
"""


def make_input(path: str, size_mb: float) -> int:
    from megatron.data.corpora import iter_stdlib_texts
    from megatron.data.document_readers import write_jsonl

    target, total, chosen = int(size_mb * 1_000_000), 0, []
    for text in itertools.cycle(list(iter_stdlib_texts())):
        if total >= target:
            break
        chosen.append(text)
        total += len(text.encode("utf-8"))
    write_jsonl(path, chosen)
    return len(chosen)


def run_tool(jsonl: str, vocab: str, out: str, workers: int) -> float:
    cmd = [sys.executable, os.path.join(REPO, "tools", "datasets", "preprocess_data.py"), "--input", jsonl,
           "--output-prefix", out, "--tokenizer-type", "HFTokenizer", "--vocab-file", vocab, "--append-eod",
           "--workers", str(workers), "--no-progress"]
    start = time.perf_counter()
    result = measure_command(cmd)
    if result["returncode"] != 0:
        raise RuntimeError(result["stderr"][-3000:])
    return time.perf_counter() - start


def run_bare(jsonl: str, vocab: str, threads: int) -> float:
    import json

    result = measure_command([sys.executable, "-c", BARE_LOOP, vocab, jsonl, str(threads)])
    if result["returncode"] != 0:
        raise RuntimeError(result["stderr"][-3000:])
    return json.loads(result["stdout"].strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe

    with tempfile.TemporaryDirectory() as directory:
        jsonl = os.path.join(directory, "input.jsonl")
        docs = make_input(jsonl, args.size_mb)
        vocab = os.path.join(directory, "tokenizer.json")
        from megatron.data.corpora import iter_stdlib_texts

        save_tokenizer(train_byte_level_bpe(iter_stdlib_texts(), vocab_size=8192), vocab)
        rows: List[List[str]] = []
        out = os.path.join(directory, "out")
        tokens = None
        for workers in (1, 2):
            tool = median([run_tool(jsonl, vocab, out, workers) for _ in range(args.repeats)])
            if tokens is None:
                tokens = int(MMapIndexedDataset(f"{out}_text_document").sizes.sum())
            bare = median([run_bare(jsonl, vocab, workers) for _ in range(args.repeats)])
            rows.append([str(workers), f"{tokens / tool:,.0f}", f"{tokens / bare:,.0f}", f"{bare / tool:.2f}"])
    print_table(f"Preprocessing throughput: {args.size_mb:g} MB, {docs} documents, {tokens:,} tokens, "
                f"BPE 8192, on {machine_description()}",
                ["workers", "preprocess_data.py tokens/s (whole tool)", "bare encode_batch tokens/s (limit)",
                 "tool / limit"], rows)


if __name__ == "__main__":
    main()
