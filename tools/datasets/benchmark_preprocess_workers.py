"""Check that preprocess_data.py scales with --workers: time it on a generated input with 1 and N workers.

    python tools/datasets/benchmark_preprocess_workers.py            # 20 MB, workers 1 and 2

The input is the standard library corpus repeated to --size-mb, so it needs no network. Exits 1 if
the larger worker count is not faster. Timing on a shared machine is noisy: run it when idle.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.data.corpora import iter_stdlib_texts  # noqa: E402
from megatron.data.document_readers import write_jsonl  # noqa: E402
from megatron.tokenizer.training import save_tokenizer, train_byte_level_bpe  # noqa: E402

HERE = Path(__file__).resolve().parent


def make_input(path: Path, size_mb: float) -> int:
    """Write stdlib sources as jsonl, repeated until the file reaches size_mb; returns documents written."""
    target = int(size_mb * 1_000_000)
    texts = list(iter_stdlib_texts())
    chosen, total = [], 0
    for text in itertools.cycle(texts):
        if total >= target:
            break
        chosen.append(text)
        total += len(text.encode("utf-8")) + 12
    write_jsonl(path, chosen)
    return len(chosen)


def time_preprocess(inp: Path, tokenizer: Path, out_prefix: Path, workers: int) -> float:
    """Wall time of one preprocess_data.py run (a fresh process, as a user runs it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "preprocess_data.py"),
            "--input",
            str(inp),
            "--output-prefix",
            str(out_prefix),
            "--tokenizer-type",
            "HFTokenizer",
            "--vocab-file",
            str(tokenizer),
            "--append-eod",
            "--workers",
            str(workers),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"preprocess_data.py failed with {workers} worker(s): {proc.stderr}")
    print(f"workers={workers}: {elapsed:.2f}s  ({proc.stdout.splitlines()[0]})")
    return elapsed


def run(size_mb: float, worker_counts: list[int], workdir: Path) -> dict[int, float]:
    inp = workdir / "input.jsonl"
    docs = make_input(inp, size_mb)
    print(f"input: {inp.stat().st_size / 1e6:.1f} MB, {docs} documents")
    tokenizer = workdir / "tokenizer.json"
    sample = itertools.islice(iter_stdlib_texts(), 300)  # a few MB are plenty to learn the merges
    save_tokenizer(train_byte_level_bpe(sample, vocab_size=8192), tokenizer)
    return {w: time_preprocess(inp, tokenizer, workdir / f"out_w{w}", w) for w in worker_counts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=20.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        times = run(args.size_mb, args.workers, Path(d))
    lo, hi = min(args.workers), max(args.workers)
    print(f"speed-up {hi} vs {lo} workers: {times[lo] / times[hi]:.2f}x")
    return 0 if times[hi] < times[lo] else 1


if __name__ == "__main__":
    sys.exit(main())
