#!/usr/bin/env python
"""Asynchronous checkpoint saves: what a save costs the training loop with and without async_save.

Both modes train the same model through deepy.py train.py (random tokens, as bench/train_throughput.py) and save
every --every steps (checkpoint_factor). Read from the run's metrics (wall_clock_breakdown): the time the loop
stands still for each save (``time_ms/save``: the whole write with synchronous saves — DeepSpeed's own
checkpoint engine, the competitor — only the copy to CPU memory with async_save), the k-th step after a save
(async_save's write runs during them, paced over most of the time to the next save) against the synchronous run's
steps, which no write overlaps, and the time per iteration with the saves included. Then, in this process, what
writing a --writer-mb MB state costs in CPU: the writer thread's own CPU time, and the whole machine's busy time
(on a virtual machine the disk's work shows up as steal time on the cores that train), for the first writer
(torch.save, fsync, the SHA-256 read back) against megatron.checkpoint.hashed_save (O_DIRECT from the page-aligned snapshot,
XXH3-128 as written, no torch CRC32).

    python bench/async_save.py                      # 6 layers, hidden 512: an 845 MB file of weights and Adam state
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


def measure(records: List[Dict], every: int, steps: int) -> Dict[str, object]:
    """Saves happen after the steps that are multiples of ``every``; the loop's pause for one shows as
    time_ms/save in the next record (and the final save's is not logged: it is left out). With async_save the
    write runs during the steps after a save (spread over most of them): the median of the k-th step after a
    save, for k = 1 .. every - 1, and the steps before the first save (no write yet)."""
    saved_after = list(range(every, steps, every))
    by_iteration = {r["iteration"]: r for r in records}
    pauses = [by_iteration[i + 1].get("time_ms/save", 0.0) / 1000 for i in saved_after]
    after = [median([by_iteration[i + k]["iteration_time_s"] for i in saved_after if i + k in by_iteration])
             for k in range(1, every)]
    before = median([r["iteration_time_s"] for r in records if 1 < r["iteration"] <= every])
    steady = median([r["iteration_time_s"] for r in records if r["iteration"] > 1])
    per_iteration = (sum(r["iteration_time_s"] for r in records if r["iteration"] > 1) + sum(pauses)) / (steps - 1)
    return {"pause": median(pauses), "pauses": pauses, "after": after, "before": before, "steady": steady,
            "per_iteration": per_iteration}


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy so far, the hypervisor's steal included (Linux /proc/stat)."""
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def writer_cpu_seconds(megabytes: int, repeats: int, directory: str) -> Dict[str, Dict[str, float]]:
    """{method: {'thread': median CPU seconds of the calling thread, 'machine': median busy seconds of the whole
    machine (steal included: a virtual disk's work)}} to write a state of ``megabytes`` MB of fp32 tensors."""
    import hashlib

    import torch

    from megatron.checkpoint.async_save import ArenaPool, snapshot
    from megatron.checkpoint.hashed_save import save_hashed

    state = {f"t{i}": torch.randn(1 << 20) for i in range(megabytes // 4)}  # 4 MB tensors, as an optimizer's
    copied, _ = snapshot(state, ArenaPool())  # where async_save's writer finds them: page-aligned
    path = os.path.join(directory, "writer.pt")

    def read_back() -> None:
        torch.save(state, path)
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
            hashlib.file_digest(handle, "sha256")

    methods: Dict[str, Callable[[], object]] = {
        "torch.save (CRC32), fsync, SHA-256 read back (the first writer)": read_back,
        "O_DIRECT from the snapshot, XXH3-128 as written (megatron.checkpoint.hashed_save)": lambda: save_hashed(copied, path)}
    seconds: Dict[str, Dict[str, List[float]]] = {name: {"thread": [], "machine": []} for name in methods}
    for _ in range(repeats):
        for name, write in methods.items():
            start, busy = time.thread_time(), machine_busy_seconds()
            write()
            seconds[name]["thread"].append(time.thread_time() - start)
            seconds[name]["machine"].append(machine_busy_seconds() - busy)
            os.remove(path)
    return {name: {kind: median(values) for kind, values in kinds.items()} for name, kinds in seconds.items()}


def print_writer_table(args) -> None:
    with tempfile.TemporaryDirectory() as directory:
        seconds = writer_cpu_seconds(args.writer_mb, args.repeats, directory)
    first = next(iter(seconds.values()))
    print_table(f"The writer's CPU time per save of {args.writer_mb} MB (median of {args.repeats}), on "
                f"{machine_description()}", ["writer", "writer thread CPU s", "whole machine busy s (steal included)",
                                             "thread vs first", "machine vs first"],
                [[name, f"{value['thread']:.3f}", f"{value['machine']:.3f}", f"{value['thread'] / first['thread']:.2f}",
                  f"{value['machine'] / first['machine']:.2f}"] for name, value in seconds.items()])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="medium")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20,
                        help="the saves measured are those before the last step (the last one's pace has only the "
                             "steps to the end)")
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
    baseline = results.get("synchronous (DeepSpeed's engine)", {}).get("steady")
    rows = []
    for name, r in results.items():
        reference = baseline or r["before"]
        rows.append([name, f"{r['pause']:.3f}", f"{r['before']:.3f}"]
                    + [f"{value:.3f} ({value / reference:.2f})" for value in r["after"]]
                    + [f"{r['per_iteration']:.3f}"])
    shape = SIZES[args.size]
    print_table(f"Checkpoint saves every {args.every} steps: {args.size} ({shape['num_layers']} layers, hidden "
                f"{shape['hidden_size']}), seq {args.seq}, batch {args.batch}, fp32 Adam, on {machine_description()}; "
                f"in brackets: against the synchronous run's median step ({baseline or 0:.3f} s), which no write "
                f"overlaps", ["save", "loop paused per save s", "step s before the first save"]
                + [f"step {k} after a save s" for k in range(1, args.every)] + ["s per iteration incl. saves"], rows)
    print_writer_table(args)


if __name__ == "__main__":
    main()
