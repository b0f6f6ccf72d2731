#!/usr/bin/env python
"""Every CPU benchmark table of bench/README.md in one command, sized to finish in about 15 minutes on 2 idle
cores (the estimate per table is printed first; a loaded machine takes longer), each table printed as it finishes
and all of them together at the end, ready to paste (each title carries the date, commit, CPU and its fp32 / bf16
matmul rates):

    python tools/datasets/prepare_data.py      # once: the stdlib corpus the quickstart and preprocessing use
    python bench/run_all.py                    # the ~15-minute set
    python bench/run_all.py --all              # + the 125M-class model, DeepSpeed's MoE, ZeRO-Offload, async_save, LoRA
    python bench/run_all.py --only moe,recurrent --out /tmp/tables.md
    python bench/run_all.py --list             # the commands, without running them

Each benchmark runs in its own process (its contenders in theirs, the order turning every repeat, medians of 2 or 3
repeats); one that fails is reported and the others still run; the exit code is 1 when any failed."""

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from typing import List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str
    argv: Tuple[str, ...]
    """The script and its flags, from the repository root."""
    minutes: float
    """About how long it runs on 2 idle cores of the development machine (2026-11-28 step times)."""


DEFAULT_SET = (
    Benchmark("train", ("bench/train_throughput.py", "--steps", "3", "--warmup", "1", "--repeats", "2"), 2.5),
    Benchmark("train_bf16", ("bench/train_throughput.py", "--precision", "bf16", "--steps", "3", "--warmup", "1",
                             "--repeats", "2"), 2.0),
    Benchmark("moe", ("bench/moe_throughput.py", "--only", "dense,megablocks,mixtral", "--steps", "2", "--warmup",
                      "1", "--repeats", "3"), 3.5),
    Benchmark("recurrent", ("bench/recurrent_throughput.py", "--steps", "2", "--warmup", "1", "--repeats", "3"), 2.0),
    Benchmark("generate", ("bench/generate_throughput.py", "--repeats", "3"), 1.0),
    Benchmark("preprocess", ("bench/preprocess_throughput.py", "--repeats", "1"), 0.5),
    Benchmark("quickstart_precision", ("bench/quickstart_precision.py", "--repeats", "2"), 3.0),
)
"""The tables re-measured by default (about 15 minutes on 2 idle cores)."""
EXTRA_SET = (
    Benchmark("train_large", ("bench/train_throughput.py", "--size", "large", "--steps", "2", "--warmup", "1",
                              "--repeats", "2"), 4.0),
    Benchmark("moe_deepspeed", ("bench/moe_throughput.py", "--only", "dense,deepspeed", "--steps", "2", "--warmup",
                                "1", "--repeats", "2"), 2.0),
    Benchmark("offload", ("bench/offload_throughput.py", "--size", "small", "--seq", "256", "--steps", "2",
                          "--warmup", "1", "--repeats", "1"), 1.5),
    Benchmark("async_save", ("bench/async_save.py",), 2.0),
    Benchmark("lora", ("bench/lora_step.py", "--size", "small", "--seq", "256", "--batch", "4", "--steps", "3",
                       "--repeats", "2"), 1.0),
)
"""--all adds these (about 10 minutes more)."""


def tables(output: str) -> List[str]:
    """The markdown tables a benchmark printed (bench.common.print_table: a '### title' line, a blank line, the
    rows), in order."""
    found, current = [], None
    for line in output.splitlines():
        if line.startswith("### "):
            current = [line, ""]
            found.append(current)
        elif current is not None and line.startswith("|"):
            current.append(line)
        elif current is not None and line.strip() and len(current) > 2:
            current = None
    return ["\n".join(lines) for lines in found]


def run(benchmark: Benchmark) -> Tuple[int, str]:
    """(exit code, everything it printed), its output passed through as it comes."""
    process = subprocess.Popen([sys.executable, *benchmark.argv], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    lines = []
    for line in process.stdout:
        lines.append(line)
        print(f"[{benchmark.name}] {line}", end="", flush=True)
    return process.wait(), "".join(lines)


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--all", action="store_true", help="add the 125M-class model, DeepSpeed's MoE layer, ZeRO-Offload, async_save and LoRA")
    parser.add_argument("--only", help="comma list of benchmark names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the benchmarks and their commands, run nothing")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> List[Benchmark]:
    every = DEFAULT_SET + EXTRA_SET
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {b.name for b in every})
        if unknown:
            sys.exit(f"--only: unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(b.name for b in every)}")
        return [b for b in every if b.name in names]
    return list(DEFAULT_SET + (EXTRA_SET if args.all else ()))


def main(argv: Sequence[str] = None) -> int:
    args = parse_args(argv)
    benchmarks = chosen(args)
    for b in benchmarks:
        print(f"{b.name:22s} ~{b.minutes:.1f} min  python {' '.join(b.argv)}")
    print(f"about {sum(b.minutes for b in benchmarks):.0f} minutes on 2 idle cores", flush=True)
    if args.list:
        return 0
    if not os.path.exists(os.path.join(REPO, "data", "stdlib", "tokenizer.json")) and \
            any(b.name in ("quickstart_precision", "preprocess") for b in benchmarks):
        print("note: data/stdlib/ is missing; run python tools/datasets/prepare_data.py first", flush=True)
    start, results, failed = time.monotonic(), [], []
    for b in benchmarks:
        began = time.monotonic()
        code, output = run(b)
        minutes = (time.monotonic() - began) / 60
        print(f"[{b.name}] finished in {minutes:.1f} min, exit code {code}", flush=True)
        results += [f"`python {' '.join(b.argv)}` ({minutes:.1f} min):\n\n{table}" for table in tables(output)]
        if code != 0 or not tables(output):
            failed.append(b.name)
    text = "\n\n".join(results)
    print(f"\n# All tables ({(time.monotonic() - start) / 60:.1f} min in all)\n\n{text}")
    if failed:
        print(f"\nfailed: {', '.join(failed)} (their output is above)")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
