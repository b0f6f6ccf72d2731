#!/usr/bin/env python
"""Asynchronous checkpoint saves: what a save costs the training loop with and without async_save.

Both modes train the same model through deepy.py train.py (random tokens, as bench/train_throughput.py) and save
every --every steps (checkpoint_factor). Read from the run's metrics (wall_clock_breakdown): the time the loop
stands still for each save (``time_ms/save``: the whole write with synchronous saves — DeepSpeed's own
checkpoint engine, the competitor — only the copy to CPU memory with async_save), the step time of the two steps
after each save (a background write runs then) against steps without one, and the time per iteration with the
saves included. Then, in this process, the CPU seconds the writer thread spends per save of --writer-mb MB
(what competes with training for the cores): torch.save, fsync and the SHA-256 read back from the file (how the
writer worked before) against megatron.hashed_save (hashed as written, no torch CRC32) — CPU time of the thread,
so it holds on a machine that other work loads too.

    python bench/async_save.py                      # 6 layers, hidden 512: ~300 MB of weights and Adam state
    python bench/async_save.py --size small --steps 12 --every 3
    python bench/async_save.py --writer-only        # the writer's CPU table alone (seconds)
"""

import argparse
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import machine_description, median, print_table, train_with_deepy  # noqa: E402
from bench.train_throughput import write_data  # noqa: E402

SIZES = {"tiny": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},     # smoke test of the script
         "small": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 8},
         "medium": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8}}
MODES = {"synchronous (DeepSpeed's engine)": False, "async_save": True}


def train_config(args, asynchronous: bool, data: Dict[str, str], directory: str) -> Dict:
    return {
        **SIZES[args.size], "seq_length": args.seq, "max_position_embeddings": args.seq, "pos_emb": "rotary",
        "norm": "layernorm", "activation": "gelu", "no_weight_tying": True, "make_vocab_size_divisible_by": 128,
        "tokenizer_type": "HFTokenizer", "vocab_file": data["vocab_file"], "data_path": data["data_path"],
        "split": "100,0,0", "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "train_iters": args.steps, "optimizer": {"type": "Adam", "params": {"lr": 1.0e-4}},
        "zero_optimization": {"stage": 0}, "num_gpus": 1, "num_workers": 0, "log_interval": 1,
        "steps_per_print": 1000000, "eval_interval": 1000000, "eval_iters": 0, "do_test": False,
        "log_dir": os.path.join(directory, "logs"), "save": os.path.join(directory, "ckpt", str(asynchronous)),
        "checkpoint_factor": args.every, "keep_last_n_checkpoints": 2, "async_save": asynchronous,
        "wall_clock_breakdown": True, "distributed_backend": "nccl", "seed": 1,
    }


def measure(records: List[Dict], every: int, steps: int) -> Dict[str, float]:
    """Saves happen after the steps that are multiples of ``every``; the loop's pause for one shows as
    time_ms/save in the next record (and the final save's is not logged: it is left out). The background write
    (at the lowest CPU priority) can overlap the two steps after a save: both are reported, against the steps
    that come later (no write in flight)."""
    saved_after = {i for i in range(every, steps, every)}
    by_iteration = {r["iteration"]: r for r in records}
    pauses = [by_iteration[i + 1].get("time_ms/save", 0.0) / 1000 for i in saved_after]
    first = [by_iteration[i + 1]["iteration_time_s"] for i in saved_after]
    second = [by_iteration[i + 2]["iteration_time_s"] for i in saved_after if i + 2 in by_iteration]
    quiet = [r["iteration_time_s"] for r in records
             if r["iteration"] > 1 and not {r["iteration"] - 1, r["iteration"] - 2} & saved_after]
    per_iteration = (sum(r["iteration_time_s"] for r in records if r["iteration"] > 1) + sum(pauses)) / (steps - 1)
    return {"pause": median(pauses), "first": median(first), "second": median(second), "quiet": median(quiet),
            "per_iteration": per_iteration}


def writer_cpu_seconds(megabytes: int, repeats: int, directory: str) -> Dict[str, float]:
    """{method: median CPU seconds of the calling thread to write a state of ``megabytes`` MB of fp32 tensors}."""
    import torch

    from megatron.checkpoint_integrity import file_digest
    from megatron.hashed_save import save_hashed

    state = {f"t{i}": torch.randn(1 << 20) for i in range(megabytes // 4)}  # 4 MB tensors, as an optimizer's
    path = os.path.join(directory, "writer.pt")

    def read_back() -> None:
        torch.save(state, path)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        file_digest(path)

    methods: Dict[str, Callable[[], object]] = {
        "torch.save (CRC32), fsync, SHA-256 read back": read_back,
        "hashed as written, no CRC32 (megatron.hashed_save)": lambda: save_hashed(state, path)}
    seconds: Dict[str, List[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, write in methods.items():
            start = time.thread_time()
            write()
            seconds[name].append(time.thread_time() - start)
            os.remove(path)
    return {name: median(values) for name, values in seconds.items()}


def print_writer_table(args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        seconds = writer_cpu_seconds(args.writer_mb, args.repeats, directory)
    first = next(iter(seconds.values()))
    print_table(f"The writer thread's CPU time per save of {args.writer_mb} MB (median of {args.repeats}), on "
                f"{machine_description()}", ["writer", "CPU s per save", "MB per CPU s", "vs before"],
                [[name, f"{value:.3f}", f"{args.writer_mb / value:.0f}", f"{value / first:.2f}"]
                 for name, value in seconds.items()])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--every", type=int, default=4, help="checkpoint_factor (>= 3: quiet steps between saves)")
    parser.add_argument("--port", type=int, default=29763)
    parser.add_argument("--writer-mb", type=int, default=300, help="the state the writer's CPU table writes")
    parser.add_argument("--repeats", type=int, default=3, help="of the writer's CPU table")
    parser.add_argument("--writer-only", action="store_true", help="only the writer's CPU table")
    parser.add_argument("--async-only", action="store_true",
                        help="train with async_save only (to repeat its measurement: the synchronous row's figures do "
                             "not depend on the writer)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.writer_only:
        print_writer_table(args)
        return
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        data = write_data(directory, args.batch * args.seq * (args.steps + 2) * 2)
        for name, asynchronous in MODES.items():
            if args.async_only and not asynchronous:
                continue
            records, _ = train_with_deepy(train_config(args, asynchronous, data, directory), directory,
                                          "async" if asynchronous else "sync", args.port)
            results[name] = measure(records, args.every, args.steps)
            print(f"{name}: {results[name]}\n  step times: {[round(r['iteration_time_s'], 2) for r in records]}",
                  flush=True)
    rows = [[name, f"{r['pause']:.3f}", f"{r['quiet']:.3f}", f"{r['first']:.3f}", f"{r['second']:.3f}",
             f"{r['first'] / r['quiet']:.2f}", f"{r['second'] / r['quiet']:.2f}", f"{r['per_iteration']:.3f}"]
            for name, r in results.items()]
    shape = SIZES[args.size]
    print_table(f"Checkpoint saves every {args.every} steps: {args.size} ({shape['num_layers']} layers, hidden "
                f"{shape['hidden_size']}), seq {args.seq}, batch {args.batch}, fp32 Adam, on {machine_description()}",
                ["save", "loop paused per save s", "step s (no write)", "1st step after a save s",
                 "2nd step after s", "1st / no write", "2nd / no write", "s per iteration incl. saves"], rows)
    print_writer_table(args)


if __name__ == "__main__":
    main()
